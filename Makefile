# batchgen developer targets. `make demo` and `make test` each set up what they need.
PYTHON ?= python3
VENV ?= .venv
# A CPU-only machine must not pull a multi-GB CUDA build: pin the torch wheel set-up installs.
# On a GPU machine pick the build you want, e.g. `make setup TORCH='torch==2.11.0'`.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.batchgen-setup
JOB ?= jobs/demo.toml
SHAPE ?= 1b
WORKLOAD ?= W1

.PHONY: setup test demo example openai-batch bench lint format run clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/batchgen model build-default
	touch $(STAMP)

# The suite runs in TEST_WORKERS processes (pytest-xdist), each taking whole test files, so the
# many tests that wait on subprocesses overlap: on 2 cores ~390 s against ~650 s in one process.
# TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

demo: setup
	rm -rf out/demo
	$(BIN)/batchgen run jobs/demo.toml
	@echo "first results (out/demo/results.jsonl):" && head -n 3 out/demo/results.jsonl

example: setup
	$(BIN)/python examples/datasets_pipeline.py

openai-batch: setup
	rm -rf out/openai-batch
	$(BIN)/batchgen run jobs/openai_batch.toml
	@echo "first results (out/openai-batch/results.jsonl):" && head -c 600 out/openai-batch/results.jsonl
	@echo && echo "errors (out/openai-batch/errors.jsonl):" && cat out/openai-batch/errors.jsonl

run: setup
	$(BIN)/batchgen run $(JOB)

bench: setup
	$(BIN)/batchgen bench --shape $(SHAPE) --workload $(WORKLOAD)

lint: setup
	$(BIN)/ruff format --check batchgen tests benchmarks examples
	$(BIN)/ruff check batchgen tests benchmarks examples

format: setup
	$(BIN)/ruff format batchgen tests benchmarks examples
	$(BIN)/ruff check --fix batchgen tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache out
