"""How long `pace diagnose` takes on a large run record (not a test; prints what it measured).

Writes a synthetic record in the run-record schema (default 100,000 steps x 64 ranks, 8 nodes x 8
local ranks, local rank 5 slow by 3 ms on every node, 1 ms jitter), then times the diagnosis and the
report, and the peak memory (RSS) of the load, the findings and the report, each above what the
process held before the load (Linux: the peak is reset through /proc/self/clear_refs). ``streamed``
is how ``pace diagnose`` reads a record: its lines (``load_lines``), then its per-rank numbers a
block of steps at a time (the digest, read once for the findings and the report); ``loaded`` loads
them whole first (``load_arrays(skip=DIAGNOSIS_SKIP)``, how it read them before), the baseline. The
synthetic data
only exercises size (its step lines carry wait, compute, delay, data, gap and step time per rank:
no optimizer, GC or sample columns, which a real record adds); the real-run tests check what the
findings say.

The same record is diagnosed as JSON lines and, converted with ``pace convert``, with its per-rank
columns in Arrow (``record_format: arrow``), side by side with their ratios.

    python benchmarks/diagnose_scale.py [--steps 100000] [--ranks 64] [--formats jsonl,arrow]
        [--writer-columns] [--modes streamed,loaded] [--keep DIR | --record DIR]

``--keep DIR`` keeps the written record(s) in DIR; ``--record DIR`` diagnoses the ones kept there
(no writing: a 100k x 8,192 record takes minutes to write and 9.6 GB of disk).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.findings import diagnose_run
from pace_strategy.diagnose.report import render_report
from pace_strategy.telemetry.arrays import DIAGNOSIS_SKIP, load_arrays, load_lines
from pace_strategy.telemetry.columnar import (
    COLUMNS_SCHEMA,
    COLUMNS_VERSION,
    SHARD_BATCH_ROWS,
    RankColumnsWriter,
    rank_columns_filename,
)
from pace_strategy.telemetry.convert import convert_record
from pace_strategy.telemetry.run_record import SCHEMA, SCHEMA_VERSION


def topology(ranks: int, per_node: int) -> list[dict[str, object]]:
    """``per_node`` ranks on each host."""
    return [
        {
            "rank": r,
            "host": f"gpu-{r // per_node:02d}",
            "node_rank": r // per_node,
            "local_rank": r % per_node,
        }
        for r in range(ranks)
    ]


def windows(steps: int, ranks: int, per_node: int, size: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """The synthetic run, ``size`` steps at a time: (first step, compute ``[n, ranks]``, wait)."""
    rng = np.random.default_rng(0)
    slow = np.array([3.0 if r % per_node == 5 else 0.0 for r in range(ranks)])
    for start in range(0, steps, size):
        n = min(size, steps - start)
        compute = np.round(40.0 + slow + rng.normal(0, 1.0, (n, ranks)), 3)
        wait = np.round(compute.max(axis=1, keepdims=True) - compute + 5.0, 3)
        yield start, compute, wait


def step_line(step: int, compute: np.ndarray, wait: np.ndarray) -> dict[str, object]:
    """One step's line of the global stream (its per-rank lists apart)."""
    return {
        "record": "step",
        "step": step,
        "valid": True,
        "warmup": False,
        "skew_ms": float(wait.max() - wait.min()),
        "straggler_rank": int(np.argmin(wait)),
        "compute_straggler_rank": int(np.argmax(compute)),
        "step_ms": float(compute.max() + 6),
        "step_cv": 0.0,
        "wait_ms_min": float(wait.min()),
        "wait_ms_max": float(wait.max()),
        "delay_ms_max": 0.0,
        "pacing_active": False,
        "buckets": 4,
    }


def header(ranks: int, per_node: int, **extra: object) -> str:
    return json.dumps(
        {
            "record": "header",
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "framework": "synthetic",
            "world_size": ranks,
            "config": {},
            "topology": topology(ranks, per_node),
            **extra,
        }
    )


def write_record(path: Path, steps: int, ranks: int, per_node: int) -> None:
    """The synthetic run as JSON lines, per-rank lists in every step line."""
    zeros = [0.0] * ranks
    with path.open("w") as f:
        f.write(header(ranks, per_node) + "\n")
        for start, compute, wait in windows(steps, ranks, per_node, 5000):
            lines = []
            for i in range(len(compute)):
                line = step_line(start + i, compute[i], wait[i])
                line["ranks"] = {
                    "lead_ms": np.round(wait[i] - wait[i].min(), 3).tolist(),
                    "compute_ms": compute[i].tolist(),
                    "wait_ms": wait[i].tolist(),
                    "delay_ms": zeros,
                    "step_ms": [line["step_ms"]] * ranks,
                    "data_ms": zeros,
                    "gap_ms": zeros,
                }
                lines.append(json.dumps(line))
            f.write("\n".join(lines) + "\n")
            print(f"  wrote {start + len(compute):,}/{steps:,} steps", flush=True)


