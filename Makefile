# The README's commands. Everything runs inside .venv, created on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
# CPU wheel of torch that lies on our machines; pyproject.toml admits any torch >= 2.4 (e.g. a CUDA build).
TORCH_PIN ?= torch==2.13.0
DATA ?= data/sim_kitti
# Large fresh allocations pay page faults: keep freed memory in the heap (docs/speed.md, CPU settings).
export MALLOC_MMAP_MAX_ ?= 0
export MALLOC_TRIM_THRESHOLD_ ?= 4000000000
# torch's CPU allocator: 2 MB-aligned, huge-page-advised buffers for tensors >= 2 MB. Sparse steps allocate blocks of
# changing sizes that split the heap's free space, so a full-size map often lands on fresh pages, thousands of page
# faults in one forward; with this, none (docs/speed.md, CPU settings)
export THP_MEM_ALLOC_ENABLE ?= 1

.PHONY: setup sysdeps train test test-all data kernels kernels-cuda gpu-check bench bench-quick lint clean

$(VENV)/.stamp: pyproject.toml Makefile
	@command -v $(PY) >/dev/null || { echo "error: $(PY) not found (set PY=python3.x)"; exit 1; }
	@$(MAKE) --no-print-directory sysdeps
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q "$(TORCH_PIN)"
	$(PYTHON) -m pip install -q -e ".[dev,export]"
	touch $@

setup: $(VENV)/.stamp

# open3d needs libusb-1.0 at import time; fresh machines lack it.
sysdeps:
	@if ! ldconfig -p 2>/dev/null | grep -q libusb-1.0.so.0; then \
	  echo "installing libusb-1.0-0 (needed by open3d)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libusb-1.0-0 >/dev/null; \
	fi

$(DATA)/ImageSets/train.txt: | setup
	$(PYTHON) scripts/make_dataset.py out=$(DATA)

data: $(DATA)/ImageSets/train.txt

# The main job: the sample dataset (generated once), its summary, then training of the sparse detector
# on the CPU and the KITTI evaluation of its best checkpoint. Extra Hydra overrides: make train ARGS="..."
train: setup data kernels
	$(PYTHON) scripts/inspect_dataset.py root=$(DATA)
	$(PYTHON) scripts/train.py data.root=$(DATA) $(ARGS)

# Two workers, each taking whole files (module fixtures built once): most tests wait on a subprocess's start or a
# small op, so two run in about 2/3 of the time of one on two cores.
test: setup
	$(PYTHON) -m pytest -q -m "not slow" -n 2 --dist loadfile

test-all: setup
	$(PYTHON) -m pytest -q -n 2 --dist loadfile

kernels: setup
	$(PYTHON) -c "from detector.ops import _library; _library.load(verbose=True)"

# CUDA compile check of kernels/cuda/*.cu (no GPU needed; not part of CI): a CUDA build of torch in its
# own venv (~5.5 GB: check `df -h .` first) and nvcc from CUDA_HOME.
CUDA_VENV := .venv-cuda
CUDA_TORCH_PIN ?= torch==2.14.1
CUDA_HOME ?= /usr/local/cuda
TORCH_CUDA_ARCH_LIST ?= 9.0
kernels-cuda:
	@test -x $(CUDA_HOME)/bin/nvcc || { echo "error: nvcc not found in CUDA_HOME=$(CUDA_HOME)"; exit 1; }
	test -x $(CUDA_VENV)/bin/python || $(PY) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -c "import torch, ninja" 2>/dev/null || \
	  $(CUDA_VENV)/bin/python -m pip install -q "$(CUDA_TORCH_PIN)" numpy ninja
	CUDA_HOME=$(CUDA_HOME) TORCH_CUDA_ARCH_LIST="$(TORCH_CUDA_ARCH_LIST)" $(CUDA_VENV)/bin/python -c \
	  "from detector.ops import _library; print(_library.build(with_cuda=True, verbose=True))"

# The prepared GPU check (scripts/gpu_check.py: builds the kernels for this GPU, runs the gpu tests and the GPU
# benchmarks, <= 8 minutes) with the machine's own python3 and its CUDA torch, not .venv. ARGS: wheels=DIR
# out=DIR data=DIR budget=SECONDS --dry-run (without a GPU it only checks the preparation and prints the plan).
gpu-check:
	python3 scripts/gpu_check.py $(ARGS)

# Benchmarks: each prints a table and writes benchmarks/<name>_cpu.{json,md} (machine, load, allocator noted).
bench: setup data kernels
	$(PYTHON) scripts/bench_data.py
	$(PYTHON) scripts/bench_ops.py
	$(PYTHON) scripts/bench_sparse.py
	$(PYTHON) scripts/bench_voxelize.py root=$(DATA)
	$(PYTHON) scripts/bench_eval.py
	$(PYTHON) scripts/bench_model.py root=$(DATA)

# About a minute each, results under /tmp: a smoke test of the benchmarks.
bench-quick: setup data kernels
	$(PYTHON) scripts/bench_sparse.py quick=true out=/tmp/bench_quick/sparse.json
	$(PYTHON) scripts/bench_model.py quick=true root=$(DATA)
	$(PYTHON) scripts/bench_eval.py frames=300 repeats=1 files=false stress=false out=/tmp/bench_quick/eval

lint: setup
	$(BIN)/ruff check detector scripts tests

clean:
	rm -rf $(VENV) build .pytest_cache
