"""How long `pace diagnose` takes on a large run record (not a test; prints what it measured).

Writes a synthetic record in the run-record schema (default 100,000 steps x 64 ranks, 8 nodes x 8
local ranks, local rank 5 slow by 3 ms on every node, 1 ms jitter), then times the diagnosis and the
report, and the peak memory (RSS) of the load and of the findings above what the process held
before them (Linux: the peak is reset through /proc/self/clear_refs). The synthetic data only
exercises size; the real-run tests check what the findings say.

    python benchmarks/diagnose_scale.py [--steps 100000] [--ranks 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.findings import diagnose
from pace_strategy.diagnose.report import render_report
from pace_strategy.telemetry.arrays import load_arrays
from pace_strategy.telemetry.run_record import SCHEMA, SCHEMA_VERSION


def write_record(path: Path, steps: int, ranks: int, per_node: int) -> None:
    rng = np.random.default_rng(0)
    topo = [
        {
            "rank": r,
            "host": f"gpu-{r // per_node:02d}",
            "node_rank": r // per_node,
            "local_rank": r % per_node,
        }
        for r in range(ranks)
    ]
    header = {
        "record": "header",
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "framework": "synthetic",
        "world_size": ranks,
        "config": {},
        "topology": topo,
    }
    slow = np.array([3.0 if t["local_rank"] == 5 else 0.0 for t in topo])
    with path.open("w") as f:
        f.write(json.dumps(header) + "\n")
        chunk = 5000
        for start in range(0, steps, chunk):
            n = min(chunk, steps - start)
            compute = np.round(40.0 + slow + rng.normal(0, 1.0, (n, ranks)), 3)
            arrival = compute.max(axis=1, keepdims=True)
            wait = np.round(arrival - compute + 5.0, 3)
            zeros = [0.0] * ranks
            lines = []
            for i in range(n):
                w, c = wait[i].tolist(), compute[i].tolist()
                lead = np.round(wait[i] - wait[i].min(), 3).tolist()
                lines.append(
                    json.dumps(
                        {
                            "record": "step",
                            "step": start + i,
                            "valid": True,
                            "warmup": False,
                            "skew_ms": max(w) - min(w),
                            "straggler_rank": int(np.argmin(wait[i])),
                            "compute_straggler_rank": int(np.argmax(compute[i])),
                            "step_ms": float(arrival[i, 0] + 6),
                            "step_cv": 0.0,
                            "wait_ms_min": min(w),
                            "wait_ms_max": max(w),
                            "delay_ms_max": 0.0,
                            "pacing_active": False,
                            "buckets": 4,
                            "ranks": {
                                "lead_ms": lead,
                                "compute_ms": c,
                                "wait_ms": w,
                                "delay_ms": zeros,
                                "step_ms": [float(arrival[i, 0] + 6)] * ranks,
                                "data_ms": zeros,
                                "gap_ms": zeros,
                            },
                        }
                    )
                )
            f.write("\n".join(lines) + "\n")
            print(f"  wrote {start + n:,}/{steps:,} steps", flush=True)


def _status_mb(key: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return float(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> float | None:
    """Reset the peak RSS to the current one (Linux); returns the current RSS, MB."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_mb("VmRSS")


def _peak_mb() -> float | None:
    return _status_mb("VmHWM")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--per-node", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pace-diag-") as tmp:
        path = Path(tmp) / "pace_run.jsonl"
        write_record(path, args.steps, args.ranks, args.per_node)
        size_mb = path.stat().st_size / 1e6
        before = _reset_peak()
        t0 = time.perf_counter()
        arrays = load_arrays(path)
        t1 = time.perf_counter()
        load_peak = _peak_mb()
        _reset_peak()
        result = diagnose(arrays)
        t2 = time.perf_counter()
        findings_peak = _peak_mb()
        render_report(arrays, result, Path(tmp) / "report", DiagnosisConfig())
        t3 = time.perf_counter()
    print(f"{args.steps:,} steps x {args.ranks} ranks, record {size_mb:.0f} MB")
    print(f"  load {t1 - t0:.1f} s, findings {t2 - t1:.1f} s, report {t3 - t2:.1f} s, total {t3 - t0:.1f} s")
    if before is not None and load_peak is not None and findings_peak is not None:
        arrays_mb = sum(v.nbytes for v in vars(arrays).values() if isinstance(v, np.ndarray)) / 1e6
        print(
            f"  peak RSS above the {before:.0f} MB held before: load +{load_peak - before:.0f} MB "
            f"(the arrays: {arrays_mb:.0f} MB), findings +{findings_peak - before:.0f} MB"
        )
    print(f"  top finding: {result.findings[0].mode} ranks {result.findings[0].ranks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