def write_arrow_record(
    path: Path, steps: int, ranks: int, per_node: int, writer_columns: bool = False, shards: bool = False
) -> None:
    """The same synthetic run written straight in the columnar form (no JSON per rank), for sizes
    whose JSON lines would take many GB: the step lines of the global stream and one batch of
    per-rank columns per 32 steps. ``writer_columns``: also the per-rank columns today's writer
    records (optimizer time ~2 ms, a 3 ms GC pause in 1% of rank-steps, a collection in 5%, 32
    samples), which the diagnosis loads too. ``shards``: one file per node, as the node leaders
    write them (``exchange_topology: node_leaders``), instead of one file of every rank."""
    rng = np.random.default_rng(1)
    nodes = (
        [range(n, min(n + per_node, ranks)) for n in range(0, ranks, per_node)] if shards else [range(ranks)]
    )
    # a node shard holds windows into batches as a node leader's does (SHARD_BATCH_ROWS)
    writers = [
        RankColumnsWriter(
            path.with_name(rank_columns_filename(path.name, i if shards else None)),
            len(node),
            ranks=node,
            min_batch_rows=SHARD_BATCH_ROWS if shards else 0,
        )
        for i, node in enumerate(nodes)
    ]
    schema = {"schema": COLUMNS_SCHEMA, "version": COLUMNS_VERSION}
    described: dict[str, object] = (
        {
            "shards": [{"file": w.path.name, "ranks": list(n)} for w, n in zip(writers, nodes, strict=True)],
            **schema,
        }
        if shards
        else {"file": writers[0].path.name, **schema}
    )
    with path.open("w") as f:
        f.write(header(ranks, per_node, rank_columns=described) + "\n")
        for start, compute, wait in windows(steps, ranks, per_node, 32):
            zeros = np.zeros_like(compute)
            step_ms = np.repeat(compute.max(axis=1, keepdims=True) + 6, ranks, axis=1)
            rows = {"lead_ms": wait - wait.min(axis=1, keepdims=True), "compute_ms": compute, "wait_ms": wait,
                    "delay_ms": zeros, "step_ms": step_ms, "data_ms": zeros, "gap_ms": zeros}  # fmt: skip
            if writer_columns:
                shape = compute.shape
                rows["opt_ms"] = np.round(2.0 + rng.random(shape) * 0.1, 3)
                rows["gc_ms"] = np.round((rng.random(shape) < 0.01) * 3.0, 3)
                rows["gc_collections"] = (rng.random(shape) < 0.05).astype(np.int32)
                rows["samples"] = np.full(shape, 32, dtype=np.int32)
            labels = list(range(start, start + len(compute)))
            for writer, node in zip(writers, nodes, strict=True):
                writer.write_rows(labels, {k: v[:, node.start : node.stop] for k, v in rows.items()})
            lines = [json.dumps(step_line(start + i, compute[i], wait[i])) for i in range(len(compute))]
            f.write("\n".join(lines) + "\n")
            if (start // 32) % 500 == 0:
                print(f"  wrote {start + len(compute):,}/{steps:,} steps", flush=True)
    for writer in writers:
        writer.close()


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


def measure(path: Path, out: Path, mode: str) -> dict[str, float | str | None]:
    """Load, findings and report of the record at ``path`` (``mode``: streamed or loaded): times (s)
    and peak RSS above what the process held before (MB)."""
    before = _reset_peak()
    t0 = time.perf_counter()
    # as pace diagnose reads it (streamed), or whole (loaded)
    run = load_lines(path) if mode == "streamed" else load_arrays(path, skip=DIAGNOSIS_SKIP)
    t1 = time.perf_counter()
    load_peak = _peak_mb()
    _reset_peak()
    result, digest = diagnose_run(run)
    t2 = time.perf_counter()
    findings_peak = _peak_mb()
    _reset_peak()
    render_report(run, result, out, DiagnosisConfig(), digest)
    t3 = time.perf_counter()
    report_peak = _peak_mb()
    held_mb = sum(v.nbytes for v in vars(run).values() if isinstance(v, np.ndarray)) / 2**20  # MiB, as RSS
    known = before is not None and None not in (load_peak, findings_peak, report_peak)
    return {
        "load_s": t1 - t0,
        "findings_s": t2 - t1,
        "report_s": t3 - t2,
        "total_s": t3 - t0,
        "load_peak_mb": load_peak - before if known else None,  # type: ignore[operator]
        "findings_peak_mb": findings_peak - before if known else None,  # type: ignore[operator]
        "report_peak_mb": report_peak - before if known else None,  # type: ignore[operator]
        "arrays_mb": held_mb,
        "top": f"{result.findings[0].mode} ranks {result.findings[0].ranks[:8]}",
        "shape": f"{run.steps:,} steps x {run.world_size} ranks",
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument(
        "--formats",
        default="jsonl,arrow",
        help="record formats to diagnose, from the same record (arrow: converted with pace convert; "
        "arrow alone: the record is written in that form directly, for sizes whose JSON would not fit)",
    )
    p.add_argument(
        "--writer-columns",
        action="store_true",
        help="with --formats arrow: also the per-rank optimizer, GC and sample columns a real record has",
    )
    p.add_argument(
        "--shards",
        action="store_true",
        help="with --formats arrow: one file per node (--per-node ranks), as node leaders write them",
    )
    p.add_argument(
        "--modes",
        default="streamed,loaded",
        help="streamed: as pace diagnose reads a record (a block of steps at a time); loaded: the "
        "per-rank numbers loaded whole first (the baseline; at 8,192 ranks they do not fit 24 GB)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--keep", default=None, help="write the record(s) into this directory and keep them")
    where.add_argument("--record", default=None, help="diagnose the record(s) kept in this directory")
    args = p.parse_args()
    formats, modes = args.formats.split(","), [m for m in args.modes.split(",") if m]  # "": write only
    rows = {}
    with tempfile.TemporaryDirectory(prefix="pace-diag-") as tmp:
        root = Path(args.record or args.keep or tmp)
        path = root / "jsonl" / "pace_run.jsonl"
        arrow = root / "arrow" / "pace_run.jsonl"
        sizes = {}
        if args.record is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if formats == ["arrow"]:  # no JSON per rank at all: written in the columnar form directly
                arrow.parent.mkdir(exist_ok=True)
                write_arrow_record(
                    arrow, args.steps, args.ranks, args.per_node, args.writer_columns, args.shards
                )
            else:
                write_record(path, args.steps, args.ranks, args.per_node)
            if "arrow" in formats and "jsonl" in formats:
                started = time.perf_counter()
                convert_record(path, arrow.parent, to="arrow")
                print(f"  converted to arrow in {time.perf_counter() - started:.1f} s", flush=True)
        for form in formats:
            record = path if form == "jsonl" else arrow
            sizes[form] = sum(f.stat().st_size for f in record.parent.iterdir() if f.is_file()) / 1e6
            for mode in modes:
                rows[form, mode] = measure(record, Path(tmp) / f"report-{form}-{mode}", mode)
                r = rows[form, mode]
                print(f"  {form} {mode}: {r['total_s']:.1f} s", flush=True)
    if not rows:
        return 0
    print(next(iter(rows.values()))["shape"])
    for (form, mode), r in rows.items():
        print(
            f"  {form:>5} {mode:>8}: record {sizes[form]:.0f} MB; load {r['load_s']:.1f} s, "
            f"findings {r['findings_s']:.1f} s, "
            f"report {r['report_s']:.1f} s, total {r['total_s']:.1f} s; peak RSS above the start: load "
            f"+{r['load_peak_mb']:.0f} MB (held after it: {r['arrays_mb']:.0f} MB), findings "
            f"+{r['findings_peak_mb']:.0f} MB, report +{r['report_peak_mb']:.0f} MB; top finding: {r['top']}"
        )
    for form in formats:
        if (form, "streamed") in rows and (form, "loaded") in rows:
            st, lo = rows[form, "streamed"], rows[form, "loaded"]
            peak = max(st["load_peak_mb"] or 0, st["findings_peak_mb"] or 0, st["report_peak_mb"] or 0)
            base = max(lo["load_peak_mb"] or 0, lo["findings_peak_mb"] or 0, lo["report_peak_mb"] or 0)
            print(
                f"  {form} streamed / loaded: total {st['total_s'] / lo['total_s']:.2f}, "
                f"peak {peak / max(base, 1):.2f}"
            )
    if ("jsonl", modes[0]) in rows and ("arrow", modes[0]) in rows:
        j, a = rows["jsonl", modes[0]], rows["arrow", modes[0]]
        ratios = [f"record {sizes['arrow'] / sizes['jsonl']:.2f}", f"total {a['total_s'] / j['total_s']:.2f}"]
        print(f"  arrow / jsonl ({modes[0]}): " + ", ".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
