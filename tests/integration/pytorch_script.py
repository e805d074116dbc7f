"""Plain PyTorch loops paced with ``pace_strategy.attach``, for test_pytorch.py, under torchrun (2 CPU
processes). Rank 1 spends 30 ms more than rank 0 in every backward (an InjectionPoint after the first
layer: the end of its local backward). Writes OUT_DIR/result_RANK.json.

    torchrun --nproc_per_node 2 pytorch_script.py OUT_DIR MODE

MODE ``ddp``: a DDP loop with a TensorBoard SummaryWriter, ``with attach(...)``, ``pace.dataloader``.
``fsdp``: an FSDP2 model (``fully_shard`` per block, then the root) trained the way torchtitan writes
its train step (forward, loss, backward, clip the gradient norm, step, zero_grad), no writer.
``noend``: the DDP loop without ``with`` or ``finish``: the script just ends. ``rebalance``: the DDP
loop with ``rebalance=True``; rank 1 is slow per sample instead (3 ms each, in backward), 32 steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import pace_strategy
from pace_strategy.shutdown import exit_without_finalization
from pace_strategy.testing.slow import InjectionPoint

STEPS, BATCH, SLOW_MS = 16, 8, 30.0
PACING = {"mode": "monitor", "exchange_every_steps": 4, "warmup_steps": 2}
REBALANCE = {**PACING, "rebalance": {"enabled": True, "quantum": 2, "persist_windows": 1}}
REBALANCE_STEPS, MS_PER_SAMPLE = 32, 3.0


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


def main(out: Path, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    steps = REBALANCE_STEPS if mode == "rebalance" else STEPS
    data = TensorDataset(torch.randn(steps * BATCH * 2, 16), torch.randn(steps * BATCH * 2, 1))
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))
    mesh = None
    if mode == "fsdp":  # sharded over a named mesh, which the record describes
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        model: nn.Module = fully_shard(net, mesh=mesh)
    else:
        model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = None
    if mode == "ddp" and rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out / "tb"))
    pacing = REBALANCE if mode == "rebalance" else PACING
    if mode == "ddp":  # rank 0 serves Prometheus metrics on the test's free port (the others ignore it)
        pacing = {**pacing, "metrics_port": int(os.environ["METRICS_PORT"])}
    # the DDP loop says each rank is a pipeline stage of its own (a schedule pace_strategy does not
    # see): slow rank 1 is then a slow stage
    stage = rank if mode == "ddp" else None
    pace = pace_strategy.attach(
        model, pacing=pacing, run_dir=out / "record", writer=writer, mesh=mesh, pipeline_stage=stage
    )
    batches = pace.dataloader(loader)
    if mode == "noend":  # and the forward under bf16 autocast, as mixed-precision loops run it
        dtype = train(model, optimizer, batches, pace, rank, clip=False, bf16=True)
        (out / f"result_{rank}.json").write_text(json.dumps({"steps": pace.steps, "output_dtype": dtype}))
        return  # no finish: the exit handler closes the record
    with pace:
        train(model, optimizer, batches, pace, rank, clip=mode == "fsdp", per_sample=mode == "rebalance")
        if mode == "ddp" and rank == 0:  # a real HTTP scrape while the session serves
            time.sleep(1.0)  # the telemetry thread publishes the last exchanged window
            url = f"http://127.0.0.1:{os.environ['METRICS_PORT']}/metrics"
            (out / "metrics.txt").write_text(urllib.request.urlopen(url, timeout=10).read().decode())
    summary = pace.summary()
    if writer is not None:
        writer.close()
    result = {
        "steps": summary.steps,
        "windows": summary.windows,
        "straggler_counts": list(summary.straggler_counts),
        "median_skew_ms": summary.median_skew_ms,
        "record": None if summary.record is None else str(summary.record),
        "text": str(summary),
        "loader": type(batches.batch_sampler).__name__,
        "weights": [
            p.detach().full_tensor().sum().item() if hasattr(p, "full_tensor") else p.sum().item()
            for p in model.parameters()
        ],
    }
    (out / f"result_{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def train(
    model: nn.Module,
    optimizer,
    batches,
    pace,
    rank: int,
    clip: bool,
    per_sample: bool = False,
    bf16: bool = False,
) -> str:
    """The loop; returns the dtype of the model's last output."""
    point = model.module.point if isinstance(model, DistributedDataParallel) else model.point
    output = torch.zeros(())
    for x, y in batches:
        pace.begin_step()
        if rank == 1:
            point.arm(0.0, MS_PER_SAMPLE * len(x) if per_sample else SLOW_MS)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            output = model(x)
        loss = nn.functional.mse_loss(output.float(), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        pace.end_step(samples=len(x))
    return str(output.dtype)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2])
    # what interpreter exit runs (noend: pace_strategy's exit handler closes the record), less its
    # finalization (torch's gloo shutdown abort: docs/hazards.md)
    exit_without_finalization(0)
