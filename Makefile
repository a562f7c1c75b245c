# Two commands do everything on a fresh machine: `make bench` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_ARGS ?= --preset default --network auto --out bench_out

.PHONY: bench test test-faults docs setup clean

bench: $(STAMP)
	$(PY) -m torchrec_het_bench $(BENCH_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests -m "not faults"

# The slow fault runs (link cuts on emulated hosts, kills at worst moments; pytest marker `faults`).
test-faults: $(STAMP)
	$(PY) -m pytest -q tests -m faults

# docs/benchmarks.md from the committed results (python -m torchrec_het_bench.docs).
docs: $(STAMP)
	$(PY) -m torchrec_het_bench.docs $(sort $(wildcard docs/results/*.json)) --out docs/benchmarks.md

setup: $(STAMP)

# Rebuilt whenever the pinned stack or the package metadata changes.
$(STAMP): pyproject.toml requirements/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q --no-deps torchrec==1.8.0
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c "import torch, fbgemm_gpu, torchrec, torchx, iopath, torchrec_het.sharders"
	touch $(STAMP)

clean:
	rm -rf $(VENV)
