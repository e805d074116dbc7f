"""Balancing's A/B check on real compute: does the run keep cost-balanced batches where they shorten
the step, and drop them where they do not?

Not a test: it prints what the check decided. Two input mixes, each one data-parallel job of CPU
processes (gloo) training ``benchmarks/balance.py``'s tiny transformer (real attention, padded
batches) through the product's path (``pace_strategy.attach`` with ``balance.enabled`` and the check
on, ``pace.dataloader``):

- ``long-tail``: lengths log-normal(``--mu``, ``--sigma``) clipped to 16-``--max-len`` tokens: the
  rank that draws the longest sequences sets the step, balanced batches shorten it;
- ``uniform``: every sequence ``--uniform-length`` tokens: nothing to balance (the balanced split
  is the plain one at equal cost), so the arms differ by noise only.

Each job runs the check (``--window`` steps per window, 2 windows per arm, ``--check-rounds``
rounds) and trains on; the verdict, the arms' median step times and the step time of each arm's
steps are read back from the run record. The verdict is the product's; the ratio beside it is the
check's own measurement (its arms' window medians), not a separate benchmark.

    python benchmarks/balance_check.py                          # ~1 minute on 2 cores
    python benchmarks/balance_check.py --mixes long-tail --steps 120   # one mix
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import provenance, write_results
from balance import Tokens, build_model, collate, lengths_of, sample_losses

MIXES = ("long-tail", "uniform")


def _worker(rank: int, ranks: int, args: argparse.Namespace, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    import pace_strategy
    from pace_strategy.shutdown import leave_without_finalization

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, ranks),
        rank=rank,
        world_size=ranks,
        timeout=timedelta(seconds=120),
    )
    samples = args.batch * ranks * args.steps
    for mix in args.mixes:
        if mix == "long-tail":
            lengths = [min(n, args.max_len) for n in lengths_of(samples, args.mu, args.sigma, seed=1)]
        else:
            lengths = [args.uniform_length] * samples
        model = DDP(build_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        pacing = {
            "mode": "monitor",
            "exchange_every_steps": args.window,
            "warmup_steps": 4,
            "ab_windows": 2,
            "balance": {"enabled": True, "layout": "padded", "check_rounds": args.check_rounds},
        }
        pace = pace_strategy.attach(model, pacing=pacing, run_dir=Path(out, mix))
        loader = DataLoader(Tokens(lengths, seed=2), batch_size=args.batch, shuffle=True, collate_fn=collate)
        for batch in pace.dataloader(loader):
            pace.begin_step()  # the batch is in hand: its share factor is taken
            optimizer.zero_grad(set_to_none=True)
            sample_losses(model, batch, "padded").mean().backward()
            optimizer.step()
            pace.end_step()
        pace.finish()
    dist.barrier()
    dist.destroy_process_group()
    leave_without_finalization(0)  # torch's gloo shutdown abort (docs/hazards.md)


def read_mix(run_dir: Path, mix: str) -> dict[str, Any]:
    """What the check decided in one job's record (its last verdict, as ``pace diagnose`` reads it),
    and the median step at each arm over the record's post-warm-up steps."""
    import numpy as np

    from pace_strategy.diagnose.rebalance import balance_outcome
    from pace_strategy.telemetry.arrays import load_lines

    a = load_lines(run_dir)
    verdict = balance_outcome(a)
    # each step's arm, from the check's switches (balanced from the first step; a "fit" line only
    # changes the cost model)
    switches = [
        (s["from_step"], s["balanced"])
        for s in a.shares
        if s.get("balance") not in (None, "fit") and s["from_step"] is not None
    ]
    balanced = np.ones(a.steps, dtype=bool)
    for start, arm in switches:
        balanced[a.step >= start] = arm
    arms = {name: a.step_ms[balanced == (name == "balanced")] for name in ("balanced", "plain")}
    return {
        "mix": mix,
        "steps": a.total_steps,
        "verdict": None if verdict is None else ("kept" if verdict.kept else "dropped"),
        "reason": "no verdict (too few steps)" if verdict is None else verdict.reason,
        "plain_step_ms": None if verdict is None else verdict.plain_ms,
        "balanced_step_ms": None if verdict is None else verdict.balanced_ms,
        "switches": switches,
        "cost": None if verdict is None else verdict.cost,
        "median_step_ms": {name: float(np.median(v)) if v.size else None for name, v in arms.items()},
    }


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        "| mix | steps | verdict | plain arm (ms) | balanced arm (ms) | balanced / plain | switches |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, b = r["plain_step_ms"], r["balanced_step_ms"]
        ratio = f"{b / p:.2f}" if p and b else "-"
        cells = [r["mix"], str(r["steps"]), str(r["verdict"]), f"{p:.1f}" if p else "-"]
        cells += [
            f"{b:.1f}" if b else "-",
            ratio,
            ", ".join(f"{f}:{'B' if s else 'P'}" for f, s in r["switches"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="CPU processes (gloo); default 2")
    p.add_argument("--batch", type=int, default=4, help="samples per rank at even shares; default 4")
    p.add_argument("--steps", type=int, default=160, help="steps of each job; default 160")
    p.add_argument("--window", type=int, default=8, help="exchange_every_steps; default 8")
    p.add_argument("--check-rounds", type=int, default=2, help="balance.check_rounds; default 2")
    p.add_argument("--mu", type=float, default=4.5, help="log-normal lengths: mean of the log; default 4.5")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal lengths: sd of the log; default 0.8")
    p.add_argument("--max-len", type=int, default=256, help="longest sequence, tokens; default 256")
    p.add_argument("--uniform-length", type=int, default=96, help="the uniform mix's length; default 96")
    p.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    p.add_argument("--out", default="benchmarks/results/balance_check.json")
    p.add_argument("--markdown", default="benchmarks/results/balance_check.md")
    args = p.parse_args()
    import torch.multiprocessing as mp

    print(f"{args.ranks} ranks, mixes {', '.join(args.mixes)}, {args.steps} steps each ...", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pace-balance-check-") as tmp:
        mp.start_processes(
            _worker, args=(args.ranks, args, f"{tmp}/store", tmp), nprocs=args.ranks, start_method="spawn"
        )
        rows = [read_mix(Path(tmp, mix), mix) for mix in args.mixes]
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)
    meta = provenance(args)
    header = (
        f"{meta['date']}, {meta['machine']['cpus']} CPUs ({meta['machine']['platform']}), gloo, "
        f"{args.ranks} ranks, {args.batch} samples per rank, padded, windows of {args.window} steps, "
        f"{args.check_rounds} rounds; the arms' medians are the check's own. Command: `{meta['command']}`"
    )
    write_results(
        args.out, args.markdown, markdown(rows, header), {"benchmark": "balance_check", **meta, "rows": rows}
    )
    return 0 if all(r["verdict"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
