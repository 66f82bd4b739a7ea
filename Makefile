# Two commands a newcomer needs:  make demo  and  make test.
# Both create .venv and install everything into it; torch is pinned to 2.13.0 at every step.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[test,lightning,hf,megatron,plot]" "torch==2.13.0"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/nemo-dcr demo --workdir runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/codec.py

clean:
	rm -rf $(VENV) runs
