"""Cost-balanced batches on real compute: a tiny transformer (real attention) on sequences of
long-tailed lengths, trained data-parallel over CPU processes (gloo), arm beside arm in the same
processes, as samples/s ratios to plain.

Not a test: it prints what it measured. Every arm trains its own copy of the same initial model on
the same number of steps of global batches of ``--batch`` x ranks samples, lengths log-normal
(``--mu``, ``--sigma``) clipped to 16-512 tokens:

- ``plain``: each global batch cut into even contiguous slices (what a ``DistributedSampler`` does);
- ``grouped``: length-grouped sampling, the simple alternative a user can apply (the HF Trainer's
  ``group_by_length``: megabatches of 50 global batches sorted by length), which changes which
  samples share a global batch, then even slices;
- ``balanced``: pace_strategy's cost-balanced batches through the product's path
  (``pace_strategy.attach(..., pacing={"balance": ...})`` and ``pace.dataloader``): the same global
  batches as ``plain``, split by predicted cost, the gradient scaled to the global batch's mean;
- ``grouped+balanced``: both;
- ``configured`` (with ``--arms``): balanced at the configured cost (``--quadratic-tokens``,
  ``--per-sample``; by default the product's defaults) instead of the calibrated one;
- ``online`` (with ``--arms``): the same start, with the cost fitted online by the product
  (``balance.fit``) from the ranks' measured compute, windows of 8 steps; the cost it fitted is read
  back from its run record.

Two layouts (``--layouts``): ``padded`` (a rank's batch padded to its longest sample, one forward
with a key padding mask) and ``packed`` (each sample attended on its own, one forward per sample:
what variable-length attention kernels do, here on CPU). Arms take turns in rounds (``--rounds``
of ``--steps`` steps each, in rotating order) so that drift in the machine's speed falls on all.

Also measured, per layout: the **attainable bound**, the plain arm's batches computed by each rank
without synchronization: the step time if every step's work were spread evenly (the mean rank's
compute) against what the slowest rank takes (the max), ``sum(max) / sum(mean)``; and the
**convergence check**, the global batch's mean loss of ``plain`` and ``balanced`` at every step
(the same samples) and the largest weight difference between them at the end (summation order
only: the loss scale makes the update the global batch's mean).

    python benchmarks/balance.py                   # ~2-4 minutes on 2 cores
    python benchmarks/balance.py --steps 6 --rounds 1 --layouts padded   # a smoke run
    python benchmarks/balance.py --arms plain balanced configured online   # the online fit
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import provenance, write_results

ARMS = ("plain", "grouped", "balanced", "grouped+balanced")
#: every arm ``--arms`` may name
ALL_ARMS = (*ARMS, "configured", "online")
VOCAB, WIDTH, MEGABATCH = 256, 64, 50


def lengths_of(n: int, mu: float, sigma: float, seed: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mu, sigma, n), 16, 512).astype(int).tolist()


class Tokens:
    """A map-style dataset of token sequences of the given lengths (a ``lengths`` attribute, as a
    tokenized corpus has, and ``input_ids`` per sample)."""

    def __init__(self, lengths: list[int], seed: int) -> None:
        import torch

        self.lengths = lengths
        g = torch.Generator().manual_seed(seed)
        self.ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i]}


def grouped_order(lengths: list[int], global_batch: int, seed: int) -> list[int]:
    """Length-grouped sampling (as ``transformers``' ``LengthGroupedSampler``): a seeded permutation
    cut into megabatches of ``MEGABATCH`` global batches, each sorted by length, longest first."""
    import torch

    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    size = MEGABATCH * global_batch
    mega = [order[i : i + size] for i in range(0, len(order), size)]
    return [i for m in mega for i in sorted(m, key=lambda i: -lengths[i])]


def collate(samples: list[dict[str, Any]]) -> list[Any]:
    return [s["input_ids"] for s in samples]


def build_model() -> Any:
    import torch
    from torch import nn

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            layer = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, ids: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
            return self.head(self.encoder(self.embed(ids), src_key_padding_mask=pad))

    torch.manual_seed(0)
    return LM()


def sample_losses(model: Any, batch: list[Any], layout: str) -> Any:
    """Each sample's mean token loss (reconstructing its tokens), ``[n]``."""
    import torch
    from torch.nn import functional as F

    if layout == "packed":
        return torch.stack([F.cross_entropy(model(ids[None])[0], ids) for ids in batch])
    longest = max(len(ids) for ids in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    pad = torch.ones(len(batch), longest, dtype=torch.bool)
    for i, s in enumerate(batch):
        ids[i, : len(s)], pad[i, : len(s)] = s, False
    logits = model(ids, pad)
    token = F.cross_entropy(logits.transpose(1, 2), ids, reduction="none").masked_fill(pad, 0.0)
    return token.sum(1) / (~pad).sum(1)


def calibrate(model: Any, layout: str) -> tuple[list[int], list[float]]:
    """Single samples timed (forward and backward, the best of 5) at lengths from 16 to 512."""
    import torch

    lengths, times = [16, 32, 64, 128, 256, 384, 512], []
    for n in lengths:
        ids = [torch.randint(0, VOCAB, (n,))]
        best = math.inf
        for _ in range(7):
            start = time.perf_counter()
            sample_losses(model, ids, layout).mean().backward()
            best = min(best, time.perf_counter() - start)
        times.append(best * 1e3)
    return lengths, times


def _worker(rank: int, ranks: int, args: argparse.Namespace, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.utils.data import Subset

    from pace_strategy.data.balance import fit_cost
    from pace_strategy.shutdown import leave_without_finalization

    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, ranks), rank=rank, world_size=ranks, timeout=timeout
    )
    global_batch = args.batch * ranks
    total = args.steps * (args.rounds + 1) + args.skip  # the bound reads one more arm's worth
    lengths = lengths_of(global_batch * total, args.mu, args.sigma, seed=1)
    data = Tokens(lengths, seed=2)
    sources = {"data": data, "grouped": Subset(data, grouped_order(lengths, global_batch, seed=3))}
    base = build_model()
    result: dict[str, Any] = {}
    for layout in args.layouts:
        # the cost model: fitted on rank 0's single-sample times, the same coefficients on every rank
        cost = {"quadratic_tokens": args.quadratic_tokens, "per_sample": args.per_sample}
        if args.calibrate:
            fitted = fit_cost(*calibrate(copy.deepcopy(base), layout))
            shared = torch.tensor([fitted.quadratic_tokens, fitted.per_sample], dtype=torch.float64)
            dist.broadcast(shared, 0)
            cost = {"quadratic_tokens": float(shared[0]), "per_sample": float(shared[1])}
        result[layout] = {"cost": cost, **_layout(layout, cost, rank, ranks, args, sources, base, out)}
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    leave_without_finalization(0)  # torch's gloo shutdown abort (docs/hazards.md)


def _layout(
    layout: str,
    cost: dict[str, float],
    rank: int,
    ranks: int,
    args: argparse.Namespace,
    sources: dict,
    base: Any,
    out: str,
) -> dict[str, Any]:
    """Every arm of one layout, in rounds; what was measured."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    import pace_strategy
    from pace_strategy.core.shares import ShareSchedule
    from pace_strategy.data.share_sampler import ShareBatchSampler

    global_batch = args.batch * ranks
    arms = tuple(args.arms)
    models = {arm: DDP(copy.deepcopy(base)) for arm in arms}
    opts = {arm: torch.optim.SGD(m.parameters(), lr=0.05) for arm, m in models.items()}
    paces, batches = {}, {}
    for arm in arms:
        source = sources["grouped" if arm.startswith("grouped") else "data"]
        shuffle = source is sources["data"]
        if arm != "plain" and arm != "grouped":
            # balanced at every step (the arms take turns here; the A/B check would too)
            balance = {"enabled": True, "layout": layout, "verify": False, "fit": arm == "online"}
            if arm == "configured" or arm == "online":
                balance.update(quadratic_tokens=args.quadratic_tokens, per_sample=args.per_sample)
            else:
                balance.update(cost)
            # the data path only (no window exchanged during the run), or windows for the fit
            every = 8 if arm == "online" else 10**6
            pacing = {"mode": "monitor", "exchange_every_steps": every, "warmup_steps": 1, "balance": balance}
            paces[arm] = pace_strategy.attach(
                models[arm], pacing=pacing, run_dir=Path(out, f"{layout}-{arm}")
            )
            loader = DataLoader(
                source, batch_size=args.batch, shuffle=shuffle, collate_fn=collate, drop_last=True
            )
            batches[arm] = iter(paces[arm].dataloader(loader))
        else:  # the same global batches as the balanced arm of the same order, even slices
            schedule = ShareSchedule(global_batch, ranks)
            sampler = ShareBatchSampler(source, schedule, rank, shuffle=shuffle, seed=0, drop_last=True)
            batches[arm] = iter(DataLoader(source, batch_sampler=sampler, collate_fn=collate))
    seconds = {arm: 0.0 for arm in arms}
    losses: dict[str, list[float]] = {arm: [] for arm in arms}
    counts: dict[str, list[int]] = {arm: [] for arm in arms}

    def step(arm: str) -> None:
        batch = next(batches[arm])
        pace = paces.get(arm)
        if pace is not None:
            pace.begin_step()  # the batch is in hand: its share factor is taken
        per_sample = sample_losses(models[arm], batch, layout)
        opts[arm].zero_grad(set_to_none=True)
        per_sample.mean().backward()
        opts[arm].step()
        if pace is not None:
            pace.end_step()
        losses[arm].append(float(per_sample.detach().sum()))
        counts[arm].append(len(batch))

    for arm in arms:  # warm-up: every arm's first steps (allocator, DDP's bucket rebuild)
        for _ in range(args.skip):
            step(arm)
    for r in range(args.rounds):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(arm)
            dist.barrier()
            seconds[arm] += time.perf_counter() - start
    for pace in paces.values():
        pace.finish()
    # the bound: the plain arm's next batches, each rank on its own (no synchronization)
    local = copy.deepcopy(base)
    compute = []
    for _ in range(args.steps):
        batch = next(batches["plain"])
        start = time.perf_counter()
        sample_losses(local, batch, layout).mean().backward()
        compute.append(time.perf_counter() - start)
    # each step's global mean loss (every rank's sum of sample losses over every rank's count)
    sums = torch.tensor([losses[a] for a in arms], dtype=torch.float64)
    ns = torch.tensor([counts[a] for a in arms], dtype=torch.float64)
    times = torch.tensor(compute, dtype=torch.float64)
    gathered = [torch.zeros_like(times) for _ in range(ranks)]
    dist.all_reduce(sums)
    dist.all_reduce(ns)
    dist.all_gather(gathered, times)
    weights = max(
        (a - b).abs().max().item()
        for a, b in zip(models["plain"].parameters(), models["balanced"].parameters(), strict=True)
    )
    per_rank = torch.stack(gathered)  # [ranks, steps]
    return {
        "seconds": seconds,
        "global_loss": {a: (sums[i] / ns[i]).tolist() for i, a in enumerate(arms)},
        "bound": float(per_rank.max(0).values.sum() / per_rank.mean(0).sum()),
        "rank0_counts": {a: counts[a] for a in arms},  # samples per step (the balanced arms vary)
        "max_weight_difference": weights,
        "online_cost": _fitted(Path(out, f"{layout}-online")) if "online" in arms and rank == 0 else None,
    }


def _fitted(run_dir: Path) -> list[float] | None:
    """The last cost the online fit scheduled, ``[quadratic_tokens, per_sample]``, from the record."""
    from pace_strategy.diagnose.rebalance import fitted_cost
    from pace_strategy.telemetry.run_record import read_run_record

    return fitted_cost(read_run_record(run_dir).shares)


def summarize(raw: dict[str, Any], args: argparse.Namespace, ranks: int) -> list[dict[str, Any]]:
    rows = []
    global_samples = args.steps * args.rounds * args.batch * ranks
    arms = tuple(args.arms)
    for layout, r in raw.items():
        rate = {a: global_samples / r["seconds"][a] for a in arms}
        plain_loss, balanced_loss = r["global_loss"]["plain"], r["global_loss"]["balanced"]
        loss_gap = max(abs(a - b) / abs(a) for a, b in zip(plain_loss, balanced_loss, strict=True))
        rows.append(
            {
                "layout": layout,
                "samples_per_s": rate,
                "ratio": {a: rate[a] / rate["plain"] for a in arms},
                "bound": r["bound"],
                "max_relative_loss_gap": loss_gap,
                "max_weight_difference": r["max_weight_difference"],
                "loss_first_last": {a: (r["global_loss"][a][0], r["global_loss"][a][-1]) for a in arms},
                "rank0_counts": r["rank0_counts"],
                "cost": r["cost"],
                "online_cost": r.get("online_cost"),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    arms = [a for a in rows[0]["ratio"] if a != "plain"] if rows else []
    lines = [
        header,
        "",
        f"| layout | plain | {' | '.join(arms)} | bound (even work) | balanced / bound |",
        "|---|---|" + "---|" * len(arms) + "---|---|",
    ]
    for r in rows:
        q = r["ratio"]
        lines.append(
            f"| {r['layout']} | 1.00 ({r['samples_per_s']['plain']:.0f} samples/s) | "
            + "".join(f"{q[a]:.3f} | " for a in arms)
            + f"{r['bound']:.3f} | {q['balanced'] / r['bound']:.2f} |"
        )
    lines.append("")
    for r in rows:
        lines.append(
            f"- {r['layout']}: plain vs balanced on the same global batches: the global mean loss differs "
            f"by at most {r['max_relative_loss_gap']:.1e} (relative) at any step, the weights by "
            f"{r['max_weight_difference']:.1e} at the end; the cost model: per_sample "
            f"{r['cost']['per_sample']:.0f}, quadratic_tokens {r['cost']['quadratic_tokens']:.0f}"
            + (
                f"; the online arm fitted, from the configured start: per_sample "
                f"{r['online_cost'][1]:g}, quadratic_tokens {r['online_cost'][0]:g}."
                if r.get("online_cost")
                else "."
            )
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="CPU processes (gloo); default 2")
    p.add_argument("--batch", type=int, default=16, help="samples per rank at even shares; default 16")
    p.add_argument("--steps", type=int, default=20, help="steps per arm per round; default 20")
    p.add_argument("--rounds", type=int, default=4, help="rounds (arms in turns); default 4")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps of each arm; default 3")
    p.add_argument("--mu", type=float, default=4.5, help="log-normal lengths: mean of the log; default 4.5")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal lengths: sd of the log; default 0.8")
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="use --quadratic-tokens and --per-sample instead of fitting them (fit_cost) first",
    )
    p.add_argument("--quadratic-tokens", type=float, default=1024.0, help="balance.quadratic_tokens")
    p.add_argument("--per-sample", type=float, default=0.0, help="balance.per_sample")
    p.add_argument("--layouts", nargs="+", default=["padded", "packed"], choices=["padded", "packed"])
    p.add_argument(
        "--arms", nargs="+", default=list(ARMS), choices=ALL_ARMS, help="arms (plain and balanced always)"
    )
    p.add_argument("--out", default="benchmarks/results/balance.json")
    p.add_argument("--markdown", default="benchmarks/results/balance.md")
    args = p.parse_args()
    args.arms = ["plain", "balanced"] + [a for a in args.arms if a not in ("plain", "balanced")]
    import torch.multiprocessing as mp

    print(
        f"{args.ranks} ranks, {len(args.arms)} arms x {args.rounds} rounds x {args.steps} steps ...",
        flush=True,
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pace-balance-") as tmp:
        mp.start_processes(
            _worker, args=(args.ranks, args, f"{tmp}/store", tmp), nprocs=args.ranks, start_method="spawn"
        )
        raw = json.loads(Path(tmp, "result.json").read_text())
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)
    rows = summarize(raw, args, args.ranks)
    meta = provenance(args)
    header = (
        f"{meta['date']}, {meta['machine']['cpus']} CPUs ({meta['machine']['platform']}), gloo, "
        f"{args.ranks} ranks, {args.batch} samples per rank, lengths log-normal({args.mu}, {args.sigma}) "
        f"in 16-512, {args.rounds} rounds x {args.steps} steps per arm; samples/s as ratios to plain "
        f"(same run). Command: `{meta['command']}`"
    )
    write_results(
        args.out, args.markdown, markdown(rows, header), {"benchmark": "balance", **meta, "rows": rows}
    )
    return 0 if all(math.isfinite(r["bound"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
