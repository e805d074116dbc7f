"""What pacing does here: plain ``ddp`` vs ``paced_ddp`` (adaptive), interleaved, per scenario.

Not a test: it prints what it measured. Each scenario runs the demo's model and data on CPU ranks
(gloo over loopback) with a seeded injection (a straggler's time is spent in its backward, the
demo's default phase; the ``real-*`` scenarios have no emulated compute at all, only the MLP's own,
and ``real-quota@2`` slows a node with a CPU quota on the test bed instead of any injection), as
pairs A B, B A, A B, ... so slow drifts of the
machine hit both arms alike. Step times come from one callback on rank 0 shared by both arms; the
first ``--skip`` steps are dropped. Per scenario: throughput ratio paced/plain (median and spread
over pairs; throughput = steps / summed step time), step-time CV and p99 of each arm (median over
its runs), and, from the paced runs' own records, the median skew, the share of steps with pacing
active and the mean delay applied. Writes JSON and the Markdown table of ``docs/benchmarks.md``.

Two more things make a small difference readable on a noisy machine. The ``control`` scenario runs
plain ``ddp`` against itself, so the table shows the spread an A/B pair has when nothing differs.
And each paced run is also measured from the inside, where the arms share the same minutes of the
machine: the monitoring cost (the Pacer's own timer of its window work on rank 0's training
thread, as a fraction of the median step), the median step time of its paced steps over that of
its unpaced steps, and from those with the share of paced steps an in-run estimate of the
throughput ratio, ``1 / ((1 + cost) * (1 + share * (paced/unpaced - 1)))``. The estimate assumes
the unpaced steps of ``paced_ddp`` are plain ``ddp`` steps plus the measured monitoring cost.

    python benchmarks/pacing_ab.py                          # ~15 minutes on 2 cores
    python benchmarks/pacing_ab.py --repeats 1 --steps 80 --scenarios clean   # smoke run

The oversubscribed-uplink scenarios (the paper's case) run on the two-rack test bed
(``pace testbed``, root needed): two node namespaces, one per rack, joined by a ``tbf``-shaped
uplink (``--uplink-mbit``), with the ranks split evenly over the two nodes; the fabric is brought
up once per scenario and always torn down. Without root they are listed as not run.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import provenance, run_demo, transient_spec, write_results

from pace_strategy import testbed
from pace_strategy.telemetry.run_record import read_run_record


@dataclass(frozen=True)
class Scenario:
    name: str
    ranks: int
    demo_args: tuple[str, ...]
    what: str
    fabric: testbed.FabricSpec | None = None  # None: every rank on loopback in one namespace
    candidate: str = "paced_ddp"  # the B arm; "ddp" makes the scenario an A/A control


#: The two arms of every A/B pair; ``Scenario.candidate`` is the strategy of the second.
ARMS = ("plain", "candidate")


def scenarios(compute_ms: float, uplink_mbit: float) -> list[Scenario]:
    base = ("--compute-ms", f"{compute_ms:g}")
    out = [
        Scenario(
            "control",
            4,
            (*base, "--straggler", ""),
            "plain ddp against itself, no injection: the spread of an A/B pair when nothing differs",
            candidate="ddp",
        ),
        Scenario("clean", 4, (*base, "--straggler", ""), "no injection"),
        Scenario(
            "transient",
            4,
            (*base, "--straggler", transient_spec(4)),
            "every rank +30 ms with probability 0.1 per step (seeded)",
        ),
        Scenario("persistent", 4, (*base, "--straggler", "1:30"), "rank 1 +30 ms every step"),
        Scenario(
            "locality",
            4,
            (*base, "--straggler", "1:20,3:20"),
            "local rank 1 of 2 emulated nodes of 2 ranks (ranks 1 and 3) +20 ms every step",
        ),
    ]
    real = ("--compute-ms", "0", "--hidden", "1024", "--batch-size", "64")
    out += [
        Scenario(
            "real-clean@2", 2, (*real, "--straggler", ""), "real compute only (width 1024), no injection"
        ),
        Scenario(
            "real-backward@2",
            2,
            (*real, "--straggler", "1:16"),
            "real compute only; rank 1's backward +16 ms every step, after its first block",
        ),
        Scenario(
            "real-quota@2",
            2,
            (*real, "--straggler", ""),
            "real compute only; 2 nodes, node 1 under a 0.5-CPU quota (slow in bursts)",
            fabric=testbed.FabricSpec(
                nodes=2, racks=1, uplink_mbit=10000, cpu_quota={1: 0.5}, prefix="pace-ab"
            ),
        ),
    ]
    for ranks in (2, 8):
        out.append(
            Scenario(
                f"transient@{ranks}",
                ranks,
                (*base, "--straggler", transient_spec(ranks)),
                f"as transient, {ranks} ranks",
            )
        )
    for ranks in (2, 4, 8):
        # Two nodes, one per rack: every ring all-reduce crosses the shaped uplink both ways.
        spec = testbed.FabricSpec(nodes=2, racks=2, uplink_mbit=uplink_mbit, prefix="pace-ab")
        out.append(
            Scenario(
                f"uplink+transient@{ranks}",
                ranks,
                (*base, "--straggler", transient_spec(ranks)),
                f"2 nodes in 2 racks ({ranks // 2} ranks each), uplink {uplink_mbit:g} Mbit/s, "
                "transient as above",
                fabric=spec,
            )
        )
    return out


def not_runnable(s: Scenario) -> str | None:
    """Why scenario ``s`` cannot run on this machine, or ``None``."""
    if s.fabric is not None and os.geteuid() != 0:
        return "needs root for the test bed (network namespaces); run the benchmark as root"
    return None


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _cv(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


def _paced_stats(record_path: Path, skip: int) -> dict[str, float]:
    """What one paced run's own record says: skew, pacing, and the in-run cost figures (module doc)."""
    record = read_run_record(record_path)
    steps = [s for s in record.steps if s["step"] >= skip and s["valid"]]
    paced = [s["step_ms"] for s in steps if s["pacing_active"]]
    unpaced = [s["step_ms"] for s in steps if not s["pacing_active"]]
    share = len(paced) / len(steps)
    cost = (record.end or {}).get("rank0_pacer_cost") or {}
    monitor_cost = (
        cost.get("window_work_us_per_step", math.nan) / 1e3 / statistics.median(s["step_ms"] for s in steps)
    )
    # No paced step: pacing changed nothing, only monitoring costs. No unpaced one: no reference.
    if not paced:
        paced_over_unpaced = 1.0
    elif unpaced:
        paced_over_unpaced = statistics.median(paced) / statistics.median(unpaced)
    else:
        paced_over_unpaced = math.nan
    return {
        "median_skew_ms": statistics.median(s["skew_ms"] for s in steps),
        "pacing_active_share": share,
        "mean_delay_ms": statistics.fmean(s["delay_ms_max"] for s in steps),
        "monitor_cost_fraction": monitor_cost,
        "paced_over_unpaced_step": paced_over_unpaced,
        "in_run_ratio": 1.0 / ((1.0 + monitor_cost) * (1.0 + share * (paced_over_unpaced - 1.0))),
    }


