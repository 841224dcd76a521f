# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
# every other package at an exact version (the header of constraints.txt says why)
CONSTRAINTS := constraints.txt
PIN = $(shell grep -E '^$(1)==' $(CONSTRAINTS))
STAMP := $(VENV)/.installed

.PHONY: test test-fast test-latest demo lint bench-deps clean browser cross-compiler

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Install the CPU torch wheel first (a plain `torch` requirement would pull a CUDA build),
# its dependencies at their pinned versions; pyproject.toml keeps the honest `torch>=2.6`
# for users elsewhere. The package is built with the pinned setuptools (no build isolation:
# an isolated build would take the newest setuptools).
$(STAMP): $(BIN)/python pyproject.toml $(CONSTRAINTS)
	$(BIN)/python -m pip install -q $(call PIN,pip)
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  $(BIN)/python -m pip install -q -c $(CONSTRAINTS) $(TORCH_PIN)
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) setuptools wheel
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) --no-build-isolation -e ".[dev]"
	touch $(STAMP)

# benchmark-only comparisons (ctranslate2), pinned like the rest
bench-deps: $(STAMP)
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) --no-build-isolation -e ".[dev,bench]"

# tests/viz/test_viz_browser.py opens the attention page in Debian's chromium (playwright's
# own browser downloads are not used). Installed here when missing and we are root with
# apt-get (CI); otherwise a note, and that test skips locally (it fails under CI=true).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; \
	else \
	  echo "note: chromium is missing (sudo apt-get install chromium); the browser test" \
	       "will skip (fail under CI=true)" >&2; \
	fi

# tests/generation/test_kernel_levels.py compiles every C kernel for aarch64 with Debian's
# cross compiler. Installed like the browser (root with apt-get: CI); otherwise a note, and
# those tests skip locally (they fail under CI=true).
cross-compiler:
	@command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    gcc-aarch64-linux-gnu libc6-dev-arm64-cross || \
	  { DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	      gcc-aarch64-linux-gnu libc6-dev-arm64-cross; }; \
	else \
	  echo "note: aarch64-linux-gnu-gcc is missing (sudo apt-get install" \
	       "gcc-aarch64-linux-gnu); the aarch64 kernel builds will skip" >&2; \
	fi

# --no-loadscope-reorder: files start in the order tests/conftest.py's LONG_FIRST gives
# (longest first), not sorted by their number of tests
test: $(STAMP) browser cross-compiler
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# Not in CI: drift seen on purpose. A fresh venv with the newest releases of the test
# oracles (transformers, tokenizers, peft, sentencepiece and what they pull in; torch stays
# the pinned CPU wheel), running the tests that compare against them (marker `oracle`,
# tests/conftest.py); the header of the run names each oracle's version beside its pin.
LATEST := .venv-latest
ORACLES := transformers tokenizers peft sentencepiece protobuf huggingface_hub accelerate \
	safetensors
test-latest: browser
	rm -rf $(LATEST)
	$(PY) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q $(TORCH_PIN)
	$(LATEST)/bin/python -m pip install -q -e ".[dev]"
	$(LATEST)/bin/python -m pip install -q --upgrade $(ORACLES)
	$(LATEST)/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m oracle \
	  -p no:cacheprovider

test-fast: $(STAMP) browser cross-compiler
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

demo: $(STAMP)
	$(BIN)/qkv demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) $(LATEST) build *.egg-info src/*.egg-info
