# Two set-up commands: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU wheel is pinned: an unpinned `torch` pulls several GB of CUDA packages. GPU users install
# their CUDA build of torch into .venv first; an importable torch is kept as it is.
TORCH  ?= torch==2.13.0
# `make demo` installs the core package only; `make test` adds the dev extra (test tools and every optional library).
CORE   := $(VENV)/.core
DEV    := $(VENV)/.dev

.PHONY: demo test lint clean

$(CORE): pyproject.toml
	@test -x $(BIN)/python || { echo "== creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@$(BIN)/python -c "import torch" 2>/dev/null || { \
		echo "== installing $(TORCH) (the CPU wheel, about 200 MB; GPU users install their CUDA torch into $(VENV) first)"; \
		$(BIN)/pip install --progress-bar on "$(TORCH)"; }
	@echo "== installing gptforge and its core dependencies (numpy, tokenizers, tiktoken, matplotlib, ...)"
	$(BIN)/pip install --progress-bar on -e .
	@touch $@

$(DEV): $(CORE)
	@echo "== installing the dev extra: pytest, ruff, transformers, datasets, lm_eval, serve, playwright, ... (~2 GB)"
	@echo "   llama-cpp-python has no wheel on PyPI: pip builds llama.cpp with the system compiler the first time"
	@echo "   (8.5 min on a busy 2-core machine), then reuses the wheel it cached"
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(BIN)/pip install --progress-bar on -e ".[dev]"
	@touch $@

demo: $(CORE)
	$(BIN)/gptforge demo --force  # replaces the previous demo run, once the new one is complete

test: $(DEV)
	$(BIN)/python -m pytest -q --durations=20  # the slowest tests named in every run: the suite aims at ~15 min

lint: $(DEV)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs data .pytest_cache
