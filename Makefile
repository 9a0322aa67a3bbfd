# kvc — build, test and demo entry points.
#
# torch: the CPU build wherever make runs. PyPI's torch for Linux x86-64 is the CUDA build (19 nvidia packages,
# gigabytes), so TORCH (the requirement, one word) is taken from TORCH_INDEX (pip options, several words: passed
# unquoted), PyTorch's CPU index by default; torch's own dependencies then come from pip's usual index.
#   make test                                                  the CPU build of $(TORCH)
#   make test TORCH_INDEX='--index-url https://download.pytorch.org/whl/cu128'    a CUDA build
#   make test TORCH_INDEX=                                     wherever pip looks by itself (PyPI: CUDA on Linux)
#   make test TORCH= VENV_FLAGS=--system-site-packages         a GPU host's own torch: none installed, the venv
#                                                              sees the host's (a CUDA image's)
PYTHON      ?= python3
VENV        ?= .venv
VENV_FLAGS  ?=
TORCH       ?= torch==2.13.0
TORCH_INDEX ?= --index-url https://download.pytorch.org/whl/cpu
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.installed

.PHONY: install lint test typer-next gpu-check gpu-wheels gpu-check-image demo bench clean engine-check engine-check-sglang engine-check-vllm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)

# torch alone from TORCH_INDEX (--no-deps: an index that cannot be reached costs its retries once, not once per
# dependency), then from pip's usual index what it needs (pip keeps the torch installed: it satisfies TORCH).
$(STAMP): $(BIN)/python pyproject.toml plugins/kvcache_redis/pyproject.toml Makefile
	$(BIN)/pip install --quiet --upgrade pip
	$(if $(strip $(TORCH)),$(BIN)/pip install --quiet --no-deps "$(TORCH)" $(TORCH_INDEX))
	$(if $(strip $(TORCH)),$(BIN)/pip install --quiet "$(TORCH)")
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet -e plugins/kvcache_redis
	touch $(STAMP)

install: $(STAMP)

# ruff (pyflakes, import order, bugbear) over the code, the tests and the benchmarks; mypy over kvcache, the CLI
# (cli/kvc) and the Redis plugin (plugins/kvcache_redis: pyproject.toml's [tool.mypy] files, kvcache/types/ strict).
# Both pinned in the test extras.
lint: $(STAMP)
	$(BIN)/ruff check kvcache cli plugins tests benchmarks
	$(BIN)/mypy

# The suite runs on every core (pytest-xdist; tests share no port, file or directory; tests/README.md): `make test`
# took 3 min 41 s on 2 cores, lint and typer-next included (17f33a1). `make test XDIST=` runs it in one process. Warnings are errors (pyproject.toml). Then the CLI's own
# tests again under the newest typer (typer-next).
XDIST ?= -n auto --dist worksteal
test: lint
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)
	$(MAKE) --no-print-directory typer-next

# On a GPU machine (never in CI): the suite with every cache's device tier on CUDA, then the L1 <-> L2 transfer
# benchmark against the bus (docs/gpu.md). With the machine's own CUDA torch: `make gpu-check TORCH=
# VENV_FLAGS=--system-site-packages`. Under 5 minutes on one GPU.
gpu-check: $(STAMP)
	KVC_TEST_DEVICE=cuda $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)
	cd benchmarks && ../$(BIN)/python bench_transfer.py

