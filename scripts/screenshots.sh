#!/usr/bin/env bash
# The documentation's screenshots (docs/images/): the TensorBoard dashboard of a 2-rank demo run and
# its `pace diagnose` report, rendered by headless Chromium (Debian's `chromium` package; not a test
# dependency). Usage: scripts/screenshots.sh [OUT_DIR]   (default docs/images)
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath "${1:-docs/images}")"
work="$(mktemp -d)"
trap 'kill "${tb:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
PY=.venv/bin/python
OMP_NUM_THREADS=1 "$PY" -m pace_strategy demo --devices 2 --steps 80 --straggler 1:30 --quiet --root "$work/runs"
run="$work/runs/demo/version_0"
"$PY" -m pace_strategy diagnose "$run" >/dev/null
port=$(( 20000 + RANDOM % 20000 ))
.venv/bin/tensorboard --logdir "$work/runs" --port "$port" --host 127.0.0.1 >"$work/tb.log" 2>&1 &
tb=$!
for _ in $(seq 60); do curl -sf "http://127.0.0.1:$port/" >/dev/null && break; sleep 0.5; done
shot() {  # URL FILE WIDTH,HEIGHT
    chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="$work/chrome-$2" --hide-scrollbars --window-size="$3" \
        --virtual-time-budget=20000 --screenshot="$out/$2" "$1" 2>/dev/null
}
shot "http://127.0.0.1:$port/?darkMode=false#custom_scalars" tensorboard_dashboard.png 1400,1100
shot "file://$run/pace_report/report.html" diagnose_report.png 1100,1500
echo "screenshots in $out"
