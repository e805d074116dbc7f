"""The tags reach a Lightning or Fabric run's own loggers from the telemetry thread while the training
thread uses the same loggers: each logger that is not TensorBoard's is serialized by a lock."""

from __future__ import annotations

import csv
import threading
import time

import pytest

from pace_strategy.integrations.loggers import LOCKED_METHODS, loggers_sink

pytestmark = pytest.mark.timeout(60)


class Overlapping:
    """A logger that notes when two threads are inside it at once."""

    def __init__(self) -> None:
        self.inside = 0
        self.overlaps = 0
        self.rows: list[tuple[int, dict]] = []

    def _enter(self) -> None:
        self.inside += 1
        self.overlaps += self.inside > 1
        time.sleep(0.0005)  # long enough for the other thread to come in
        self.inside -= 1

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self._enter()
        self.rows.append((step or 0, dict(metrics)))

    def save(self) -> None:
        self._enter()


def _both_threads(logger, sink, steps: int = 150) -> None:
    def training() -> None:
        for step in range(steps):
            logger.log_metrics({"loss": float(step)}, step=step)
            logger.save()

    def telemetry() -> None:
        for step in range(steps):
            sink({"pace/skew_ms": float(step)}, step)

    threads = [threading.Thread(target=training), threading.Thread(target=telemetry)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_the_training_and_telemetry_threads_never_run_inside_one_logger_at_once():
    logger = Overlapping()
    sink, unlock = loggers_sink([logger])
    assert sink is not None
    _both_threads(logger, sink)
    assert logger.overlaps == 0 and len(logger.rows) == 300
    unlock()
    assert not any(name in vars(logger) for name in LOCKED_METHODS), "the instance's methods are back"
    # and the same threads without the lock do meet inside it (what the lock prevents)
    bare = Overlapping()
    _both_threads(bare, lambda metrics, step: bare.log_metrics(dict(metrics), step=step))
    assert bare.overlaps > 0


def test_lightning_s_csv_logger_keeps_every_row_of_both_threads(tmp_path):
    loggers = pytest.importorskip("lightning.pytorch.loggers")
    logger = loggers.CSVLogger(tmp_path, name="run", version=0)
    sink, unlock = loggers_sink([logger])
    assert sink is not None
    _both_threads(logger, sink, steps=300)
    logger.save()
    unlock()
    with open(tmp_path / "run" / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["step"]) for r in rows if r.get("pace/skew_ms")) == list(range(300))
    assert sorted(float(r["loss"]) for r in rows if r.get("loss")) == [float(s) for s in range(300)]


def test_tensorboard_s_loggers_are_left_unlocked(tmp_path):
    loggers = pytest.importorskip("lightning.pytorch.loggers")
    pytest.importorskip("tensorboard")
    logger = loggers.TensorBoardLogger(tmp_path)
    sink, unlock = loggers_sink([logger])
    assert sink is not None and not any(name in vars(logger) for name in LOCKED_METHODS)
    unlock()
    assert loggers_sink([])[0] is None
