"""Lightning's ``paced_fsdp`` on a 2 x 2 mesh: ``python lightning_tp_job.py OUT [tp|hsdp]``, 4 CPU
processes (Lightning's launcher).

``tp`` (the default): FSDP over ``data_parallel``, tensor parallelism over ``tensor_parallel``: the
LightningModule's ``configure_model`` applies ``pace_strategy.testing.meshes``' tensor-parallel plan to its
network (the projections column- and row-wise) and shards it over the data-parallel dimension, as
Lightning's own tensor-parallel examples do. ``hsdp``: ``configure_model`` builds a mesh of its own,
2 replicas x 2 shards (``dp_replicate`` x ``dp_shard``), and shards the network over it (HSDP).
Rank 1 spends SLOW_MS more in every backward. The run record goes to OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pace_strategy.integrations.lightning import PacedFSDPStrategy
from pace_strategy.testing.meshes import MeshNet, shard, shard_tensor_parallel

STEPS, BATCH, SLOW_MS = 24, 8, 30.0


class Module(L.LightningModule):
    def __init__(self, layout: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = MeshNet()
        self.layout = layout

    def configure_model(self) -> None:
        if self.layout == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh

            hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            shard(self.net, hsdp)
            return
        mesh = self.device_mesh
        assert mesh is not None  # set by ModelParallelStrategy before configure_model
        shard_tensor_parallel(self.net, mesh["tensor_parallel"], mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_rank == 1:
            self.net.point.arm(0.0, SLOW_MS)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out: Path, layout: str) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(STEPS * BATCH, 16, generator=g), torch.randn(STEPS * BATCH, 1, generator=g)
    )
    pacing = {"exchange_every_steps": 4, "mode": "monitor"}
    tp = 2 if layout == "tp" else 1
    strategy = PacedFSDPStrategy(
        data_parallel_size=4 // tp, tensor_parallel_size=tp, pacing=pacing, run_dir=out
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(layout), DataLoader(data, batch_size=BATCH))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "tp")
