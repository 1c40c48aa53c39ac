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

# The whole suite, as CI runs it: the lint, then the fast lane (seconds: a broken codec or layer shows
# first), then every test that starts pools on torchx-nightly, and the TorchX-facing tests on torchx
# 0.7.0 (a second venv, made meanwhile). The `serial` tests that time a signal or load the machine run
# alone; then the 0.7 lane's parallel part runs one at a time beside the SLURM lab's tests, which wait
# on SLURM's clocks more than they compute; the 0.7 lane's own serial tests run last.
# Each test runs once per line; every part runs, and any failing fails the target. (`make`, not
# `$(MAKE)`, for the venv: make runs a line naming $(MAKE) even under -n, and this line is the suite.)
test: lint test-fast
	@make --no-print-directory setup VENV=.venv-torchx07 TORCHX_LINE=0.7.0 > $(T07_LOG).setup 2>&1 & s=$$!; \
	$(PARALLEL); a=$$?; \
	$(SERIAL_ALONE); e=$$?; \
	wait $$s || { cat $(T07_LOG).setup; exit 1; }; \
	echo "(the torchx 0.7.0 lane runs beside the SLURM lab's tests: its output follows theirs)"; \
	nice -n 5 $(T07) -m "not serial" -p no:xdist > $(T07_LOG) 2>&1 & t=$$!; \
	$(SERIAL_LAB); b=$$?; wait $$t; c=$$?; cat $(T07_LOG); \
	$(T07) -m serial -p no:xdist; d=$$?; exit $$((a || b || c || d || e))

# this machine sets PYTHONDONTWRITEBYTECODE: without bytecode on disk, every agent, CLI and proc of the
# tests compiles this package's modules again (about 0.1 s of CPU each, thousands of times); each test
# target compiles first (`test` through its `test-fast`)
COMPILE = $(BIN)/python -m compileall -q -j 0 monarch_torchx tests compat > /dev/null
# Two at a time (xdist), as the tests wait on pools and agents more than they compute (a module with a
# module-wide pool stays on one worker: xdist_group); then, alone, the `serial` ones (tests/conftest.py).
# Each names its 15 slowest tests (where CI time goes).
PARALLEL = $(BIN)/python -m pytest -q -m "integration and not serial" -n 2 --dist loadgroup --durations=15
SERIAL = $(BIN)/python -m pytest -q -m "integration and serial" -p no:xdist --durations=15
SERIAL_ALONE = $(BIN)/python -m pytest -q -m "integration and serial and not slurm_lab" -p no:xdist --durations=15
SERIAL_LAB = $(BIN)/python -m pytest -q -m "integration and slurm_lab" -p no:xdist --durations=15
T07 = .venv-torchx07/bin/python -m pytest -q $(if $(FULL),,$(TORCHX07_TESTS))
T07_LOG = .venv-torchx07.log

# every integration test on torchx-nightly (no lint, no fast lane, no 0.7 lane); both parts run
test-integration: setup
	$(COMPILE); $(PARALLEL); a=$$?; $(SERIAL); b=$$?; exit $$((a || b))

# The fast lane: what needs no pool, agent, proc, CLI subprocess, SLURM lab or FUSE (tests/unit/ and the
# pure modules), in well under a minute. `make test` still runs everything.
test-fast: setup
	$(COMPILE); $(BIN)/python -m pytest -q -m "not integration" -p no:cacheprovider

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
	$(COMPILE); $(T07) -m "not serial" -n 2 --dist loadgroup; a=$$?; $(T07) -m serial -p no:xdist; b=$$?; exit $$((a || b))

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
