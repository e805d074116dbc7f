"""Run by test_artifacts.py: the same tiny Lightning jobs under a stock strategy and its paced twin,
each in a fresh directory that is the current directory (so that Lightning's defaults apply), and what
a user sees of them besides files: return values, Python warnings, WARNING log records, exceptions.

    python artifacts_jobs.py PHASE BASE_DIR OUT_DIR

PHASE ``single``: ``ddp_spawn`` (2 processes, spawned per job), then one-process jobs; ``popen``: 2
processes through Lightning's popen launcher (the children re-run this script and every job). Job
``J`` variant ``V`` runs in ``BASE_DIR/J/V``; each process writes ``OUT_DIR/PHASE-rank_R.json``,
``{job: {variant: {"returns", "warnings", "logs", "error", "seconds"}}}``. The test compares the file
trees, checkpoints and logged metrics itself.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from pace_strategy.integrations.lightning import PacedDDPStrategy
from pace_strategy.shutdown import leave_without_finalization

#: steps of every fit: 2 epochs with 2 processes, 1 with one
MAX_STEPS = 4


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        return self.net(batch).square().mean()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader[torch.Tensor]:
    data = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    return DataLoader(data, batch_size=4)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Variant:
    strategy: Callable[[Path], Any]  #: the job directory -> Trainer(strategy=...)
    env: dict[str, str] = field(default_factory=dict)  #: relative to the job directory


def paced(spawn: bool = False, run_dir: str | None = None) -> Callable[[Path], Any]:
    def build(here: Path) -> Any:
        return PacedDDPStrategy(
            start_method="spawn" if spawn else "popen",
            run_dir=None if run_dir is None else here / run_dir,
        )

    return build


def name(strategy: str) -> Callable[[Path], Any]:
    return lambda here: strategy


@dataclass(frozen=True)
class Job:
    trainer: dict[str, Any]
    variants: dict[str, Variant]
    then: tuple[str, ...] = ()  #: trainer entry points after fit: validate, test, predict


DDP = {"ddp": Variant(name("ddp")), "paced_ddp": Variant(name("paced_ddp"))}
#: paced-only variants that ask for a record explicitly
EXPLICIT = {
    "paced_run_dir": Variant(paced(run_dir="asked")),
    "paced_env": Variant(name("paced_ddp"), env={"PACE_RUN_DIR": "from_env"}),
    "paced_run_dir_and_env": Variant(paced(run_dir="asked"), env={"PACE_RUN_DIR": "from_env"}),
}

PHASES: dict[str, dict[str, Job]] = {
    "single": {
        # First: a one-process ddp job leaves its process group (and its port) open in this
        # process, and later spawned processes would inherit its MASTER_PORT.
        "spawn": Job(
            {"devices": 2},
            {"ddp_spawn": Variant(name("ddp_spawn")), "paced_ddp_spawn": Variant(paced(spawn=True))},
        ),
        "one_logger": Job(
            {"devices": 1},
            {**DDP, "paced_run_dir": EXPLICIT["paced_run_dir"]},
            then=("validate", "test", "predict"),
        ),
        "one_no_logger": Job({"devices": 1, "logger": False}, {**DDP, "paced_env": EXPLICIT["paced_env"]}),
        "one_fast_dev_run": Job({"devices": 1, "fast_dev_run": True}, DDP),
    },
    "popen": {
        "logger": Job(
            {"devices": 2}, {**DDP, "paced_env": EXPLICIT["paced_env"]}, then=("validate", "test", "predict")
        ),
        "no_logger": Job({"devices": 2, "logger": False}, {**DDP, **EXPLICIT}, then=("validate",)),
        "fast_dev_run": Job(
            {"devices": 2, "fast_dev_run": True},
            {**DDP, "paced_run_dir": EXPLICIT["paced_run_dir"]},
            then=("test",),
        ),
        "csv_no_checkpoints": Job({"devices": 2, "logger": "csv", "enable_checkpointing": False}, DDP),
    },
}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.levelname}: {record.getMessage()}")


def _plain(value: Any) -> Any:
    """Return values as JSON: tensors as lists, exactly (floats round-trip through JSON)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def run(job: Job, variant: Variant, here: Path) -> dict[str, Any]:
    here.mkdir(parents=True, exist_ok=True)
    os.chdir(here)
    env = {k: str(here / v) for k, v in variant.env.items()}
    os.environ.update(env)
    kwargs = dict(job.trainer)
    if kwargs.get("logger") == "csv":
        kwargs["logger"] = pl.loggers.CSVLogger(".")
    records = _Records()
    watched = [
        logging.getLogger(),
        logging.getLogger("lightning.pytorch"),
        logging.getLogger("lightning.fabric"),
    ]
    for logger in watched:
        logger.addHandler(records)
    result: dict[str, Any] = {"returns": {}, "error": None}
    started = time.perf_counter()
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the same for both variants, whichever runs first
            trainer = pl.Trainer(
                strategy=variant.strategy(here),
                accelerator="cpu",
                max_steps=MAX_STEPS,
                log_every_n_steps=1,
                enable_progress_bar=False,
                enable_model_summary=False,
                **kwargs,
            )
            module = TinyModule()
            try:
                result["returns"]["fit"] = _plain(trainer.fit(module, loader(), loader()))
                for entry in job.then:
                    result["returns"][entry] = _plain(getattr(trainer, entry)(module, loader()))
            except Exception as error:  # compared between the variants, like the rest
                result["error"] = f"{type(error).__name__}: {error}"
    finally:
        for logger in watched:
            logger.removeHandler(records)
        for k in env:
            del os.environ[k]
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    result["logs"] = records.messages
    result["seconds"] = round(time.perf_counter() - started, 2)  # not compared
    return result


def main(phase: str, base: Path, out: Path) -> None:
    torch.set_num_threads(1)
    results = {
        job_name: {v: run(job, variant, base / job_name / v) for v, variant in job.variants.items()}
        for job_name, job in PHASES[phase].items()
    }
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by the popen launcher in both processes
    (out / f"{phase}-rank_{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]).resolve(), Path(sys.argv[3]).resolve())
    leave_without_finalization(0)  # torch's gloo shutdown abort: docs/hazards.md