def run_scenario(s: Scenario, args: argparse.Namespace, workdir: Path, counter: list[int]) -> dict[str, Any]:
    arms: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    paced: list[dict[str, float]] = []
    fabric_cm = testbed.running(s.fabric) if s.fabric is not None else contextlib.nullcontext(None)
    with fabric_cm as fabric:
        _interleave(s, args, workdir, counter, arms, paced, fabric)
    ratios = [sum(a) / sum(b) for a, b in zip(arms["plain"], arms["candidate"], strict=True)]
    return {
        "scenario": s.name,
        "what": s.what,
        "ranks": s.ranks,
        "candidate": s.candidate,
        "throughput_ratio_median": statistics.median(ratios),
        "throughput_ratio_spread": [min(ratios), max(ratios)],
        "throughput_ratios": ratios,  # per A/B pair, in run order
        "cv_plain": statistics.median(_cv(t) for t in arms["plain"]),
        "cv_paced": statistics.median(_cv(t) for t in arms["candidate"]),
        "p99_plain_ms": statistics.median(_p99(t) for t in arms["plain"]),
        "p99_paced_ms": statistics.median(_p99(t) for t in arms["candidate"]),
        # Medians over the paced runs of what their own records say (absent for an A/A control).
        **({k: statistics.median(p[k] for p in paced) for k in paced[0]} if paced else {}),
    }


def _interleave(
    s: Scenario,
    args: argparse.Namespace,
    workdir: Path,
    counter: list[int],
    arms: dict[str, list[list[float]]],
    paced: list[dict[str, float]],
    fabric: testbed.Fabric | None,
) -> None:
    """The scenario's A/B pairs, in alternating order, appended to ``arms`` and ``paced``."""
    per_node = s.ranks // len(fabric.nodes) if fabric is not None else s.ranks
    strategy = {"plain": "ddp", "candidate": s.candidate}
    if args.fork:  # the same arms, their ranks forked from the launcher (a faster start, the same steps)
        strategy = {arm: f"{name}_fork" for arm, name in strategy.items()}
    for rep in range(args.repeats):
        for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
            counter[0] += 1
            demo = ["--devices", str(per_node), *s.demo_args, "--steps", str(args.steps)]
            demo += ["--strategy", strategy[arm]]
            times, record = run_demo(workdir, counter[0], demo, skip=args.skip, fabric=fabric)
            arms[arm].append(times)
            if record is not None:
                paced.append(_paced_stats(record, args.skip))
            print(
                f"[{counter[0]:>3}/{counter[1]}] {s.name:<22} {arm:<9} {strategy[arm]:<9} mean step "
                f"{statistics.fmean(times):7.2f} ms  elapsed {time.monotonic() - args.t0:5.0f} s",
                flush=True,
            )


