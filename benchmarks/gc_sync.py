"""Synchronized garbage collection (``gc_sync``): plain ``ddp``, ``paced_ddp`` and ``paced_ddp`` with
``gc_sync``, on a GC-heavy and a GC-light job, at 2 and 4 ranks, interleaved in one run.

Not a test: it prints what it measured. Each repetition runs every (ranks, load) cell's three arms
back to back in a rotating order (ddp, paced, gc_sync; then paced, gc_sync, ddp; ...), so every arm
sees the same minutes of the shared machine. The job is the demo's (``pace demo``): the MLP with a
sleep standing in for accelerator time, plus, for the heavy load, ``model.gc_heap_objects``
long-lived objects per rank and ``model.gc_garbage_objects`` cyclic garbage per step that lives three
steps (so only full collections free it; 0.5-1.5x per step, seeded by rank, so ranks collect at
their own steps). The GC-light load is the plain demo job.

Reported per cell: steps/s of each arm from rank 0's step times (the same ruler for every arm) and
the ratios against ``ddp`` and ``paced`` (over all repetitions, with the range of the per-repetition
ratios: on a shared machine that range is the noise); the skew p99 of the two paced arms (from their run
records); full collections per rank over the run (the end line's ``gc`` reports; heap build and
warm-up included, the same for both arms); the GC stall of the ``paced`` arm: per step, the longest
time any rank spent in the collector, summed (the job waits for the slowest rank); and how close the
measured saving (``paced`` minus ``gc_sync`` step time) comes to the expected (W-1)/W of that stall.

    python benchmarks/gc_sync.py            # 2 and 4 ranks, 200 steps, 3 repetitions: ~25 min on 2 cores
    python benchmarks/gc_sync.py --quick    # 150 steps, one repetition: a few minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import provenance, run_demo, write_results

ARMS = ("ddp", "paced", "gc_sync")
LOADS = ("heavy", "light")


def _demo_args(arm: str, load: str, ranks: int, args: argparse.Namespace) -> list[str]:
    out = ["--devices", str(ranks), "--steps", str(args.steps), "--straggler", ""]
    out += ["--compute-ms", str(args.compute_ms)]
    if load == "heavy":
        out += ["--gc-heap-objects", str(args.heap), "--gc-garbage-objects", str(args.garbage)]
    out += ["--strategy", "ddp" if arm == "ddp" else "paced_ddp"]
    if arm == "gc_sync":
        out += ["--pacing", "gc_sync=true"]
        if args.freeze:
            out += ["--pacing", "gc_sync.freeze=true"]
    return out


def _record_stats(record: Path | None, skip: int) -> dict[str, Any]:
    """Skew p99, GC stall per step and full collections per rank from a paced run's record."""
    if record is None:
        return {}
    lines = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    steps = [x for x in lines if x.get("record") == "step" and x["valid"] and not x["warmup"]][skip:]
    end = next((x for x in lines if x.get("record") == "end"), {})
    skew = sorted(float(x["skew_ms"]) for x in steps)
    stall = [max(x["ranks"].get("gc_ms") or [0.0]) for x in steps]
    reports = end.get("gc") or []
    return {
        "skew_ms_p99": skew[min(len(skew) - 1, int(0.99 * len(skew)))] if skew else float("nan"),
        "gc_stall_ms_per_step": statistics.fmean(stall) if stall else 0.0,
        "full_collections_per_rank": [r["collections"][2] for r in reports],
        "synchronized_per_rank": [(r.get("gc_sync") or {}).get("synchronized", 0) for r in reports],
    }


