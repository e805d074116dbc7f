# The two commands of the README's quick start, and the checks behind them.
.PHONY: setup demo test test-long lint unit bench clean

setup:
	@bash scripts/setup.sh

# A real 4-process CPU Lightning run with an injected straggler, TensorBoard logs and a summary.
demo: setup
	OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= .venv/bin/pace demo

# Lint, type-check and the test suite: first every test that does not measure time, two at a time (a
# module's tests on one worker, so that its shared runs are made once); then the tests that measure
# time or diagnose a run by its timing (marked `alone`), one at a time with nothing beside them. The
# long runs (marked `long`) are left to `make test-long` (docs/testing.md says which and why).
# PYTHONDONTWRITEBYTECODE is cleared for them (set on the project's machines): every test process
# would otherwise compile what it imports again (Lightning: 16 s of CPU instead of 7); this way each
# module is compiled once, by the first process that imports it.
# FUZZ_SCALE: half of each fuzz test's examples here (all of them in `make unit`).
TEST_ENV = OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=
test: setup lint
	$(TEST_ENV) FUZZ_SCALE=0.5 .venv/bin/python -m pytest -q -n 2 --dist loadscope -m "not alone and not long"
	$(TEST_ENV) .venv/bin/python -m pytest -q -m "alone and not long"

# The long runs, in the same two phases (about 7 minutes more on 2 cores).
test-long: setup
	$(TEST_ENV) .venv/bin/python -m pytest -q -n 2 --dist loadscope -m "long and not alone"
	$(TEST_ENV) .venv/bin/python -m pytest -q -m "long and alone"

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

unit: setup
	$(TEST_ENV) .venv/bin/python -m pytest -q tests/unit tests/distributed

# The monitoring-overhead benchmark (not a test; several minutes).
bench: setup
	OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py

clean:
	rm -rf runs lightning_logs .pytest_cache .mypy_cache .ruff_cache
