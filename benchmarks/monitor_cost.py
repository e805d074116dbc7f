"""What each DDP monitor adds to a training step, in microseconds, resolved where throughput cannot be.

Not a test: it prints what it measured. Throughput ratios on a shared 2-core machine carry an error
of about 0.5% (``pacing_interleaved.py``); this measures the per-step cost itself. Every rank holds
four identical DDP models of the demo's MLP on one gloo group and trains them in turn, step by step,
in rotating order, on the same batch, with no emulated compute (the step is the model's own ~3 ms, so
a cost of tens of microseconds is a visible share):

- ``plain``: stock DDP, its built-in C++ reduction;
- ``python_hook``: DDP with torch's Python ``allreduce_hook`` (what any Python comm hook costs);
- ``comm_hook``: the pacing comm hook (``ddp_monitor: comm_hook``) and the Pacer's per-step calls;
- ``grad_ready``: the grad-ready monitor (``ddp_monitor: grad_ready``, the default) and the Pacer's
  per-step calls.

The Pacer here never closes a window (the window exchange and telemetry are timed inside whole runs
by ``overhead.py`` and ``pacing_interleaved.py``). A barrier aligns the ranks before each arm's step;
the step is timed from forward to after the optimizer, in wall time and in process CPU time (which
includes gloo's threads). Reported per arm: mean wall and CPU microseconds per step, and the
difference from ``plain`` with its standard error over ``--blocks`` consecutive blocks, per rank;
and the largest weight difference from ``plain`` (0: bit-identical).

**What users pay** (``--part job``): the throughput of a whole job, the demo's Lightning job (2
ranks, ``--compute-ms`` of emulated accelerator time and the MLP's real compute per step, the loss
logged every step to TensorBoard as a user's job logs it, and the pace tags beside it), one run per
arm per repetition, arms in rotating order: stock ``ddp``; ``paced_ddp`` measuring only
(``monitor``); the default ``adaptive`` mode; ``monitor`` with rebalancing; ``monitor`` with
cost-balanced batches (uniform inputs: the demo's samples are all one length; the A/B check runs).
Samples/s from rank 0's step times after ``--job-skip`` steps, each arm's ratio to ``ddp`` in the
same repetition: the median and range over repetitions.

    python benchmarks/monitor_cost.py            # both parts, ~8 minutes on 2 cores
    python benchmarks/monitor_cost.py --part steps     # the per-step part, ~2 minutes
    python benchmarks/monitor_cost.py --part job --job-reps 5     # the whole job, ~6 minutes
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import blocked, provenance, run_demo, write_results

from pace_strategy.telemetry.run_record import read_run_record

ARMS = ("plain", "python_hook", "comm_hook", "grad_ready")
#: the whole job's arms (``--part job``): the demo's strategy and pacing flags
JOB_ARMS: dict[str, list[str]] = {
    "ddp": ["--strategy", "ddp"],
    "monitor": ["--strategy", "paced_ddp", "--pacing", "mode=monitor"],
    "adaptive": ["--strategy", "paced_ddp"],
    "rebalance": ["--strategy", "paced_ddp", "--pacing", "mode=monitor", "--pacing", "rebalance=true"],
    "balance": ["--strategy", "paced_ddp", "--pacing", "mode=monitor", "--pacing", "balance.enabled=true"],
    # (not run by default: ``--job-arms``) measuring only, the tags of every 25th step
    "monitor_tags25": [
        "--strategy",
        "paced_ddp",
        "--pacing",
        "mode=monitor",
        "--pacing",
        "tag_every_steps=25",
    ],
}
#: the whole job's arms run by default
DEFAULT_JOB_ARMS = ("ddp", "monitor", "adaptive", "rebalance", "balance")


def _worker(rank: int, ranks: int, steps: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pace_strategy.apps.job import build_net
    from pace_strategy.apps.recipe_schema import ModelRecipe
    from pace_strategy.core import HostClock, Pacer, PacingConfig
    from pace_strategy.hooks.ddp import attach_paced_ddp
    from pace_strategy.shutdown import leave_without_finalization

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, ranks), rank=rank, world_size=ranks, timeout=timedelta(seconds=60)
    )
    torch.manual_seed(0)
    base = build_net(ModelRecipe(width=256, depth=2))  # the demo's MLP
    models = {arm: DDP(copy.deepcopy(base)) for arm in ARMS}
    models["python_hook"].register_comm_hook(None, default_hooks.allreduce_hook)
    pacers = {}
    for arm in ("comm_hook", "grad_ready"):
        # Local only: no group, a window that never closes; the per-step path is what is timed.
        cfg = PacingConfig(mode="monitor", exchange_every_steps=10**9, ddp_monitor=arm)
        pacers[arm] = Pacer(cfg, None, 0, 1, HostClock())
        attach_paced_ddp(models[arm], pacers[arm])
    opts = {arm: torch.optim.SGD(m.parameters(), lr=0.01) for arm, m in models.items()}
    wall: dict[str, list[float]] = {arm: [] for arm in ARMS}
    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    gen = torch.Generator().manual_seed(1234 + rank)
    for step in range(steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        turn = step % len(ARMS)
        for arm in ARMS[turn:] + ARMS[:turn]:
            pacer = pacers.get(arm)
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            if pacer is not None:
                pacer.begin_step(step)
            loss = torch.nn.functional.cross_entropy(models[arm](x), y)
            opts[arm].zero_grad(set_to_none=True)
            loss.backward()
            opts[arm].step()
            if pacer is not None:
                pacer.end_step()
            c1, w1 = time.process_time(), time.perf_counter()
            wall[arm].append((w1 - w0) * 1e6)
            cpu[arm].append((c1 - c0) * 1e6)
    diff = max(
        (a - b).abs().max().item()
        for arm in ARMS[1:]
        for a, b in zip(models["plain"].parameters(), models[arm].parameters(), strict=True)
    )
    Path(out, f"rank{rank}.json").write_text(json.dumps({"wall": wall, "cpu": cpu, "diff": diff}))
    del models, opts, pacers
    gc.collect()  # the grad-ready monitor's hooks hold its model in a cycle: free DDP before teardown
    dist.barrier()
    dist.destroy_process_group()
    # a spawned worker whose results are on disk: skip finalization (torch's gloo shutdown abort,
    # docs/hazards.md)
    leave_without_finalization(0)


def _difference(base: list[float], arm: list[float], blocks: int) -> tuple[float, float]:
    """Mean of ``arm - base`` per step and its standard error over ``blocks`` consecutive blocks."""
    mean, error, _ = blocked(base, arm, blocks, lambda b, a: statistics.fmean(a) - statistics.fmean(b))
    return mean, error


def summarize(raw: dict[str, Any], skip: int, blocks: int) -> list[dict[str, Any]]:
    rows = []
    for arm in ARMS:
        wall, cpu = raw["wall"][arm][skip:], raw["cpu"][arm][skip:]
        plain_wall, plain_cpu = raw["wall"]["plain"][skip:], raw["cpu"]["plain"][skip:]
        dw, dw_se = _difference(plain_wall, wall, blocks)
        dc, dc_se = _difference(plain_cpu, cpu, blocks)
        rows.append(
            {
                "arm": arm,
                "wall_us": statistics.fmean(wall),
                "cpu_us": statistics.fmean(cpu),
                "wall_over_plain_us": dw,
                "wall_over_plain_se_us": dw_se,
                "cpu_over_plain_us": dc,
                "cpu_over_plain_se_us": dc_se,
            }
        )
    return rows


def markdown(per_rank: list[list[dict[str, Any]]], header: str, diff: float) -> str:
    lines = [
        header,
        "",
        "| rank | arm | wall per step | over plain (wall) | CPU per step | over plain (CPU) |",
        "|---|---|---|---|---|---|",
    ]
    for rank, rows in enumerate(per_rank):
        for r in rows:
            lines.append(
                f"| {rank} | {r['arm']} | {r['wall_us']:.0f} us | {r['wall_over_plain_us']:+.1f} "
                f"+/- {r['wall_over_plain_se_us']:.1f} us | {r['cpu_us']:.0f} us | "
                f"{r['cpu_over_plain_us']:+.1f} +/- {r['cpu_over_plain_se_us']:.1f} us |"
            )
    lines += ["", f"Largest weight difference from plain DDP over all arms and ranks: {diff:.1e}."]
    return "\n".join(lines) + "\n"


def job_part(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """The whole job's arms (module doc): each arm's ratios to ``ddp`` by repetition, and its table.
    Two rulers: samples/s over the run (its mean step: what the job pays, bursts included) and the
    median step (what the arm's own work costs; a burst of the shared machine moves it less)."""
    names = ["ddp"] + [a for a in args.job_arms if a != "ddp"]
    by_mean: dict[str, list[float]] = {arm: [] for arm in names}
    by_median: dict[str, list[float]] = {arm: [] for arm in names}
    rates: dict[str, list[float]] = {arm: [] for arm in names}
    paced: dict[str, int] = dict.fromkeys(names, 0)  #: windows with a pacing delay, over repetitions
    demo = ["--devices", str(args.ranks), "--steps", str(args.job_steps), "--straggler", ""]
    demo += ["--compute-ms", str(args.compute_ms), "--batch-size", "32", "--log-loss"]
    global_batch = 32 * args.ranks
    with tempfile.TemporaryDirectory(prefix="pace-job-cost-") as tmp:
        for rep in range(args.job_reps):
            mean, median = {}, {}
            for i, arm in enumerate(names[rep % len(names) :] + names[: rep % len(names)]):
                times, record = run_demo(
                    Path(tmp), rep * len(names) + i, demo + JOB_ARMS[arm], skip=args.job_skip
                )
                mean[arm], median[arm] = statistics.fmean(times), statistics.median(times)
                if record is not None:
                    decisions = read_run_record(record).decisions
                    paced[arm] += sum(any(d > 0 for d in line["delays_ms"]) for line in decisions)
            for arm in names:
                rates[arm].append(global_batch * 1e3 / mean[arm])
                by_mean[arm].append(mean["ddp"] / mean[arm])
                by_median[arm].append(median["ddp"] / median[arm])
            print(
                f"repetition {rep + 1}/{args.job_reps}, samples/s (median step) over ddp: "
                + ", ".join(f"{a} {by_mean[a][-1]:.3f} ({by_median[a][-1]:.3f})" for a in names),
                flush=True,
            )
    rows = [
        {
            "arm": arm,
            "samples_per_s": statistics.median(rates[arm]),
            "ratio_median": statistics.median(by_mean[arm]),
            "ratio_range": [min(by_mean[arm]), max(by_mean[arm])],
            "median_step_ratio_median": statistics.median(by_median[arm]),
            "median_step_ratio_range": [min(by_median[arm]), max(by_median[arm])],
            "ratios": by_mean[arm],
            "median_step_ratios": by_median[arm],
            "paced_windows": paced[arm],
        }
        for arm in names
    ]
    lines = [
        f"Whole job: the demo's Lightning job, {args.ranks} ranks, {args.job_steps} steps (first "
        f"{args.job_skip} dropped), {args.compute_ms:g} ms emulated + the MLP's compute per step, the "
        f"loss logged every step; {args.job_reps} repetitions, arms in rotating order. Ratios to ddp in "
        "the same repetition (> 1: faster), median over repetitions and their range.",
        "",
        "| arm | samples/s (median) | samples/s over ddp | range | median step, ddp over arm | range | "
        "windows paced |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['arm']} | {r['samples_per_s']:.0f} | {r['ratio_median']:.3f} | "
        f"{r['ratio_range'][0]:.3f} - {r['ratio_range'][1]:.3f} | {r['median_step_ratio_median']:.3f} | "
        f"{r['median_step_ratio_range'][0]:.3f} - {r['median_step_ratio_range'][1]:.3f} | "
        f"{r['paced_windows'] if r['arm'] != 'ddp' else '-'} |"
        for r in rows
    ]
    return rows, "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["steps", "job", "both"], default="both", help="what to measure")
    p.add_argument("--ranks", type=int, default=2, help="CPU processes (gloo); default 2")
    p.add_argument("--steps", type=int, default=3000, help="steps per arm (each of four); default 3000")
    p.add_argument("--skip", type=int, default=100, help="warm-up steps of each arm dropped; default 100")
    p.add_argument("--blocks", type=int, default=10, help="blocks for the standard error; default 10")
    p.add_argument("--job-steps", type=int, default=300, help="whole job: steps per run; default 300")
    p.add_argument("--job-skip", type=int, default=50, help="whole job: warm-up steps dropped; default 50")
    p.add_argument("--job-reps", type=int, default=4, help="whole job: repetitions of every arm; default 4")
    p.add_argument(
        "--job-arms",
        nargs="+",
        default=list(DEFAULT_JOB_ARMS),
        choices=list(JOB_ARMS),
        help="whole job: arms",
    )
    p.add_argument("--compute-ms", type=float, default=10.0, help="whole job: emulated ms per step")
    p.add_argument("--out", default="benchmarks/results/monitor_cost.json")
    p.add_argument("--markdown", default="benchmarks/results/monitor_cost.md")
    args = p.parse_args()
    if args.ranks < 2 or (args.steps - args.skip) < 2 * args.blocks:
        p.error("need --ranks >= 2 and --steps - --skip >= 2 * --blocks")
    if args.job_steps - args.job_skip < 10:
        p.error("need --job-steps - --job-skip >= 10")
    meta = provenance(args)
    result: dict[str, Any] = {"benchmark": "monitor_cost", **meta}
    table = ""
    if args.part in ("steps", "both"):
        step_result, table = steps_part(args, meta)
        result.update(step_result)
    if args.part in ("job", "both"):
        rows, job_table = job_part(args)
        result["job"] = rows
        table = (
            f"{table}\n{job_table}"
            if table
            else f"{meta['date']}. Command: `{meta['command']}`\n\n{job_table}"
        )
    write_results(args.out, args.markdown, table, result)
    return 0


def steps_part(args: argparse.Namespace, meta: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The per-step part (module doc): each DDP monitor's microseconds per step, and its table."""
    import torch.multiprocessing as mp

    print(f"{args.ranks} ranks x {args.steps} steps x {len(ARMS)} arms ...", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pace-monitor-cost-") as tmp:
        mp.start_processes(
            _worker,
            args=(args.ranks, args.steps, f"{tmp}/store", tmp),
            nprocs=args.ranks,
            start_method="spawn",
            join=True,
        )
        raws = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)
    per_rank = [summarize(raw, args.skip, args.blocks) for raw in raws]
    diff = max(raw["diff"] for raw in raws)
    header = (
        f"{meta['date']}, {meta['machine']['cpus']} CPUs ({meta['machine']['platform']}), gloo, "
        f"{args.ranks} ranks, {args.steps} steps per arm (first {args.skip} dropped), no emulated "
        f"compute, standard error over {args.blocks} blocks. Command: `{meta['command']}`"
    )
    return {"ranks": per_rank, "max_weight_difference": diff}, markdown(per_rank, header, diff)


if __name__ == "__main__":
    sys.exit(main())
