# Two commands do everything on a fresh machine: `make bench` and `make test`.
#
# STACK picks the pinned TorchRec stack (requirements/torchrec-$(STACK).txt), each in its own venv:
#   1.8 (default): torchrec 1.8.0, torch 2.13.0+cpu, fbgemm-gpu-cpu 1.8.0 -> .venv
#   1.9:           torchrec 1.9.2, torch 2.14.1,     fbgemm-gpu-cpu 1.9.0 -> .venv-1.9
# TESTS picks what `make test` runs (pytest paths and options), e.g.
#   make test STACK=1.9 TESTS="tests/unit tests/distributed"
PYTHON ?= python3
STACK ?= 1.8
STACKS := 1.8 1.9
TESTS ?= tests
BENCH_ARGS ?= --preset default --network auto --rounds 10 --steps-per-round 12 --warmup-steps 20 --profile-steps 10 --out bench_out

ifeq ($(filter $(STACK),$(STACKS)),)
$(error STACK=$(STACK) is not a supported stack; choose one of: $(STACKS))
endif

REQUIREMENTS := requirements/torchrec-$(STACK).txt
VENV := $(if $(filter 1.8,$(STACK)),.venv,.venv-$(STACK))
PY := $(VENV)/bin/python
# torchrec goes in with --no-deps (its metadata names the CUDA fbgemm-gpu wheel); its pin is
# the requirements file's "#no-deps:" line.
NO_DEPS = $(shell sed -n 's/^#no-deps: *//p' $(REQUIREMENTS))
# One stamp per stack, rebuilt whenever its pinned file or the package metadata changes.
STAMP := $(VENV)/.installed-torchrec-$(STACK)

.PHONY: bench test test-faults lint docs setup clean

bench: $(STAMP)
	$(PY) -m torchrec_het_bench $(BENCH_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(TESTS) -m "not faults"

# The slow fault runs (link cuts on emulated hosts, kills at worst moments; pytest marker `faults`).
test-faults: $(STAMP)
	$(PY) -m pytest -q tests -m faults

# The formatter and linter in check mode (ruff; settings in pyproject.toml). `ruff format .`
# and `ruff check --fix .` (with $(VENV)/bin/ruff) make most of what they report right.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# docs/benchmarks.md from the committed results (python -m torchrec_het_bench.docs).
docs: $(STAMP)
	$(PY) -m torchrec_het_bench.docs $(sort $(wildcard docs/results/*.json)) --out docs/benchmarks.md

setup: $(STAMP)

$(STAMP): pyproject.toml $(REQUIREMENTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r $(REQUIREMENTS)
	$(PY) -m pip install -q --no-deps $(NO_DEPS)
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c "import torch, fbgemm_gpu, torchrec, torchx, iopath, torchrec_het.sharders"
	$(PY) -c "import torchrec_het._compat as c, sys; sys.exit(0 if c.check_torchrec_version() else 1)"
	touch $(STAMP)

# The wheel as a user installs it (.ci/wheel-smoke): built into dist/, installed with this stack's
# pinned requirements into a fresh venv in a temporary directory, and a 2-rank training smoke
# through the launcher run from outside the repository. The venv is removed after.
.PHONY: wheel-smoke
wheel-smoke: $(STAMP)
	PYTHON=$(PYTHON) .ci/wheel-smoke $(PY) $(REQUIREMENTS)

clean:
	rm -rf $(VENV)
