# Two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test bench env clean

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an open range would otherwise pull a newer CUDA build.
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

env: $(VENV)/.ready

demo: env
	$(PY) examples/demo.py

test: env
	$(PY) -m pytest -q

bench: env
	$(PY) bench/bench_core.py

clean:
	rm -rf $(VENV) demo-run bench/out
