# The README's two commands: `make train` and `make test`. Both set up a local virtual
# environment on a fresh machine first: torch==2.13.0 (CPU build) before the package.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tessera-installed

.PHONY: setup system-packages train test test-gpu gpu-check check-torch-floor test-hf-latest lint clean

setup: $(STAMP) system-packages

# OpenMPI, Slurm and munge, with which tests/e2e/test_mpi_slurm.py starts jobs: installed with apt
# when setup or test runs as root (quietly, only what is missing, never touching Python; see
# .ci/system-packages); as another user it names the command to run as root.
SYSTEM_PACKAGES := openmpi-bin slurmctld slurmd slurm-client munge
system-packages:
	@.ci/system-packages $(SYSTEM_PACKAGES)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else 'torch ' + v + ' replaced 2.13.0')"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/tessera train

LINT = $(BIN)/ruff check tessera tests examples && $(BIN)/ruff format --check tessera tests examples && $(BIN)/mypy
lint: $(STAMP)
	$(LINT)

# The system packages and the virtual environment install side by side; then the lint (mypy takes
# a core for about a minute) runs beside pytest, whose single-process unit tests come first. The
# lint's report is printed after pytest's; either failing fails the target.
test:
	@$(MAKE) --no-print-directory -j2 system-packages $(STAMP)
	@($(LINT)) >$(VENV)/lint.log 2>&1 & lint=$$!; \
	$(BIN)/python -m pytest -q tests/unit tests/dist tests/e2e; tested=$$?; \
	wait $$lint; linted=$$?; cat $(VENV)/lint.log; \
	if [ $$linted -ne 0 ]; then echo "make test: the lint failed (above)"; fi; \
	exit $$(( tested || linted ))

# The CUDA lane (tests/cuda, marker `cuda`), which `make test` does not collect. It runs on a GPU
# machine's own python with a CUDA torch (GPU_PYTHON, default python3) over this source tree through
# PYTHONPATH=., installing nothing and needing no .venv (a bare GPU machine may have no internet).
# Without a GPU, pytest stops at once naming the reason (tests/conftest.py). Dry run of the lane's
# test code on CPU with any python that has torch and pytest:
# make test-gpu GPU_PYTHON=.venv/bin/python GPU_DEVICE=cpu
GPU_PYTHON ?= python3
GPU_DEVICE ?= cuda:0
GPU_LANE = PYTHONPATH=. TESSERA_TEST_DEVICE=$(GPU_DEVICE) $(GPU_PYTHON) -m pytest -q -p no:cacheprovider --cuda-lane -m cuda
test-gpu:
	$(GPU_LANE) tests/cuda

# The lane as test-gpu runs it, then a short probe of eager and compiled GPT steps in bf16
# (tokens/s, MFU); the reports go to $(GPU_REPORT)/. Dry run on CPU: make gpu-check
# GPU_PYTHON=.venv/bin/python GPU_DEVICE=cpu GPU_PROBE_ARGS="--presets tiny --batch 2 --steps 2 --warmup 1"
GPU_REPORT ?= gpu-check
GPU_PROBE_ARGS ?=
gpu-check:
	mkdir -p $(GPU_REPORT)
	$(GPU_LANE) --junitxml=$(GPU_REPORT)/lane.xml tests/cuda
	PYTHONPATH=. $(GPU_PYTHON) benchmarks/gpu_probe.py --device $(GPU_DEVICE) --out $(GPU_REPORT)/probe.json $(GPU_PROBE_ARGS)

# The oldest torch that pyproject.toml allows (TORCH_FLOOR, read from its "torch>=" line), in an
# environment of its own installed from the package registries: tessera imports, the CUDA lane's
# test code runs on CPU (test-gpu with GPU_DEVICE=cpu), tessera.comm's collectives run on 2, 4 and
# 8 gloo ranks (tests/dist/test_comm.py) and `tessera check` works. Not part of `make test`:
# PyPI's torch for x86_64 Linux is a CUDA build that does not import without its nvidia-*
# packages (about 5 GB in all). transformers 5 needs torch 2.6 (it does not see an older one), so
# the lane's LoRA tests run here with transformers 4.
TORCH_FLOOR ?= $(shell sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
FLOOR_VENV ?= .venv-torch-floor
FLOOR_TRANSFORMERS ?= transformers<5
check-torch-floor:
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet torch==$(TORCH_FLOOR) -e . pytest peft '$(FLOOR_TRANSFORMERS)'
	$(FLOOR_VENV)/bin/python -c "import sys, torch; v = torch.__version__; sys.exit(0 if v.startswith('$(TORCH_FLOOR)') else 'torch ' + v + ' replaced $(TORCH_FLOOR)')"
	$(FLOOR_VENV)/bin/python -c "import tessera"
	$(MAKE) test-gpu GPU_PYTHON=$(FLOOR_VENV)/bin/python GPU_DEVICE=cpu
	$(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/dist/test_comm.py
	$(FLOOR_VENV)/bin/tessera check

# The tessera.hf policies against the newest transformers release, in an environment of its own
# (not part of `make test`, which runs the pinned one): a release that breaks a policy fails here.
HF_VENV ?= .venv-hf-latest
test-hf-latest:
	$(PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(HF_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(HF_VENV)/bin/python -m pip install --quiet -e '.[test]'
	$(HF_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy only-if-needed transformers
	$(HF_VENV)/bin/python -c "import torch, transformers, sys; print('transformers', transformers.__version__); sys.exit(0 if torch.__version__.startswith('2.13.0') else 'torch ' + torch.__version__ + ' replaced 2.13.0')"
	$(HF_VENV)/bin/python -m pytest -q tests/dist/test_hf_tensor.py tests/dist/test_hf_grid.py tests/dist/test_hf_encoders.py tests/dist/test_hf_encoders_grid.py tests/dist/test_hf_pipeline.py tests/dist/test_hf_sequence.py

clean:
	rm -rf $(VENV) $(HF_VENV) $(FLOOR_VENV) runs .pytest_cache .mypy_cache .ruff_cache
