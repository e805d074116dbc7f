"""Switching ``ddp`` for ``paced_ddp`` changes nothing a user can observe but the ``pace/`` tags and the
run record where Lightning itself writes: the same tiny jobs under both, side by side, leave the same
files, checkpoints, logged metrics, return values, warnings and errors (artifacts_jobs.py runs them).
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.core.state import CHECKPOINT_KEY
from pace_strategy.telemetry import RECORD_FILENAME, read_run_record
from tests.integration.helpers import read_scalars, why_failed
from tests.integration.preloaded import PreloadedJob

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).with_name("artifacts_jobs.py")
MAX_STEPS = 4  # artifacts_jobs.MAX_STEPS
VERSION = "lightning_logs/version_0"

#: (phase, job, variant) -> the directory the run record must be in; any other variant writes none.
RECORDS = {
    ("popen", "logger", "paced_ddp"): VERSION,
    ("popen", "logger", "paced_env"): VERSION,  # the logger's log_dir beats $PACE_RUN_DIR
    ("popen", "no_logger", "paced_run_dir"): "asked",
    ("popen", "no_logger", "paced_env"): "from_env",
    ("popen", "no_logger", "paced_run_dir_and_env"): "asked",  # run_dir= beats $PACE_RUN_DIR
    ("popen", "csv_no_checkpoints", "paced_ddp"): VERSION,
    ("single", "one_logger", "paced_run_dir"): "asked",
    ("single", "one_no_logger", "paced_env"): "from_env",
    ("single", "spawn", "paced_ddp_spawn"): VERSION,
}
#: processes that report, by phase (spawned processes do not)
REPORTS = {"popen": 2, "single": 1}


def world_size(job: str) -> int:
    return 1 if job.startswith("one_") else 2


class Jobs:
    """Where the jobs ran and what each process reported: ``reports[phase][rank][job][variant]``."""

    def __init__(self, base: Path, reports: dict[str, list[dict[str, Any]]], seconds: float) -> None:
        self.base = base
        self.reports = reports
        self.seconds = seconds

    def dir(self, phase: str, job: str, variant: str) -> Path:
        return self.base / phase / job / variant

    def variants(self) -> Iterator[tuple[str, str, str, str]]:
        """(phase, job, stock variant, variant) for every variant but the stock one (listed first)."""
        for phase, ranks in self.reports.items():
            for job, variants in ranks[0].items():
                stock, *others = variants
                for variant in others:
                    yield phase, job, stock, variant


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    base = tmp_path_factory.mktemp("artifacts")
    out = base / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PACE_RUN_DIR"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    procs = {}
    for phase in REPORTS:
        (base / phase).mkdir()
        procs[phase] = PreloadedJob(
            [str(SCRIPT), phase, str(base / phase), str(out)], cwd=base / phase, env=env
        )
    try:
        for phase, proc in procs.items():
            _, stderr = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"{phase} jobs failed:\n{why_failed(stderr or '', 6000)}"
    finally:
        for proc in procs.values():
            proc.kill()
    reports = {
        phase: [json.loads((out / f"{phase}-rank_{r}.json").read_text()) for r in range(REPORTS[phase])]
        for phase in procs
    }
    return Jobs(base, reports, time.perf_counter() - started)


def tree(root: Path) -> Counter[str]:
    """Every directory (``name/``) and file below ``root``, counted; TensorBoard's event-file names
    (host, time, pid) as a pattern."""
    found: Counter[str] = Counter()
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        found[
            rel + "/"
            if path.is_dir()
            else re.sub(r"events\.out\.tfevents\..*$", "events.out.tfevents.*", rel)
        ] += 1
    return found


def with_record(stock: Counter[str], where: str | None) -> Counter[str]:
    if where is None:
        return stock
    parts = Path(where).parts
    added = {"/".join(parts[: i + 1]) + "/" for i in range(len(parts))} - set(stock)
    return stock + Counter([*added, f"{where}/{RECORD_FILENAME}"])


def test_the_paced_jobs_leave_the_stock_files_and_the_record_only_where_expected(jobs):
    print(f"\nside-by-side jobs: {jobs.seconds:.1f} s in all")
    for phase, ranks in jobs.reports.items():
        print(phase, {j: {v: r["seconds"] for v, r in vs.items()} for j, vs in ranks[0].items()})
    compared = 0
    for phase, job, stock, variant in jobs.variants():
        expected = with_record(tree(jobs.dir(phase, job, stock)), RECORDS.get((phase, job, variant)))
        assert tree(jobs.dir(phase, job, variant)) == expected, (phase, job, variant)
        compared += 1
    assert compared == 15
    assert not tree(jobs.dir("popen", "fast_dev_run", "ddp")), "fast_dev_run writes nothing"
    assert (
        tree(jobs.dir("popen", "logger", "ddp"))[f"{VERSION}/events.out.tfevents.*"] == 3
    )  # fit, validate, test
    for phase, ranks in jobs.reports.items():  # nothing outside the job directories either
        assert {p.name for p in (jobs.base / phase).iterdir()} == set(ranks[0]), phase


def test_each_record_holds_every_step_of_its_run(jobs):
    for (phase, job, variant), where in RECORDS.items():
        record = read_run_record(jobs.dir(phase, job, variant) / where)
        assert record.world_size == world_size(job) and record.end["status"] == "completed", (job, variant)
        assert [s["step"] for s in record.steps] == list(range(MAX_STEPS)), (job, variant)


def _not_pace(scalars: dict[str, Any]) -> dict[str, Any]:
    return {tag: values for tag, values in scalars.items() if not tag.startswith("pace/")}


def test_the_logged_metrics_differ_only_by_the_pace_tags(jobs):
    tensorboard = [("popen", "logger"), ("single", "one_logger"), ("single", "spawn")]
    for phase, job, stock, variant in jobs.variants():
        if (phase, job) not in tensorboard:
            continue
        plain = read_scalars(jobs.dir(phase, job, stock) / VERSION)
        paced = read_scalars(jobs.dir(phase, job, variant) / VERSION)
        assert {"train_loss", "val_loss"} <= set(plain) and not any(t.startswith("pace/") for t in plain)
        assert _not_pace(paced) == plain, (phase, job, variant)  # the same names, steps and values
        pace_tags = set(paced) - set(plain)
        monitored = world_size(job) > 1 or variant == "paced_run_dir"
        assert ("pace/skew_ms" in pace_tags) == monitored, (phase, job, variant, pace_tags)
    rows = {}
    for variant in ("ddp", "paced_ddp"):
        with (jobs.dir("popen", "csv_no_checkpoints", variant) / VERSION / "metrics.csv").open() as f:
            rows[variant] = list(csv.DictReader(f))
    pace_columns = {c for c in rows["paced_ddp"][0] if c.startswith("pace/")}
    assert "pace/skew_ms" in pace_columns
    stock = [{c: v for c, v in row.items() if c not in pace_columns} for row in rows["paced_ddp"]]
    # the pace/ tags come in rows of their own, one per step
    assert [r for r in stock if any(v for c, v in r.items() if c != "step")] == rows["ddp"]


def _digest(value: Any, here: Path) -> Any:
    """A checkpoint as comparable plain data: tensors exactly, paths relative to the job directory."""
    if isinstance(value, torch.Tensor):
        return ["tensor", value.dtype, value.tolist()]
    if isinstance(value, dict):
        return {_digest(k, here): _digest(v, here) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_digest(v, here) for v in value]
    if isinstance(value, str):
        return value.replace(str(here), "<job dir>")
    return value


def test_checkpoints_are_the_same_files_with_the_same_contents(jobs):
    compared = with_state = 0
    for phase, job, stock, variant in jobs.variants():
        plain_dir, paced_dir = jobs.dir(phase, job, stock), jobs.dir(phase, job, variant)
        for path in plain_dir.rglob("*.ckpt"):
            rel = path.relative_to(plain_dir)
            plain = torch.load(path, weights_only=False)
            paced = torch.load(paced_dir / rel, weights_only=False)
            # the one addition, where a session ran: the pacing state that trainer.fit(ckpt_path=...)
            # restores (docs/reliability.md), plain data
            state = paced.pop(CHECKPOINT_KEY, None)
            if state is not None:
                assert set(state["components"]) == {"pacer"}, (phase, job, variant, rel)
                with_state += 1
            assert _digest(paced, paced_dir) == _digest(plain, plain_dir), (phase, job, variant, rel)
            compared += 1
    assert compared >= 6 and with_state >= 1


def _normalized(report: dict[str, Any], here: Path) -> dict[str, Any]:
    report = {k: v for k, v in report.items() if k != "seconds"}
    text = json.dumps(report).replace(str(here), "<job dir>")
    # the strategy's own class name in Lightning's messages
    return json.loads(text.replace("PacedDDPStrategy", "DDPStrategy"))


def test_return_values_warnings_logs_and_errors_are_the_stock_ones(jobs):
    for phase, job, stock, variant in jobs.variants():
        for rank, report in enumerate(jobs.reports[phase]):
            plain = _normalized(report[job][stock], jobs.dir(phase, job, stock))
            paced = _normalized(report[job][variant], jobs.dir(phase, job, variant))
            assert plain["error"] is None, (phase, job, plain["error"])
            assert paced == plain, (phase, job, variant, rank)
    returns = jobs.reports["popen"][0]["logger"]["ddp"]["returns"]
    assert set(returns) == {"fit", "validate", "test", "predict"} and returns["validate"][0]["val_loss"] > 0


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_run_dir_is_checked_when_the_strategy_is_built(tmp_path, package):
    pytest.importorskip("lightning.pytorch" if package == "lightning" else package)
    adapter = importlib.import_module(f"pace_strategy.integrations.{package}")
    assert adapter.PacedDDPStrategy(run_dir=tmp_path).pacing.run_dir == tmp_path
    assert adapter.PacedFSDPStrategy(run_dir=str(tmp_path)).pacing.run_dir == tmp_path
    assert adapter.PacedDDPStrategy().pacing.run_dir is None
    for bad in ("", 3):
        with pytest.raises(PacingConfigError, match=f"run_dir={bad!r} is invalid"):
            adapter.PacedDDPStrategy(run_dir=bad)


@pytest.mark.timeout(60)
def test_without_a_session_the_user_comm_hook_still_does_the_communication(tmp_path, monkeypatch):
    # One process, logger=False: no session, nothing written, but the hook is registered on CPU
    # as it is with a session (stock DDPStrategy would drop it there).
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from pace_strategy.integrations.lightning import PacedDDPStrategy
    from tests.integration.artifacts_jobs import TinyModule, loader

    buckets = []

    def counting_hook(state, bucket):
        buckets.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PACE_RUN_DIR", raising=False)
    strategy = PacedDDPStrategy(ddp_comm_hook=counting_hook)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with mock.patch.dict(os.environ):  # Lightning exports MASTER_ADDR/MASTER_PORT for its group
        try:
            trainer.fit(TinyModule(), loader())
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    assert buckets == [0, 0, 0] and strategy.pacing_session is None
    assert list(tmp_path.iterdir()) == []
