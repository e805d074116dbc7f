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


def _events(log_dir):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [
        e
        for path in sorted(log_dir.rglob("events.out.tfevents.*"))
        for e in EventFileLoader(str(path)).Load()
    ]


def test_a_tensorboard_logger_gets_each_step_as_one_event_read_back_as_every_tag(tmp_path):
    # One event per step instead of one per tag (each a hand-over to the writer's thread), read back
    # by TensorBoard exactly as add_scalar's one-per-tag events are
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = {"pace/skew_ms": 1.5, "pace/step_ms": 20.25, "pace/lead_ms/rank_1": 0.0}
    ours, stock = TensorBoardLogger(tmp_path / "ours"), TensorBoardLogger(tmp_path / "stock")
    sink, _ = loggers_sink([ours])
    assert sink is not None
    for step in range(5):
        sink(metrics, step)
        stock.log_metrics(metrics, step=step)
    ours.finalize("success")
    stock.finalize("success")
    scalars = {}
    for name, logger in (("ours", ours), ("stock", stock)):
        acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
        acc.Reload()
        scalars[name] = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert scalars["ours"] == scalars["stock"] and len(scalars["ours"]) == 3
    assert all(len(v) == 5 for v in scalars["ours"].values())
    with_values = [e for e in _events(tmp_path / "ours") if e.summary.value]
    assert len(with_values) == 5 and all(len(e.summary.value) == 3 for e in with_values)


def test_a_prefixed_tensorboard_logger_keeps_its_prefix(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, prefix="train")
    sink, _ = loggers_sink([logger])
    assert sink is not None
    sink({"pace/skew_ms": 1.5}, 3)
    logger.finalize("success")
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    assert acc.Tags()["scalars"] == ["train-pace/skew_ms"]