# The same on a GPU machine that reaches no package index (an image with CUDA torch, numpy, pytest, xdist,
# hypothesis, rich, xxhash, prometheus_client): `make gpu-wheels` here puts in $(WHEELS) what such an image lacks or
# holds in another version than CI runs, for its Python ($(GPU_PY)): msgspec, lmdb, pyzmq, redis-py, typer < 0.25
# (a later one imports pydantic and words its errors otherwise) and setuptools (kvc's build backend). Carry that
# folder there and run `make gpu-check-image`: it installs them and kvc (editable, as here) into the image's Python
# (GPU_PYTHON), then runs the suite and the benchmark on GPU_DEVICE (cpu rehearses it without a GPU). docs/gpu.md.
WHEELS     ?= .whl
GPU_PY     ?= 3.12
GPU_PYTHON ?= python3
GPU_DEVICE ?= cuda
GPU_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))
gpu-wheels: $(STAMP)
	rm -rf $(WHEELS) && mkdir -p $(WHEELS)
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
		$(GPU_PLATFORMS) -d $(WHEELS) "msgspec>=0.18" "lmdb>=1.4" "pyzmq>=25" "redis>=5" "typer>=0.12,<0.25" \
		"setuptools>=77"
gpu-check-image:
	$(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --no-compile --upgrade $(WHEELS)/*.whl
	$(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --no-build-isolation -e . -e plugins/kvcache_redis
	KVC_TEST_DEVICE=$(GPU_DEVICE) $(GPU_PYTHON) -m pytest $(XDIST) $(PYTEST_ARGS)
	cd benchmarks && $(GPU_PYTHON) bench_transfer.py --device $(GPU_DEVICE) $(if $(filter cuda,$(GPU_DEVICE)),,--no-write)

# kvc under the newest typer of the package index, beside the one kvc's venv holds (pyproject.toml keeps it below
# 0.25 for start-up time): SGLang's venvs and GPU images carry 0.27-0.29, a `pip install -U` brings the newest, and
# from 0.26 typer runs on its own copy of click. The newest is installed into a throwaway directory (TYPER_NEXT,
# with what it needs: a few seconds) put first on PYTHONPATH, and the CLI's tests of every command run there; the
# test module checks that the typer it runs under is that one (KVC_TYPER_NEXT). ~30 s.
TYPER_NEXT ?= $(VENV)/typer-next
TYPER_TESTS ?= tests/integration/test_cli_typer.py tests/integration/test_cli_every_input.py
typer-next: $(STAMP)
	rm -rf $(TYPER_NEXT)
	$(BIN)/pip install --quiet --no-warn-conflicts --target $(TYPER_NEXT) --upgrade typer
	PYTHONPATH=$(abspath $(TYPER_NEXT)) KVC_TYPER_NEXT=1 $(BIN)/python -m pytest $(XDIST) -p no:cacheprovider \
	  $(TYPER_TESTS) $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/kvc demo $(DEMO_ARGS)

bench: $(STAMP)
	cd benchmarks && for script in bench_*.py; do ../$(BIN)/python $$script || exit 1; done

# Opt-in, not part of `make test`: kvc under real engines (tests/engine), each in a venv of its own.
engine-check: engine-check-sglang engine-check-vllm

# kvc as the L3 of SGLang's own HiCache. SGLang 0.5.23 lives in a venv
# of its own (PEER_VENV; built here when it has no sglang, per the CPU recipe: sglang without its dependencies, the
# CPU torch, its runtime libraries, no torchvision: tests/engine/stubs stands in). kvc goes in with --no-deps, so the
# venv keeps SGLang's torch; then kvc's light dependencies (typer as SGLang's transformers has it: kvc runs under
# every typer from 0.12 on, `make typer-next` checks the newest). `PEER_VENV=/path/venv make engine-check` reuses a
# venv.
PEER_VENV   ?= .peer-venv
PEER_BIN    := $(PEER_VENV)/bin
SGLANG      ?= sglang==0.5.23
SGLANG_DEPS ?= numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic pyzmq tqdm \
               IPython aiohttp transformers dill "apache-tvm-ffi==0.1.11" sentencepiece compressed_tensors gguf openai \
               partial_json_parser
KVC_LIGHT_DEPS ?= "msgspec>=0.18" "lmdb>=1.4" "typer>=0.12" "rich>=13" "prometheus_client>=0.20" "xxhash>=3" \
                  "pyzmq>=25" "redis>=5" "pytest>=8"

$(PEER_BIN)/python:
	$(PYTHON) -m venv $(PEER_VENV)

engine-check-sglang: $(PEER_BIN)/python
	@$(PEER_BIN)/python -c "import sglang" 2>/dev/null || { \
	  $(PEER_BIN)/pip install --quiet --upgrade pip && \
	  $(PEER_BIN)/pip install --quiet --no-deps "$(SGLANG)" && \
	  $(PEER_BIN)/pip install --quiet --no-deps "$(TORCH)" $(TORCH_INDEX) && \
	  $(PEER_BIN)/pip install --quiet "$(TORCH)" && \
	  $(PEER_BIN)/pip install --quiet $(SGLANG_DEPS) && \
	  $(PEER_BIN)/pip install --quiet "$(TORCH)"; }
	$(PEER_BIN)/pip install --quiet $(KVC_LIGHT_DEPS)
	$(PEER_BIN)/pip install --quiet --no-deps -e . -e plugins/kvcache_redis
	PYTHONPATH=tests/engine/stubs $(PEER_BIN)/python -m pytest -p no:cacheprovider -v tests/engine tests/integration/test_engine_sglang.py \
	  $(PYTEST_ARGS)

# kvc as a secondary tier of vLLM's own KV offloading (vLLM's TieringOffloadingManager, scheduler side: vLLM's worker
# side needs a GPU). vLLM 0.34.0 lives in a venv of its own (VLLM_VENV; built here when it has no vLLM, per the CPU
# recipe in ../shared/peer-bench/vllm.md and the README: vLLM without its dependencies on the CPU torch, then its
# pure-Python requirements; ~3 GB). kvc goes in with --no-deps, then kvc's light dependencies.
# `VLLM_VENV=/path/venv make engine-check-vllm` reuses a venv.
VLLM_VENV ?= .vllm-venv
VLLM_BIN  := $(VLLM_VENV)/bin
VLLM      ?= vllm==0.34.0
VLLM_DEPS ?= numpy msgspec pyzmq cachetools psutil pydantic regex blake3 cloudpickle prometheus_client pyyaml \
             requests tqdm "transformers>=5.16.1,<5.23" huggingface_hub tokenizers sentencepiece safetensors openai \
             cbor2 pybase64 einops filelock protobuf py-cpuinfo aiohttp pillow orjson \
             prometheus-fastapi-instrumentator tiktoken partial-json-parser jsonschema watchfiles python-json-logger \
             ijson setproctitle opencv-python-headless lark==1.2.2 "mistral_common>=1.13.0" uvloop \
             "fastapi[standard]>=0.133,<0.137" "llguidance>=1.7,<1.8" xgrammar==0.2.8

$(VLLM_BIN)/python:
	$(PYTHON) -m venv $(VLLM_VENV)

engine-check-vllm: $(VLLM_BIN)/python
	@$(VLLM_BIN)/python -c "import vllm.v1.kv_offload.tiering.base" 2>/dev/null || { \
	  $(VLLM_BIN)/pip install --quiet --upgrade pip && \
	  $(VLLM_BIN)/pip install --quiet --no-deps "$(TORCH)" $(TORCH_INDEX) && \
	  $(VLLM_BIN)/pip install --quiet "$(TORCH)" && \
	  $(VLLM_BIN)/pip install --quiet --no-deps "$(VLLM)" && \
	  $(VLLM_BIN)/pip install --quiet $(VLLM_DEPS); }
	$(VLLM_BIN)/pip install --quiet $(KVC_LIGHT_DEPS)
	$(VLLM_BIN)/pip install --quiet --no-deps -e . -e plugins/kvcache_redis
	$(VLLM_BIN)/python -m pytest -p no:cacheprovider -v tests/engine/test_engine_check_vllm.py \
	  tests/engine/test_bench_engine_vllm.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
