# The two commands of the README's quick start, and the checks behind them.
.PHONY: setup demo test lint unit bench clean

setup:
	@bash scripts/setup.sh

# A real 4-process CPU Lightning run with an injected straggler, TensorBoard logs and a summary.
demo: setup
	OMP_NUM_THREADS=1 .venv/bin/pace demo

# Lint, type-check and the whole test suite.
test: setup lint
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

unit: setup
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit tests/distributed

# The monitoring-overhead benchmark (not a test; several minutes).
bench: setup
	OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py

clean:
	rm -rf runs lightning_logs .pytest_cache .mypy_cache .ruff_cache
