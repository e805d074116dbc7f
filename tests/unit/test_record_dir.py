"""Where the run record goes under Lightning and Fabric, with real Trainers, Fabrics and loggers: the
logger's directory; a new ``./pace_runs/<date-time>`` (said once, with the path) for a logger that
keeps none, as W&B's and MLflow's do, so that ``pace diagnose`` has a record for their users too;
none with ``logger=False``."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, Logger

from pace_strategy.core.config import PacingConfig
from pace_strategy.integrations._lightning_pacing import _record_dir
from pace_strategy.integrations.fabric import FabricPacing


class NoDirLogger(Logger):
    """A logger as W&B's and MLflow's are to Lightning: metrics sent elsewhere, no ``log_dir``."""

    name = "elsewhere"
    version = "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PACE_RUN_DIR", raising=False)
    return tmp_path


def trainer(logger: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, logger=logger, enable_progress_bar=False)


def test_a_logger_with_a_directory_gets_the_record_there(in_tmp):
    csv = CSVLogger(in_tmp / "csv")
    assert _record_dir(trainer(csv), None) == in_tmp / "csv" / "lightning_logs" / "version_0"


def test_a_logger_without_a_directory_gets_a_new_one_under_pace_runs_said_once(in_tmp, caplog):
    with caplog.at_level(logging.WARNING, logger="pace_strategy"):
        found = _record_dir(trainer(NoDirLogger()), None)
    assert found is not None and found.parent == in_tmp / "pace_runs"
    said = [r.getMessage() for r in caplog.records if "keeps no log directory" in r.getMessage()]
    assert said == [f"pace_strategy: NoDirLogger keeps no log directory; the run record goes to {found} "
                    "(run_dir= or $PACE_RUN_DIR choose another)"]  # fmt: skip


def test_the_environment_and_the_argument_beat_the_fallback(in_tmp, monkeypatch):
    monkeypatch.setenv("PACE_RUN_DIR", str(in_tmp / "env"))
    assert _record_dir(trainer(NoDirLogger()), None) == in_tmp / "env"
    assert _record_dir(trainer(NoDirLogger()), in_tmp / "arg") == in_tmp / "arg"


def test_without_a_logger_no_record(in_tmp):
    assert _record_dir(trainer(False), None) is None


def test_fabric_takes_the_same_order(in_tmp):
    pacing = FabricPacing(PacingConfig(), run_dir=None)
    fallback = pacing._record_dir(Fabric(accelerator="cpu", devices=1, loggers=[NoDirLogger()]))
    assert fallback is not None and fallback.parent == in_tmp / "pace_runs"
    assert pacing._record_dir(Fabric(accelerator="cpu", devices=1)) is None
    csv = CSVLogger(in_tmp / "csv")
    assert (
        pacing._record_dir(Fabric(accelerator="cpu", devices=1, loggers=[csv]))
        == in_tmp / "csv" / "lightning_logs" / "version_0"
    )
