# kvc — build, test and demo entry points.
# TORCH pins the torch requirement so a CPU-only machine does not pull a multi-GB CUDA build;
# override it on a GPU host, e.g. `make test TORCH='torch==2.13.0 --index-url ...'`.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install lint test demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml plugins/kvcache_redis/pyproject.toml Makefile
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet -e plugins/kvcache_redis
	touch $(STAMP)

install: $(STAMP)

# ruff (pyflakes, import order, bugbear) and mypy over the code; both pinned in the test extras.
lint: $(STAMP)
	$(BIN)/ruff check kvcache cli plugins
	$(BIN)/mypy

# The suite runs on every core (pytest-xdist; tests share no port, file or directory): ~4.5 min on 2 cores, ~6.5
# serially. `make test XDIST=` runs it in one process. Warnings are errors (pyproject.toml).
XDIST ?= -n auto --dist worksteal
test: lint
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/kvc demo $(DEMO_ARGS)

bench: $(STAMP)
	cd benchmarks && for script in bench_*.py; do ../$(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
