"""An elastic restart: under ``torchrun --max-restarts 1`` rank 1 dies at step 6 of the first attempt;
the restarted job's session starts cleanly and its record sits beside the first attempt's.

One real torchrun run (two gloo workers, two attempts), checked by every test below.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pace_strategy.telemetry.run_record import read_run_record, record_filename
from tests.integration.helpers import pace_diagnose, why_failed

pytestmark = [pytest.mark.integration, pytest.mark.long]

JOB = Path(__file__).with_name("fault_job.py")
STEPS = 12


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("elastic")
    # torch 2.13's torchrun shares its rendezvous store with the workers and keeps the first
    # attempt's gloo addresses in it: the restarted attempt's init_process_group then connects to
    # dead peers and hangs (pytorch/pytorch#135712). Its documented workaround: a store per attempt.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # rendezvous on a free port
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.2",
        str(JOB),
        str(run_dir),
        "--steps",
        str(STEPS),
        "--exit-rank",
        "1",
        "--exit-at",
        "6",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    return run_dir, proc


@pytest.mark.timeout(200)
def test_the_restarted_job_completes_with_a_clean_session(restarted):
    run_dir, proc = restarted
    assert proc.returncode == 0, proc.stdout[-3000:] + why_failed(proc.stderr, 3000)
    record = read_run_record(run_dir / record_filename(1))
    assert record.header["restart_count"] == 1 and record.end is not None
    assert record.end["status"] == "completed", record.end
    # a fresh pacer: the steps start again at 0, none is missing or left over from the first attempt
    assert [s["step"] for s in record.steps] == list(range(STEPS))


@pytest.mark.timeout(200)
def test_the_first_attempt_keeps_its_own_record(restarted):
    run_dir, _ = restarted
    first = read_run_record(run_dir / record_filename(0))
    assert first.header["restart_count"] == 0
    assert first.steps and max(s["step"] for s in first.steps) < 6, "measured before rank 1 died"
    assert first.end is None or first.end["status"] != "completed", first.end


@pytest.mark.timeout(200)
def test_pace_diagnose_names_both_attempts(restarted):
    run_dir, _ = restarted
    code, out, err = pace_diagnose(str(run_dir), "--no-report", "--project-ranks", "")
    assert code == 0, err
    assert "restart1.jsonl" in out.splitlines()[0], out  # the latest attempt is the one diagnosed
    assert "elastic restart: this record is attempt 2 of the job" in out, out
    assert "attempt 1 of the job, pace_run.jsonl" in out, out
    assert "attempt 2 of the job (this record), pace_run.restart1.jsonl: completed" in out, out
