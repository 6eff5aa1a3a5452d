# A fresh machine needs only: `make demo` (set up, run the README's quick start and the demo) and `make test` (set up, run the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) examples/quickstart.py
	$(PY) -m thunder_fp8shard.demo

test: setup
	$(PY) -m pytest -q -n 2 --dist loadscope tests --nbmake notebooks --durations=25
