"""A ``torch.compile``d DDP model paced with ``pace_strategy.attach`` (2 CPU ranks under torchrun).

``python -m torch.distributed.run --nproc_per_node 2 compile_script.py OUT``: the same compiled model
and batches trained twice in the same processes, without pace_strategy (``plain``) and attached with
forced pacing (``paced``); rank 1 spends SLOW_MS more at the start of every backward (a hook on the
loss: outside the compiled graph, inside the rank's backward). Rank 0 saves both runs' weights, the
paced run writes its record under OUT/record.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pace_strategy
from pace_strategy.shutdown import exit_without_finalization

STEPS, BATCH, SLOW_MS = 24, 8, 40.0
PACING = {"mode": "forced", "exchange_every_steps": 4, "warmup_steps": 2, "max_delay_step_fraction": 0.5}


def build() -> tuple[DDP, nn.Module]:
    """The DDP model (the same initial weights every time) and its compiled form."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
    return model, torch.compile(model)


def train(compiled: nn.Module, model: DDP, rank: int, batches: list, pace=None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches:
        if pace is not None:
            pace.begin_step()
        loss = nn.functional.mse_loss(compiled(x), y)
        if rank == 1:
            loss.register_hook(lambda grad: (time.sleep(SLOW_MS / 1000), grad)[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if pace is not None:
            pace.end_step(samples=len(x))


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = torch.Generator().manual_seed(1 + rank)
    batches = [
        (torch.randn(BATCH, 16, generator=data), torch.randn(BATCH, 1, generator=data)) for _ in range(STEPS)
    ]
    plain, compiled = build()
    train(compiled, plain, rank, batches)
    paced, compiled = build()
    with pace_strategy.attach(paced, pacing=PACING, run_dir=out / "record") as pace:
        train(compiled, paced, rank, batches, pace)
    if rank == 0:
        for name, model in (("plain", plain), ("paced", paced)):
            torch.save(
                {k: v.detach().clone() for k, v in model.module.state_dict().items()}, out / f"{name}.pt"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
    exit_without_finalization(0)  # torch's gloo shutdown abort: docs/hazards.md