def _in_run(r: dict[str, Any], key: str, fmt: str, unit: str = "") -> str:
    value = r.get(key)
    return "-" if value is None or math.isnan(value) else format(value, fmt) + unit


def markdown(rows: list[dict[str, Any]], header: str, skipped: dict[str, str]) -> str:
    lines = [
        header,
        "",
        "| scenario | ranks | throughput B/A (median, spread) | step CV A / B | p99 step A / B "
        "| median skew | pacing active | mean delay | monitoring cost | paced / unpaced step "
        "| in-run ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["throughput_ratio_spread"]
        name = r["scenario"] + (" (ddp vs ddp)" if r.get("candidate") == "ddp" else "")
        lines.append(
            f"| {name} | {r['ranks']} | {r['throughput_ratio_median']:.3f} ({lo:.3f}-{hi:.3f}) "
            f"| {r['cv_plain']:.3f} / {r['cv_paced']:.3f} "
            f"| {r['p99_plain_ms']:.1f} / {r['p99_paced_ms']:.1f} ms "
            f"| {_in_run(r, 'median_skew_ms', '.1f', ' ms')} | {_in_run(r, 'pacing_active_share', '.0%')} "
            f"| {_in_run(r, 'mean_delay_ms', '.2f', ' ms')} | {_in_run(r, 'monitor_cost_fraction', '.2%')} "
            f"| {_in_run(r, 'paced_over_unpaced_step', '.3f')} | {_in_run(r, 'in_run_ratio', '.4f')} |"
        )
    for name, why in skipped.items():
        lines.append(f"| {name} | - | not run: {why} | | | | | | | | |")
    lines += [
        "",
        "A = plain `ddp`, B = `paced_ddp` (adaptive), or `ddp` again in the control. The last three "
        "columns come from the paced runs' own records (medians over runs): see the method notes.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="A/B pairs per scenario")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--skip", type=int, default=20, help="warm-up steps dropped from each run")
    p.add_argument("--compute-ms", type=float, default=20.0, help="emulated accelerator time per step")
    p.add_argument("--uplink-mbit", type=float, default=150.0, help="test-bed uplink rate, Mbit/s")
    p.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    p.add_argument(
        "--fork",
        action="store_true",
        help="start each run's ranks by fork (ddp_fork, paced_ddp_fork): no second Lightning import per "
        "run; the steps measured are the same",
    )
    p.add_argument("--out", default="benchmarks/results/pacing_ab.json")
    p.add_argument("--markdown", default="benchmarks/results/pacing_ab.md", help="the table, for the docs")
    args = p.parse_args()
    chosen = scenarios(args.compute_ms, args.uplink_mbit)
    if args.scenarios:
        wanted = args.scenarios.split(",")
        unknown = sorted(set(wanted) - {s.name for s in chosen})
        if unknown:
            p.error(f"unknown scenarios {unknown}; have {[s.name for s in chosen]}")
        chosen = [s for s in chosen if s.name in wanted]
    skipped = {s.name: why for s in chosen if (why := not_runnable(s)) is not None}
    chosen = [s for s in chosen if s.name not in skipped]
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", flush=True)
    args.t0 = time.monotonic()
    counter = [0, 2 * args.repeats * len(chosen)]
    with tempfile.TemporaryDirectory(prefix="pace-ab-") as tmp:
        rows = [run_scenario(s, args, Path(tmp), counter) for s in chosen]
    del args.t0
    meta = provenance(args)
    header = (
        f"{meta['date']}, {meta['machine']['cpus']} CPUs ({meta['machine']['platform']}), gloo over "
        f"loopback (test-bed scenarios: over the emulated two-rack fabric), {args.steps} steps per run "
        f"(first {args.skip} dropped), {args.repeats} interleaved "
        f"A/B pairs per scenario, emulated compute {args.compute_ms:g} ms/step (real-* scenarios: none). "
        "Command: "
        f"`{meta['command']}`; test-bed uplink {args.uplink_mbit:g} Mbit/s"
    )
    result = {"benchmark": "pacing_ab", **meta, "rows": rows}
    write_results(args.out, args.markdown, markdown(rows, header, skipped), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
