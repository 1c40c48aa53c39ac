# The two commands a newcomer needs:  `make demo`  and  `make test`.
PY ?= python3
VENV ?= .venv
TORCHX_LINE ?= nightly
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench bench-slurm bench-actors bench-ddp bench-ddp-slurm docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml compat/torchx07/pyproject.toml scripts/setup.sh
	PY=$(PY) VENV=$(VENV) TORCHX_LINE=$(TORCHX_LINE) bash scripts/setup.sh
	touch $(STAMP)

demo: setup
	$(BIN)/python examples/demo.py

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/warm_relaunch.py

bench-actors: setup
	$(BIN)/pip install -q -e '.[bench-peers]'
	$(BIN)/python benchmarks/actors.py

bench-ddp: setup
	$(BIN)/python benchmarks/warm_ddp.py

bench-ddp-slurm: setup
	$(BIN)/python benchmarks/warm_ddp.py --slurm

bench-slurm: setup
	$(BIN)/python benchmarks/warm_relaunch.py --slurm

docs: setup
	$(BIN)/python -m monarch_torchx.docs README.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
