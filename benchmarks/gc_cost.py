"""What timing the garbage collector costs: the GcMonitor callback per collection, gc_sync's extra
bookkeeping per young collection and per step, in one process, interleaved.

Not a test: it prints what it measured (CPU time of this process, which other processes on a shared
machine disturb less than wall time). Three measurements, each as blocks alternating between the
arms (off, monitor, monitor + gc_sync) so that every arm sees the same minutes of the machine:

- ``collect0``: explicit ``gc.collect(0)`` calls on a nearly empty young generation: the fixed cost
  of one collection with each arm's callbacks (the callback pair is all the difference);
- ``alloc``: a loop that allocates and drops small cyclic lists, so that CPython runs its automatic
  young collections itself (about one per 700 allocations): the cost of the callbacks as a share of
  Python work that allocates;
- ``due``: ``GcSync.due()``, the one thing gc_sync adds to every step (the Pacer calls it at each
  step's end).

    python benchmarks/gc_cost.py             # ~20 s
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import provenance, write_results

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.gc_monitor import GcMonitor
from pace_strategy.core.gc_sync import GcSync

ARMS = ("off", "monitor", "monitor+gc_sync")


class _Arm:
    """Installs an arm's callbacks for one block and takes them out again."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.monitor: GcMonitor | None = None
        self.sync: GcSync | None = None

    def __enter__(self) -> _Arm:
        if self.name != "off":
            self.monitor = GcMonitor(lambda ms, n: None)
            self.monitor.install()
        if self.name == "monitor+gc_sync":
            self.sync = GcSync(PacingConfig(gc_sync={"enabled": True, "warmup_steps": 0}))
            self.sync.begin_step(0, 0)  # take over (one full collection, outside the timed part)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sync is not None:
            self.sync.restore()
        if self.monitor is not None:
            self.monitor.remove()


def _collect0(n: int) -> float:
    """Seconds for ``n`` explicit young collections."""
    started = time.process_time()
    for _ in range(n):
        gc.collect(0)
    return time.process_time() - started


def _alloc(n: int) -> float:
    """Seconds for ``n`` small cyclic allocations (CPython collects the young generation itself)."""
    started = time.process_time()
    for _ in range(n):
        a: list[object] = []
        a.append(a)
    return time.process_time() - started


def _measure(blocks: int, fn: Any, n: int) -> dict[str, list[float]]:
    """Per arm, ``blocks`` timings of ``fn(n)`` in seconds, the arms in rotating order."""
    out: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for b in range(blocks):
        turn = b % len(ARMS)
        for arm in ARMS[turn:] + ARMS[:turn]:
            with _Arm(arm):
                gc.collect()  # every block starts from the same collector state
                out[arm].append(fn(n))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=15)
    p.add_argument("--collections", type=int, default=20_000, help="gc.collect(0) calls per block")
    p.add_argument("--allocations", type=int, default=500_000, help="allocations per block")
    p.add_argument("--out", default="benchmarks/results/gc_cost.json")
    p.add_argument("--markdown", default="benchmarks/results/gc_cost.md")
    args = p.parse_args(argv)
    heap = [[i] for i in range(200_000)]  # a real heap, for the arms' full collection at take-over
    collect = _measure(args.blocks, _collect0, args.collections)
    alloc = _measure(args.blocks, _alloc, args.allocations)
    young_per_block = args.allocations / max(gc.get_threshold()[0], 1)
    with _Arm("monitor+gc_sync") as arm:
        assert arm.sync is not None
        calls = 200_000
        started = time.perf_counter_ns()
        for _ in range(calls):
            arm.sync.due()
        due_ns = (time.perf_counter_ns() - started) / calls
    del heap
    per_collection_us = {a: statistics.median(collect[a]) / args.collections * 1e6 for a in ARMS}
    alloc_s = {a: statistics.median(alloc[a]) for a in ARMS}
    rows = {
        "per_collection_us": per_collection_us,
        "callback_us_per_collection": {
            a: per_collection_us[a] - per_collection_us["off"] for a in ARMS if a != "off"
        },
        "alloc_loop_ratio_over_off": {a: alloc_s[a] / alloc_s["off"] for a in ARMS},
        "alloc_loop_ratio_spread": {
            a: [
                min(alloc[a]) / statistics.median(alloc["off"]),
                max(alloc[a]) / statistics.median(alloc["off"]),
            ]
            for a in ARMS
        },
        "young_collections_per_alloc_block": young_per_block,
        "gc_sync_due_ns_per_step": due_ns,
    }
    spread = rows["alloc_loop_ratio_spread"]
    extra = {a: f"+{per_collection_us[a] - per_collection_us['off']:.2f} us" for a in ARMS if a != "off"}
    table = (
        "| arm | one young collection | added by the callbacks | allocation loop vs off |\n"
        "|---|---|---|---|\n"
        + "\n".join(
            f"| {a} | {per_collection_us[a]:.2f} us | {extra.get(a, '')} | "
            f"{alloc_s[a] / alloc_s['off']:.3f} (blocks {spread[a][0]:.2f}-{spread[a][1]:.2f}) |"
            for a in ARMS
        )
        + f"\n\ngc_sync per step (GcSync.due at each step's end): {due_ns:.0f} ns\n"
    )
    write_results(args.out, args.markdown, table, {**provenance(args), **rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
