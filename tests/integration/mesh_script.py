"""Device meshes in a plain PyTorch loop paced with ``pace_strategy.attach``, for test_meshes.py,
under torchrun (4 CPU processes, gloo, one launch for every run below).

    torchrun --nproc_per_node 4 mesh_script.py OUT_DIR

Two layouts of the same model, each trained twice in the same processes from the same initial
weights on the same batches (``plain``: without pace_strategy; ``paced``: attached with forced
pacing, every step delayed where the pacer predicts a lead, the run record in OUT_DIR/LAYOUT/record,
the tags in OUT_DIR/LAYOUT/tb, grouped: 4 ranks are above the run's ``per_rank_tag_limit`` of 2):

- ``hsdp``: FSDP2 over a 2-D mesh, 2 replicas x 2 shards (``dp_replicate`` x ``dp_shard``); rank 1
  spends 30 ms more than the others in every backward (an InjectionPoint after the first layer: the
  end of its local backward).
- ``tp``: tensor parallelism inside a 2-rank group (the MLP's up projection column-wise, its down
  projection row-wise) and FSDP2 over the other dimension (``dp_shard`` x ``tp``); rank 1 spends
  30 ms more in every forward, before the tensor-parallel all-reduce, so its group peer rank 0 waits
  for it there, inside its own compute.

Rank 0 writes each run's full weights to OUT_DIR/LAYOUT/{plain,paced}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import pace_strategy
from pace_strategy.shutdown import exit_without_finalization
from pace_strategy.testing.meshes import LAYOUTS, MeshNet, build_on_mesh

STEPS, BATCH, SLOW_MS = 24, 8, 30.0
PACING = {
    "mode": "forced",
    "exchange_every_steps": 4,
    "warmup_steps": 2,
    "max_delay_step_fraction": 0.5,
    # 4 ranks above the limit: the tags group them, by replica (hsdp) or tensor-parallel group (tp)
    "per_rank_tag_limit": 2,
}


def train(net: MeshNet, layout: str, rank: int, batches: list, pace=None) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for x, y in batches:
        if pace is not None:
            pace.begin_step()
            if rank == 1:
                net.point.arm(SLOW_MS, 0.0) if layout == "tp" else net.point.arm(0.0, SLOW_MS)
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if pace is not None:
            pace.end_step(samples=len(x))


def full_weights(net: MeshNet) -> dict[str, torch.Tensor]:
    return {name: p.detach().full_tensor().clone() for name, p in net.named_parameters()}


def run(out: Path, layout: str, rank: int, world: int) -> None:
    names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)
    # each data-parallel rank its own batch (HSDP: every rank; a tensor-parallel group shares one)
    dp = rank if layout == "hsdp" else mesh.get_local_rank("dp_shard")
    data = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, world, BATCH, 16, generator=data)
    ys = torch.randn(STEPS, world, BATCH, 1, generator=data)
    batches = [(xs[s, dp], ys[s, dp]) for s in range(STEPS)]

    plain = build_on_mesh(layout, mesh)
    train(plain, layout, rank, batches)
    plain_weights = full_weights(plain)

    paced = build_on_mesh(layout, mesh)
    record = out / layout / "record"
    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out / layout / "tb"))
    with pace_strategy.attach(paced, pacing=PACING, run_dir=record, mesh=mesh, writer=writer) as pace:
        train(paced, layout, rank, batches, pace)
    if writer is not None:
        writer.close()
    paced_weights = full_weights(paced)
    if rank == 0:
        torch.save(plain_weights, out / layout / "plain.pt")
        torch.save(paced_weights, out / layout / "paced.pt")


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for layout in LAYOUTS:
        (out / layout).mkdir(exist_ok=True)
        run(out, layout, rank, world)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
    exit_without_finalization(0)  # torch's gloo shutdown abort: docs/hazards.md
