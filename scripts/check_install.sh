#!/usr/bin/env bash
# Install pace-strategy from a wheel built from this repository into a fresh environment that already
# has torch and an older Lightning (another minor version than the test suite's), then check that pip
# changed neither and that the demo and `pace diagnose` run. Several minutes; not part of `make test`.
#
#   scripts/check_install.sh [LIGHTNING_VERSION]     # default 2.5.6
#
# Prints one PASS or FAIL line per check; exits non-zero on the first FAIL.
set -euo pipefail
cd "$(dirname "$0")/.."
LIGHTNING="${1:-2.5.6}"
WORK="$(mktemp -d /tmp/pace-install-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
PYTHON="${PYTHON:-python3}"

fail() { echo "FAIL $*"; exit 1; }

echo "building the wheel ..."
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation . -w "$WORK/dist" 2>/dev/null \
    || "$PYTHON" -m pip wheel --quiet --no-deps . -w "$WORK/dist"
wheel="$(ls "$WORK"/dist/pace_strategy-*.whl)"
unzip -l "$wheel" | grep -q "licenses/LICENSE\|/LICENSE" || fail "the wheel has no LICENSE"
echo "PASS the wheel carries LICENSE ($(basename "$wheel"))"

echo "a fresh environment with torch 2.13.0 and lightning $LIGHTNING ..."
"$PYTHON" -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install --quiet "torch==2.13.0" "lightning==$LIGHTNING" 2> >(grep -v "is ignored" >&2)
before="$("$PY" -m pip freeze | grep -iE '^(torch|lightning|numpy)==' | sort)"

echo "installing $(basename "$wheel")[lightning,tensorboard] ..."
"$PY" -m pip install --quiet "$wheel[lightning,tensorboard]" 2> >(grep -v "is ignored" >&2)
after="$("$PY" -m pip freeze | grep -iE '^(torch|lightning|numpy)==' | sort)"
[ "$before" = "$after" ] || fail "pip changed the environment's packages: before [$before] after [$after]"
echo "PASS nothing downgraded or upgraded: $(echo "$after" | tr '\n' ' ')"

cd "$WORK"
OMP_NUM_THREADS=1 "$WORK/venv/bin/pace" demo --devices 2 --steps 30 --quiet --root "$WORK/runs" \
    > demo.log 2>&1 || { tail -20 demo.log; fail "pace demo"; }
echo "PASS pace demo (2 ranks, 30 steps) under lightning $LIGHTNING"
run="$(dirname "$(find "$WORK/runs" -name pace_run.jsonl | head -1)")"
"$WORK/venv/bin/pace" diagnose "$run" > diagnose.log 2>&1 || { tail -20 diagnose.log; fail "pace diagnose"; }
grep -q "persistent_straggler" diagnose.log || { cat diagnose.log; fail "pace diagnose named no straggler"; }
grep -q "pip install 'pace-strategy\[plots\]'" "$run/pace_report/report.md" \
    || fail "the report without matplotlib does not say how to get the plots"
echo "PASS pace diagnose names the demo's straggler; its report says the plots need [plots]"