def _cell(
    times: dict[str, list[list[float]]], stats: dict[str, dict[str, Any]], ranks: int
) -> dict[str, Any]:
    """One (ranks, load) cell: ``times[arm]`` holds each repetition's step times."""
    mean = {arm: statistics.fmean([t for run in runs for t in run]) for arm, runs in times.items()}
    rate = {arm: 1e3 / m for arm, m in mean.items()}
    per_rep = {
        name: [
            statistics.fmean(a) / statistics.fmean(b)
            for a, b in zip(times[base], times["gc_sync"], strict=True)
        ]
        for name, base in (("gc_sync_over_ddp", "ddp"), ("gc_sync_over_paced", "paced"))
    }
    stall = stats["paced"].get("gc_stall_ms_per_step", 0.0)
    expected = (ranks - 1) / ranks * stall
    saved = mean["paced"] - mean["gc_sync"]
    return {
        "steps_per_s": rate,
        "mean_step_ms": mean,
        "gc_sync_over_ddp": rate["gc_sync"] / rate["ddp"],
        "gc_sync_over_paced": rate["gc_sync"] / rate["paced"],
        # steps/s ratio of each repetition (its three arms ran back to back): their spread is the noise
        "gc_sync_over_ddp_per_repetition": per_rep["gc_sync_over_ddp"],
        "gc_sync_over_paced_per_repetition": per_rep["gc_sync_over_paced"],
        "paced_over_ddp": rate["paced"] / rate["ddp"],
        "skew_ms_p99_paced": stats["paced"].get("skew_ms_p99"),
        "skew_ms_p99_gc_sync": stats["gc_sync"].get("skew_ms_p99"),
        "gc_stall_ms_per_step_paced": stall,
        "gc_stall_ms_per_step_gc_sync": stats["gc_sync"].get("gc_stall_ms_per_step", 0.0),
        "expected_saving_ms_per_step": expected,
        "measured_saving_ms_per_step": saved,
        "saving_over_expected": saved / expected if expected > 0.5 else None,
        "full_collections_per_rank_paced": stats["paced"].get("full_collections_per_rank"),
        "full_collections_per_rank_gc_sync": stats["gc_sync"].get("full_collections_per_rank"),
        "synchronized_per_rank": stats["gc_sync"].get("synchronized_per_rank"),
    }


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| ranks | load | steps/s ddp | paced | gc_sync | gc_sync/ddp | gc_sync/paced | skew p99 paced -> "
        "gc_sync | GC stall/step (paced) | saved / expected | full GCs per rank paced -> gc_sync |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        s = r["steps_per_s"]
        ratio = r["saving_over_expected"]
        spread = {
            k: f" ({min(r[k + '_per_repetition']):.2f}-{max(r[k + '_per_repetition']):.2f})"
            if len(r[k + "_per_repetition"]) > 1
            else ""
            for k in ("gc_sync_over_ddp", "gc_sync_over_paced")
        }
        lines.append(
            f"| {r['ranks']} | {r['load']} | {s['ddp']:.2f} | {s['paced']:.2f} | {s['gc_sync']:.2f} | "
            f"{r['gc_sync_over_ddp']:.3f}{spread['gc_sync_over_ddp']} | "
            f"{r['gc_sync_over_paced']:.3f}{spread['gc_sync_over_paced']} | "
            f"{r['skew_ms_p99_paced']:.1f} -> {r['skew_ms_p99_gc_sync']:.1f} ms | "
            f"{r['gc_stall_ms_per_step_paced']:.1f} ms | "
            f"{r['measured_saving_ms_per_step']:.1f} / {r['expected_saving_ms_per_step']:.1f} ms"
            f"{f' ({ratio:.2f})' if ratio is not None else ''} | "
            f"{r['full_collections_per_rank_paced']} -> {r['full_collections_per_rank_gc_sync']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="150 steps, one repetition")
    p.add_argument("--ranks", default="2,4", help="rank counts, comma-separated")
    p.add_argument("--loads", default="heavy,light", help="heavy, light or both")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--skip", type=int, default=10, help="first steps of each run not measured")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every cell's three arms")
    p.add_argument("--compute-ms", type=float, default=20.0)
    p.add_argument("--heap", type=int, default=1_500_000, help="heavy load: long-lived objects per rank")
    p.add_argument("--garbage", type=int, default=20_000, help="heavy load: cyclic garbage per step")
    p.add_argument("--freeze", action="store_true", help="the gc_sync arm also freezes the heap")
    p.add_argument("--out", default="benchmarks/results/gc_sync.json")
    p.add_argument("--markdown", default="benchmarks/results/gc_sync.md")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = min(args.steps, 150), 1
    ranks_list = [int(x) for x in args.ranks.split(",") if x]
    loads = [x for x in args.loads.split(",") if x]
    times: dict[tuple[int, str], dict[str, list[list[float]]]] = {}
    stats: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
    index = 0
    with tempfile.TemporaryDirectory(prefix="gc_sync_bench_") as tmp:
        for rep in range(args.repeats):
            for ranks in ranks_list:
                for load in loads:
                    cell = (ranks, load)
                    times.setdefault(cell, {arm: [] for arm in ARMS})
                    stats.setdefault(cell, {})
                    turn = index % len(ARMS)
                    for arm in ARMS[turn:] + ARMS[:turn]:
                        print(f"rep {rep + 1}/{args.repeats}: {ranks} ranks, {load}, {arm}", flush=True)
                        step_ms, record = run_demo(
                            Path(tmp), index, _demo_args(arm, load, ranks, args), skip=args.skip
                        )
                        times[cell][arm].append(step_ms)
                        if arm != "ddp":  # the last repetition's record: its counts are per run
                            stats[cell][arm] = _record_stats(record, args.skip)
                        index += 1
    rows = [
        {"ranks": ranks, "load": load, **_cell(times[(ranks, load)], stats[(ranks, load)], ranks)}
        for ranks in ranks_list
        for load in loads
    ]
    table = _table(rows)
    write_results(args.out, args.markdown, table, {**provenance(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
