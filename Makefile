# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test test-fast demo lint bench clean browser

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Install the CPU torch wheel first (a plain `torch` requirement would pull a CUDA build);
# pyproject.toml keeps the honest `torch>=2.6` for users elsewhere.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

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

# --no-loadscope-reorder: files start in the order tests/conftest.py's LONG_FIRST gives
# (longest first), not sorted by their number of tests
test: $(STAMP) browser
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

test-fast: $(STAMP) browser
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

demo: $(STAMP)
	$(BIN)/qkv demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
