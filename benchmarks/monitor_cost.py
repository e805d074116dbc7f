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

    python benchmarks/monitor_cost.py            # ~2 minutes on 2 cores
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

from _runs import blocked, provenance, write_results

ARMS = ("plain", "python_hook", "comm_hook", "grad_ready")


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="CPU processes (gloo); default 2")
    p.add_argument("--steps", type=int, default=3000, help="steps per arm (each of four); default 3000")
    p.add_argument("--skip", type=int, default=100, help="warm-up steps of each arm dropped; default 100")
    p.add_argument("--blocks", type=int, default=10, help="blocks for the standard error; default 10")
    p.add_argument("--out", default="benchmarks/results/monitor_cost.json")
    p.add_argument("--markdown", default="benchmarks/results/monitor_cost.md")
    args = p.parse_args()
    if args.ranks < 2 or (args.steps - args.skip) < 2 * args.blocks:
        p.error("need --ranks >= 2 and --steps - --skip >= 2 * --blocks")
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
    meta = provenance(args)
    header = (
        f"{meta['date']}, {meta['machine']['cpus']} CPUs ({meta['machine']['platform']}), gloo, "
        f"{args.ranks} ranks, {args.steps} steps per arm (first {args.skip} dropped), no emulated "
        f"compute, standard error over {args.blocks} blocks. Command: `{meta['command']}`"
    )
    result = {"benchmark": "monitor_cost", **meta, "ranks": per_rank, "max_weight_difference": diff}
    write_results(args.out, args.markdown, markdown(per_rank, header, diff), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
