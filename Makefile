# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# torch==2.13.0 is installed first, on its own: an unpinned torch would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH_PIN := torch==2.13.0
PYTEST_ARGS ?=
BENCH_ARGS ?=
WHEELS ?=
GPU_WHEELS := $(if $(WHEELS),--no-index --find-links $(WHEELS))

.PHONY: demo test test-slow stress lint format docs bench bench-store bench-dcp bench-gpu bench-export bench-scale bench-tiers fuzz browser azurite clean

# The editable install compiles the float codec's C extension in place: a changed source
# reinstalls (and so recompiles) it.
$(VENV)/.installed-core: pyproject.toml ckptstore/cas/_fpcodec.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[trainer,plot]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-core pyproject.toml
	$(PIP) install -q -e '.[dev]'
	touch $@

# Each demo run trains 100 steps, saves and stops, however long start-up (Ray, the warm-up) takes on a
# busy machine; the next run resumes from step 100 and finishes the 200. DEMO_ARGS= (empty) trains all
# 200 steps in one go.
DEMO_ARGS ?= checkpointing.stop_after_steps=100

## demo: set up and run the main job, the GRPO trainer, on the embedded default store
## (./.ckptstore/); running it again resumes where it stopped
demo: $(VENV)/.installed-core
	$(PY) -m trainer.grpo $(DEMO_ARGS)

## test: set up (with test servers) and run the default test suite
test: $(VENV)/.installed-dev browser azurite
	$(PY) -m pytest -m "not slow and not stress" $(PYTEST_ARGS)

# Azurite, the Azure Blob emulator that tests/azure_fixtures.py starts, pinned, from the npm
# registry into .cache/azurite (ignored; needs node 20 and npm). The stamp holds the version:
# a changed pin reinstalls, an installed one costs nothing.
AZURITE_VERSION := 3.37.0
AZURITE_STAMP := .cache/azurite/.installed
azurite:
	@test "$$(cat $(AZURITE_STAMP) 2>/dev/null)" = "$(AZURITE_VERSION)" || { \
	  command -v npm >/dev/null || { echo "install node 20 and npm: the Azure tests need Azurite from npm"; exit 1; }; \
	  npm install --prefix .cache/azurite --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION) && \
	  echo "$(AZURITE_VERSION)" > $(AZURITE_STAMP); }

# tests/web drive Debian's headless Chromium through Playwright (Playwright's own browser
# download needs the internet); installed from Debian's packages when missing (CI runs as root).
browser:
	@command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null || \
	  { command -v apt-get >/dev/null && apt-get update -qq && \
	    apt-get install -y -qq chromium-headless-shell >/dev/null; } || \
	  { echo "install chromium-headless-shell (Debian) for tests/web"; exit 1; }

## test-slow: only the slow cases
test-slow: $(VENV)/.installed-dev azurite
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

## stress: the whole reliability suite, its fast tier and the long -m stress tier (crash
## points, faults, GC against writers on PostgreSQL + SeaweedFS); prints a line per family
stress: $(VENV)/.installed-dev azurite
	$(PY) -m pytest tests/reliability $(PYTEST_ARGS)

## lint: ruff (lint + format check) and mypy on the library and the reference trainer
lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy ckptstore trainer

format: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

$(VENV)/.installed-docs: $(VENV)/.installed-core pyproject.toml
	$(PIP) install -q -e '.[docs]'
	touch $@

## docs: build the documentation site (mkdocs.yml, docs/) into site/, failing on any warning;
## every code block in it runs in make test (tests/docs/test_docs_blocks.py)
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

$(VENV)/.installed-bench: $(VENV)/.installed-dev pyproject.toml
	$(PIP) install -q -e '.[bench]'
	touch $@

## bench: issue 13's whole table, every goal as a ratio against peers measured in the same
## run (save, load, async memory, codec, S3, DCP over S3 against s3torchconnector, read-once, CLI,
## tiers; ~30 min; BENCH_ARGS=--quick: ~8 min)
bench: $(VENV)/.installed-bench
	$(PY) bench/suite.py $(BENCH_ARGS)

## bench-store: ckptstore against torch.save/torch.load and safetensors, with profiling extras
bench-store: $(VENV)/.installed-dev
	$(PY) bench/bench_store.py

## bench-gpu: async-save blocked time of 4 and 16 GiB of GPU state against dcp.async_save's pinned
## stager, and the device-to-host rate against the device's pinned-copy peak; loads into device
## tensors (Run.load atomic and atomic=False, hot and evicted) against dcp.load, the H2D pinned peak
## and the read+hash floor, and load time against size (prints one line and exits 0 without CUDA).
## Runs on the GPU machine's own Python and CUDA torch (PYTHON=/path/to/python
## if python3 is not the one with torch): installs nothing but the project into it (editable, no
## build isolation); a machine without internet takes the missing dependencies from WHEELS=dir
bench-gpu:
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "make bench-gpu: $(PYTHON) cannot import torch;" \
	  "bench-gpu uses the machine's own CUDA build of torch: install it, or pass PYTHON=/path/to/python"; exit 2; }
	@$(PYTHON) -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
	  || $(PYTHON) -m pip install -q --disable-pip-version-check $(GPU_WHEELS) 'setuptools>=77'
	$(PYTHON) -m pip install -q --disable-pip-version-check $(GPU_WHEELS) --no-build-isolation -e .
	$(PYTHON) bench/bench_gpu.py $(BENCH_ARGS)

## bench-export: peak RSS of ckptstore export (--hf, consolidated) against torch's
## dcp_to_torch_save on a 512 MiB model (~3 min)
bench-export: $(VENV)/.installed-dev
	$(PY) bench/bench_export.py $(BENCH_ARGS)

## bench-scale: cost curves (commit of R rank receipts, DCP metadata and Megatron layout parse,
## lookups at 100k checkpoints, GC at 10^4-10^6 blob rows) on SQLite and PostgreSQL;
## BENCH_ARGS=--full for the largest sizes
bench-scale: $(VENV)/.installed-dev
	$(PY) bench/bench_scale.py $(BENCH_ARGS)

## bench-tiers: node-local tiers -- recovery after a node loss against remote-only through a
## 200 MB/s throttle, local save blocked time and write rate, replication/drain/bandwidth
## curves, the trainer checkpointing every step (~9 min)
bench-tiers: $(VENV)/.installed-dev
	$(PY) bench/bench_tiers.py $(BENCH_ARGS)

## bench-dcp: 2-rank DCP save/load, ckptstore against DCP's FileSystemWriter/Reader (~1 min)
bench-dcp: $(VENV)/.installed-dev
	$(PY) bench/bench_dcp_multirank.py

## fuzz: the parsers of stored bytes (fuzz/README.md): the float decoder built with ASan +
## UBSan (1M inputs), then the header, object, index, DCP-metadata parsers and the reference
## decoder under memory and time limits; ~5 min; FUZZ_ARGS="--seed N" repeats a run
fuzz: $(VENV)/.installed-dev
	$(PY) -m fuzz $(FUZZ_ARGS)

clean:
	rm -rf $(VENV) .ckptstore .pytest_cache .mypy_cache .ruff_cache site
