# A fresh machine needs only: `make demo` (set up, run the README's quick start and the demo), `make test` (set up, run
# the fast tier) and `make test-all` (set up, run every test; CI's); `make clean` removes what they made. The tiers:
# docs/testing.md.
# The interpreter the environment is made with: the system's CPython where there is one (Debian's is built with PGO
# and LTO; a pyenv build without --enable-optimizations traces Thunder programs 12-20% slower, docs/testing.md),
# else python3 on the PATH; one that cannot make a venv (no ensurepip) is passed over. `make test PYTHON=...` picks another.
PYTHON ?= $(shell for p in /usr/bin/python3.12 /usr/bin/python3.11 /usr/bin/python3.10; do \
	$$p -c "import ensurepip, venv" 2>/dev/null && echo $$p && exit; done; echo python3)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-all clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) examples/quickstart.py
	$(PY) -m thunder_fp8shard.demo

# the fast tier: the in-process, simulated and notebook tests and one multi-rank exactness test a setup
FAST := unit or simulated or notebook or setup_exactness
PYTEST := $(PY) -m pytest -q -n 2 --dist loadscope tests --nbmake notebooks --durations=25

test: setup
	$(PYTEST) -m "$(FAST)"

test-all: setup
	$(PYTEST)

# the environment, the demo's plot (out/), the editable install's metadata, pytest's and Python's caches
clean:
	rm -rf $(VENV) out thunder_fp8shard.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
