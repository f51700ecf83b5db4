# Two set-up commands: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU wheel is pinned: an unpinned `torch` pulls several GB of CUDA packages. GPU users install
# their CUDA build of torch into .venv first; an importable torch is kept as it is.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

demo: $(STAMP)
	$(BIN)/gptforge demo --force  # replaces the previous demo run, once the new one is complete

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs data .pytest_cache
