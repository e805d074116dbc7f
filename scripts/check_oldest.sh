#!/usr/bin/env bash
# The adapters' integration tests against the oldest Lightning, Accelerate and transformers that
# pyproject.toml declares, in a second environment with the same CPU torch as the test suite's.
# Several minutes; not part of `make test` (docs/testing.md says when it last ran and what it found).
#
#   scripts/check_oldest.sh [PYTEST_ARGS ...]
#
# The environment is kept in .venv-oldest (rebuilt when this script's pins change).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-oldest
# the lower bounds of pyproject.toml's extras
PINS=("lightning==2.4.0" "accelerate==1.0.1" "transformers==4.40.2")
stamp="$VENV/.pins"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${PINS[*]}" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --no-compile "torch==2.13.0" uv 2> >(grep -v "is ignored" >&2)
    pin="$(mktemp)"
    trap 'rm -f "$pin"' EXIT
    echo "torch==2.13.0" > "$pin"
    "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --constraint "$pin" \
        -e ".[dev,all]" "${PINS[@]}"
    echo "${PINS[*]}" > "$stamp"
fi
"$VENV/bin/python" -m pip freeze | grep -iE '^(torch|lightning|accelerate|transformers)=='
# every adapter's integration tests that make test runs (the long tier's are left out here too)
OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    -m "not long" "$@" \
    tests/integration/test_lightning.py tests/integration/test_fabric.py \
    tests/integration/test_accelerate.py tests/integration/test_zero_code.py \
    tests/integration/test_pytorch.py tests/integration/test_fsdp.py tests/integration/test_rebalance.py
