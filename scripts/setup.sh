#!/usr/bin/env bash
# Create .venv and install pace_strategy with its test tools. Idempotent; fast when nothing changed.
# torch==2.13.0 is installed first when torch is absent: that is the CPU wheel on this machine's disk,
# and it satisfies the package's torch range, so no multi-GB CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.pace-installed"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0 (CPU wheel)"
    "$PY" -m pip install --quiet --no-compile "torch==2.13.0"
fi
echo "setup: installing pace_strategy and its dependencies into $VENV"
# uv resolves and installs the dependencies in parallel (6 s here against pip's 83 s); pinned to the
# torch already installed, so it never fetches another build. pip installs them where uv cannot.
torch_version="$("$PY" -c 'from importlib.metadata import version; print(version("torch").split("+")[0])')"
pin="$(mktemp)"
trap 'rm -f "$pin"' EXIT
echo "torch==$torch_version" > "$pin"
if ! { "$PY" -m pip install --quiet --no-compile uv 2>/dev/null \
        && "$VENV/bin/uv" pip install --quiet --python "$PY" --constraint "$pin" -e ".[dev,all]"; }; then
    echo "setup: uv could not install them; installing with pip"
    "$PY" -m pip install --quiet --no-compile -e ".[dev,all]" 2> >(grep -v "is ignored: it is neither" >&2)
fi
# Nothing is compiled here: `make test` and `make demo` let Python cache the bytecode of what they
# import (PYTHONDONTWRITEBYTECODE cleared), a fraction of the 13,000 files installed (compiling them
# all took 39 s of the set-up's 74).
echo "$want" > "$stamp"
