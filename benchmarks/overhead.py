"""Monitoring overhead: plain ``ddp`` vs ``paced_ddp`` monitor-only vs ``paced_ddp`` adaptive.

Not a test: it prints what it measured. 4 CPU ranks (gloo), the demo's model and data in every arm,
no injected straggler (this measures what monitoring costs, not what pacing does). Runs are
interleaved (A B C, B C A, C A B, ...) so slow drifts of the machine hit every arm alike. Each run's
step times come from one callback on rank 0 that every arm shares; the first ``--skip`` steps are
dropped. Reported: the median over runs of each run's median step time, the spread of those run
medians, and the ratio to plain ``ddp``. A second figure times the Pacer's per-step hot path alone.

    python benchmarks/overhead.py                 # ~6 minutes on 2 cores
    python benchmarks/overhead.py --repeats 2 --steps 120   # quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import provenance, run_demo

from pace_strategy.telemetry.run_record import read_run_record

ARMS = {
    "ddp": ["--strategy", "ddp"],
    "paced monitor": ["--strategy", "paced_ddp", "--pacing", "mode=monitor"],
    "paced adaptive": ["--strategy", "paced_ddp"],
}
#: arms that take monitoring apart, one part off at a time (``--arms``): where its cost is
ABLATION = {
    "monitor, no record": [
        "--strategy",
        "paced_ddp",
        "--pacing",
        "mode=monitor",
        "--pacing",
        "run_record=false",
    ],
    "monitor, no windows": [
        "--strategy",
        "paced_ddp",
        "--pacing",
        "mode=monitor",
        "--pacing",
        "exchange_every_steps=1000000",
    ],
    "monitor, no hang watchdog": [
        "--strategy",
        "paced_ddp",
        "--pacing",
        "mode=monitor",
        "--pacing",
        "hang.timeout_s=0",
    ],
}
ALL_ARMS = {**ARMS, **ABLATION}


def run_arm(
    arm: str, args: argparse.Namespace, workdir: Path, index: int
) -> tuple[list[float], float | None]:
    """One training run; returns rank 0's step times and, for paced arms, the pacer's own window cost
    (microseconds per step, measured inside the run)."""
    demo = ["--devices", str(args.devices), "--steps", str(args.steps), "--straggler", ""]
    strategy = ALL_ARMS[arm]
    if args.fork:  # ranks forked from the launcher: the same training, a faster start
        strategy = [{"ddp": "ddp_fork", "paced_ddp": "paced_ddp_fork"}.get(a, a) for a in strategy]
    demo += ["--compute-ms", str(args.compute_ms), *strategy]
    times, record = run_demo(workdir, index, demo, skip=args.skip)
    cost = None
    if record is not None:
        end = read_run_record(record).end or {}
        cost = end.get("rank0_pacer_cost", {}).get("window_work_us_per_step")  # training-thread time
    return times, cost


def hot_path_us(steps: int = 20000) -> float:
    """Microseconds per step of the Pacer's per-step calls alone (single process, host clock, no window
    ever closes: the window work is measured inside the real runs instead)."""
    import torch

    from pace_strategy.core import HostClock, Pacer, PacingConfig

    pacer = Pacer(PacingConfig(mode="monitor", exchange_every_steps=10**9), None, 0, 1, HostClock())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(torch.zeros(1))
    start = time.perf_counter()
    for step in range(steps):
        pacer.begin_step(step)
        pacer.enter_sync()
        pacer.note_bucket()
        pacer.arrive()  # the end of local backward (the last bucket, or the monitor's engine callback)
        pacer.sync_done_callback()(fut)
        pacer.end_step()
    return (time.perf_counter() - start) / steps * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="runs per arm (interleaved)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--skip", type=int, default=30, help="warm-up steps dropped from each run")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--compute-ms", type=float, default=30.0, help="emulated accelerator time per step")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ALL_ARMS), help="ddp first")
    p.add_argument("--fork", action="store_true", help="fork the ranks (ddp_fork / paced_ddp_fork)")
    p.add_argument("--out", default="benchmarks/results/overhead.json")
    args = p.parse_args()
    if args.arms[0] != "ddp":
        p.error("--arms: the first arm is the baseline, ddp")

    arms = list(args.arms)
    medians: dict[str, list[float]] = {a: [] for a in arms}
    means: dict[str, list[float]] = {a: [] for a in arms}
    costs: dict[str, list[float]] = {a: [] for a in arms}
    pooled: dict[str, list[float]] = {a: [] for a in arms}
    total = args.repeats * len(arms)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pace-bench-") as tmp:
        index = 0
        for rep in range(args.repeats):
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
            for arm in order:
                index += 1
                times, cost = run_arm(arm, args, Path(tmp), index)
                if cost is not None:
                    costs[arm].append(cost)
                medians[arm].append(statistics.median(times))
                means[arm].append(statistics.fmean(times))
                pooled[arm].extend(times)
                print(
                    f"[{index:>2}/{total}] {arm:<15} median {medians[arm][-1]:7.2f} ms "
                    f"({len(times)} steps)  elapsed {time.monotonic() - t0:5.0f} s",
                    flush=True,
                )
    hot = hot_path_us()
    base = statistics.median(medians["ddp"])
    base_mean = statistics.median(means["ddp"])
    rows = []
    for arm in arms:
        m = statistics.median(medians[arm])
        mean = statistics.median(means[arm])
        rows.append(
            {
                "arm": arm,
                "median_step_ms": m,
                "run_medians_ms": medians[arm],
                "spread_ms": [min(medians[arm]), max(medians[arm])],
                "pooled_median_ms": statistics.median(pooled[arm]),
                "ratio_to_ddp": m / base,
                "mean_step_ms": mean,
                "run_means_ms": means[arm],
                # what throughput sees: every step counted, the slow ones at a window's end too
                "throughput_ratio_to_ddp": base_mean / mean,
                "pooled_ratio_to_ddp": statistics.median(pooled[arm]) / statistics.median(pooled["ddp"]),
                "rank0_window_work_us_per_step": statistics.median(costs[arm]) if costs[arm] else None,
            }
        )
    header = (
        f"\n{args.devices} CPU ranks, gloo, {args.steps} steps/run (first {args.skip} dropped), "
        f"{args.repeats} interleaved runs per arm, emulated compute {args.compute_ms:g} ms/step"
    )
    print(header)
    print(
        f"{'arm':<28}{'median step':>12}{'run spread':>20}{'ratio to ddp':>14}{'pooled ratio':>14}"
        f"{'mean step':>12}{'throughput':>12}"
    )
    for r in rows:
        spread = f"{r['spread_ms'][0]:.2f}-{r['spread_ms'][1]:.2f} ms"
        print(
            f"{r['arm']:<28}{r['median_step_ms']:>9.2f} ms{spread:>20}"
            f"{r['ratio_to_ddp']:>14.4f}{r['pooled_ratio_to_ddp']:>14.4f}"
            f"{r['mean_step_ms']:>9.2f} ms{r['throughput_ratio_to_ddp']:>12.4f}"
        )
    calls = "begin, enter_sync, 1 bucket, arrive, done, end"
    print(f"Pacer per-step hot path alone: {hot:.1f} us per step ({calls})")
    for r in rows:
        work = r["rank0_window_work_us_per_step"]
        if work is not None:
            us = work + hot
            print(
                f"{r['arm']}: rank 0 window work {work:.1f} us/step (measured inside the runs); "
                f"with the hot path {us:.1f} us/step = {us / 1e3 / base:.3%} of the ddp step time"
            )
    result = {
        "benchmark": "overhead",
        **provenance(args),
        "arms": rows,
        "hot_path_us_per_step": hot,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
