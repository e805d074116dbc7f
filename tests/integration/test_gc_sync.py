"""One real 2-rank ``paced_ddp`` run of a GC-heavy job with ``gc_sync``, checked by several tests:
GC time is recorded per rank, full collections run at the same steps on both ranks, the collector's
settings are back afterwards, and garbage does not pile up. The job logs to Lightning's real
``MLFlowLogger`` (a file store), which keeps no log directory: the run record goes to the documented
fallback and the tags to MLflow, beside the loss the job logs every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pace_strategy.telemetry import TAGS
from tests.integration.gc_sync_script import GARBAGE, STEPS
from tests.integration.helpers import read_mlflow, why_failed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).with_name("gc_sync_script.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gc_sync")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)],
        cwd=out,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, why_failed(done.stderr, 3000)
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]
    # MLFlowLogger keeps no log directory: ./pace_runs/<date-time>, said once with its path
    (record,) = (out / "pace_runs").glob("*/pace_run.jsonl")
    said = [line for line in done.stderr.splitlines() if "keeps no log directory" in line]
    assert len(said) == 1 and str(record.parent) in said[0], said
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    return {"ranks": ranks, "lines": lines, "mlruns": out / "mlruns"}


def _mlflow_steps(run, key: str) -> dict[int, float]:
    return read_mlflow(run["mlruns"], key, run["ranks"][0]["run_id"])


def _steps(run):
    return {x["step"]: x for x in run["lines"] if x["record"] == "step"}


def test_gc_time_is_recorded_per_rank_and_tagged(run):
    steps = _steps(run)
    for rank in range(2):
        assert max(s["ranks"]["gc_ms"][rank] for s in steps.values()) > 10.0
        assert sum(s["ranks"]["gc_collections"][rank] for s in steps.values()) > STEPS
    assert max(_mlflow_steps(run, "pace/gc_ms_max").values()) > 10.0


def test_the_tags_reach_mlflow_at_every_step_beside_the_job_s_own_loss(run):
    assert sorted(_mlflow_steps(run, "train_loss")) == list(range(STEPS))  # the job's, untouched
    for tag in TAGS:
        assert sorted(_mlflow_steps(run, tag)) == list(range(STEPS)), tag


def test_full_collections_run_at_the_same_steps_on_every_rank(run):
    reports = run["lines"][-1]["gc"]
    assert [r["rank"] for r in reports] == [0, 1]
    synced = [r["gc_sync"] for r in reports]
    assert synced[0]["collected_at"] == synced[1]["collected_at"] and synced[0]["synchronized"] >= 3
    assert all(s["other_full"] == 0 and s["due_self"] >= 1 for s in synced)
    decided = [x["gc_collect"]["after_step"] for x in run["lines"] if "gc_collect" in x]
    # one at the start of the step after each decision (one taken in the last window, exchanged as
    # training finished, has no step after it)
    assert synced[0]["collected_at"] == [step + 1 for step in decided if step + 1 < STEPS]
    steps = _steps(run)
    for step in synced[0]["collected_at"]:
        # both ranks ran their full collection at the start of that same step (a full collection of
        # a Lightning process's heap takes tens of ms, a young one well under 10 ms)
        assert min(steps[step]["ranks"]["gc_ms"]) > 10.0


def test_the_collector_is_restored_and_garbage_stays_bounded(run):
    for rank in run["ranks"]:
        after, before = rank["after"], rank["before"]
        assert after["threshold"] == before["threshold"] and after["enabled"] == before["enabled"]
        assert after["callbacks"] == before["callbacks"] and after["frozen"] == 0
        # never collecting would end with every step's garbage, about STEPS x GARBAGE objects
        assert rank["garbage_objects_held"] < STEPS * GARBAGE / 4
