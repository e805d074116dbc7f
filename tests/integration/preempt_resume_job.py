"""Run by test_preempt_resume.py: a 2-process ``paced_ddp`` Lightning job (popen start, gloo, CPU) that
is either preempted or resumed.

    python preempt_resume_job.py PHASE ROOT [CKPT]

PHASE ``preempt``: trains until it is stopped (``max_steps`` far away), a checkpoint every
``CKPT_EVERY`` steps in ``ROOT/ckpt``; each rank writes its pid to ``ROOT/pids/rank_R`` so that the
test can send SIGTERM to every rank. PHASE ``resume``: ``trainer.fit(ckpt_path=CKPT)`` up to
``RESUME_STEPS``; each rank writes the pacing state it holds when training starts (after the
checkpoint was loaded) to ``ROOT/restored_rank_R.json``. Both phases log to ``ROOT/lightning_logs``
(Lightning's default), so the resumed run's record lands in the next ``version_N``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from pace_strategy.integrations.lightning import PacedDDPStrategy
from pace_strategy.shutdown import leave_without_finalization

#: a checkpoint every this many steps (file ``step=N.ckpt``)
CKPT_EVERY = 20
#: where the resumed run stops
RESUME_STEPS = 32
#: each training step sleeps this long (stands in for accelerator time; rank 1 more: a straggler)
COMPUTE_MS = {0: 10.0, 1: 25.0}
#: forced pacing: the controller state at the checkpoint is far from a fresh one (smoothed leads,
#: delays, streaks), so that a restore shows
PACING = {"mode": "forced", "exchange_every_steps": 4, "warmup_steps": 2, "max_delay_step_fraction": 0.5}


class SleepyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        time.sleep(COMPUTE_MS[self.global_rank] / 1e3)
        return self.net(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class WritePid(pl.Callback):
    def __init__(self, root: Path) -> None:
        self.root = root

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pids = self.root / "pids"
        pids.mkdir(parents=True, exist_ok=True)
        (pids / f"rank_{trainer.global_rank}").write_text(str(os.getpid()))


class DumpRestored(pl.Callback):
    def __init__(self, root: Path) -> None:
        self.root = root

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy: Any = trainer.strategy
        session = strategy.pacing_session
        state = None if session is None else session.state.state_dict(trainer.global_step)
        path = self.root / f"restored_rank_{trainer.global_rank}.json"
        path.write_text(json.dumps({"global_step": trainer.global_step, "state": state}))


def main(phase: str, root: Path, ckpt: str | None) -> None:
    torch.set_num_threads(1)
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(
            dirpath=root / "ckpt", filename="{step}", every_n_train_steps=CKPT_EVERY, save_top_k=-1
        )
    ]
    callbacks.append(WritePid(root) if phase == "preempt" else DumpRestored(root))
    trainer = pl.Trainer(
        strategy=PacedDDPStrategy(pacing=PACING),
        accelerator="cpu",
        devices=2,
        max_steps=100_000 if phase == "preempt" else RESUME_STEPS,
        max_epochs=-1,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=callbacks,
    )
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    trainer.fit(SleepyModule(), DataLoader(data, batch_size=4), ckpt_path=ckpt)  # type: ignore[arg-type]


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
    leave_without_finalization(0)  # torch's gloo shutdown abort: docs/hazards.md
