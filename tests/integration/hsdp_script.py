"""HSDP (FSDP2 over a 2-D mesh: 2 replicas x 2 shards) in a plain PyTorch loop paced with
``pace_strategy.attach``, for test_hsdp.py, under torchrun (4 CPU processes, gloo).

    torchrun --nproc_per_node 4 hsdp_script.py OUT_DIR

Two runs in the same processes, from the same initial weights on the same batches:

- ``plain``: HSDP without pace_strategy;
- ``paced``: the same, attached with forced pacing (every step delayed where the pacer predicts a
  lead), rank 1 spending 30 ms more than the others in every backward (an InjectionPoint after the
  first layer: the end of its local backward), the run record written to OUT_DIR/record.

Rank 0 writes both runs' full weights to OUT_DIR/{plain,paced}.pt; every rank writes
OUT_DIR/result_RANK.json (its summary).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import pace_strategy
from pace_strategy.shutdown import exit_without_finalization
from pace_strategy.testing.slow import InjectionPoint

STEPS, BATCH, SLOW_MS = 24, 8, 30.0
PACING = {
    "mode": "forced",
    "exchange_every_steps": 4,
    "warmup_steps": 2,
    "max_delay_step_fraction": 0.5,
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 64)
        self.point = InjectionPoint()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.point(self.first(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(mesh: DeviceMesh) -> Net:
    """The same initial weights on every rank and in both runs, sharded over the 2-D mesh (HSDP)."""
    torch.manual_seed(0)
    net = Net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def train(net: Net, rank: int, batches: list[tuple[torch.Tensor, torch.Tensor]], pace=None) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for x, y in batches:
        if pace is not None:
            pace.begin_step()
            if rank == 1:
                net.point.arm(0.0, SLOW_MS)
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if pace is not None:
            pace.end_step(samples=len(x))


def full_weights(net: Net) -> dict[str, torch.Tensor]:
    return {name: p.detach().full_tensor().clone() for name, p in net.named_parameters()}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    data = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, world, BATCH, 16, generator=data)
    ys = torch.randn(STEPS, world, BATCH, 1, generator=data)
    batches = [(xs[s, rank], ys[s, rank]) for s in range(STEPS)]  # each rank its own slice

    plain = build(mesh)
    train(plain, rank, batches)
    plain_weights = full_weights(plain)

    paced = build(mesh)
    with pace_strategy.attach(paced, pacing=PACING, run_dir=out / "record", mesh=mesh) as pace:
        train(paced, rank, batches, pace)
    paced_weights = full_weights(paced)
    if rank == 0:
        torch.save(plain_weights, out / "plain.pt")
        torch.save(paced_weights, out / "paced.pt")
    summary = pace.summary()
    result = {
        "steps": summary.steps,
        "straggler_counts": list(summary.straggler_counts),
        "median_skew_ms": summary.median_skew_ms,
        "record": None if summary.record is None else str(summary.record),
    }
    (out / f"result_{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
    exit_without_finalization(0)  # torch's gloo shutdown abort: docs/hazards.md
