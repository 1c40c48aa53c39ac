# The two commands a newcomer needs:  `make demo`  and  `make test`.
PY ?= python3
VENV ?= .venv
TORCHX_LINE ?= nightly
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo lint test test-fast test-integration test-torchx07 bench bench-slurm bench-actors bench-ddp bench-ddp-slurm bench-history bench-queue device-check docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml compat/torchx07/pyproject.toml scripts/setup.sh
	PY=$(PY) VENV=$(VENV) TORCHX_LINE=$(TORCHX_LINE) bash scripts/setup.sh
	touch $(STAMP)

demo: setup
	$(BIN)/python examples/demo.py

# The whole suite: the lint, then the fast lane (seconds: a broken codec or layer shows first),
# then every test that starts pools. Each test runs once.
test: lint test-fast test-integration

# ruff (lint and format, one line length) and mypy, as configured in pyproject.toml
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two at a time (xdist), as the tests wait on pools and agents more than they compute (a module with a
# module-wide pool stays on one worker: xdist_group); then, alone, the `serial` ones (tests/conftest.py).
# Both parts run; either failing fails the target. Each names its 15 slowest tests (where CI time goes).
test-integration: setup
	$(BIN)/python -m pytest -q -m "integration and not serial" -n 2 --dist loadgroup --durations=15; a=$$?; \
	$(BIN)/python -m pytest -q -m "integration and serial" -p no:xdist --durations=15; b=$$?; exit $$((a || b))

# The fast lane: what needs no pool, agent, proc, CLI subprocess, SLURM lab or FUSE (tests/unit/ and the
# pure modules), in well under a minute. `make test` still runs everything.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not integration" -p no:cacheprovider

# The tests that meet TorchX's own API (schedulers, CLI, Runner, components, dry-runs, the README)
# on the other TorchX line, torchx 0.7.0, in a venv of its own. FULL=1: the whole suite there. The
# README's SLURM and Kubernetes blocks meet TorchX as its local block does: they run on the main line,
# and so do submitit's tests (submitit's API, not TorchX's).
TORCHX07_TESTS := tests/test_local_runner.py tests/test_cli.py tests/test_launch_specs.py tests/test_docs.py \
	tests/test_dryrun.py tests/test_readme.py tests/test_torchrun.py tests/test_first_contact.py \
	--deselect tests/test_readme.py::test_the_readmes_slurm_block_runs_as_written_on_the_lab \
	--deselect tests/test_readme.py::test_the_readmes_kubernetes_block_runs_as_written_on_the_emulated_cluster
# Two at a time, then the `serial` ones alone, as test-integration runs them.
test-torchx07:
	$(MAKE) setup VENV=.venv-torchx07 TORCHX_LINE=0.7.0
	.venv-torchx07/bin/python -m pytest -q -m "not serial" -n 2 --dist loadgroup $(if $(FULL),,$(TORCHX07_TESTS)); a=$$?; \
	.venv-torchx07/bin/python -m pytest -q -m serial -p no:xdist $(if $(FULL),,$(TORCHX07_TESTS)); b=$$?; exit $$((a || b))

bench: setup
	$(BIN)/python benchmarks/warm_relaunch.py

bench-actors: setup
	$(BIN)/pip install -q -e '.[bench-peers]'
	$(BIN)/python benchmarks/actors.py

bench-ddp: setup
	$(BIN)/python benchmarks/warm_ddp.py

bench-history: setup
	$(BIN)/python benchmarks/app_history.py --n 5

bench-queue: setup
	$(BIN)/pip install -q -e '.[bench-peers]'
	$(BIN)/python benchmarks/queue_tasks.py

# once, on a machine with NVIDIA GPUs (no network, about 4 minutes): what this project's build
# machines cannot check (docs/placement.md); exits 2 at once where there is no GPU
device-check: setup
	$(BIN)/python benchmarks/device_check.py

bench-ddp-slurm: setup
	$(BIN)/python benchmarks/warm_ddp.py --slurm

bench-slurm: setup
	$(BIN)/python benchmarks/warm_relaunch.py --slurm

docs: setup
	$(BIN)/python -m monarch_torchx.docs README.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
