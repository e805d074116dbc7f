"""A 2-process Lightning job (the default subprocess launcher: rank 0 is the parent of rank 1) with
``hang.timeout_s`` 3 s, for test_hang_ends.py. Each rank writes ``OUT/reached{rank}`` (its pid) at step
6 and trains on for minutes; the test SIGSTOPs rank 1.

    python hang_lightning_job.py OUT
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from pace_strategy.integrations.lightning import PacedDDPStrategy


class Module(pl.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        time.sleep(0.01)  # stands in for compute: keeps the 2 cores free for the other rank
        if index == 6:
            # whole or not there: the test reads the pid as soon as the marker exists
            marker = self.out / f"reached{self.global_rank}"
            marker.with_suffix(".tmp").write_text(str(os.getpid()))
            os.replace(marker.with_suffix(".tmp"), marker)
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    trainer = pl.Trainer(
        strategy=PacedDDPStrategy(pacing={"mode": "monitor", "hang": {"timeout_s": 3.0, "action": "abort"}}),
        accelerator="cpu",
        devices=2,
        max_steps=100_000,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=out,
    )
    data = torch.randn(100_000, 8)
    trainer.fit(Module(out), DataLoader(data, batch_size=4))  # type: ignore[arg-type]


if __name__ == "__main__":
    main(Path(sys.argv[1]))
