"""A hung rank is named through the job's store and the others abort, long before the group's timeout.

Three real gloo jobs run at once, shared by every test below (one module-scoped fixture): three
ranks, one SIGSTOPped by the test (heartbeat stopped); two ranks, one asleep in its data loader
(heartbeat live); two ranks, one in a Python deadlock (a lock another thread holds; heartbeat live).
All use ``hang.timeout_s=3`` and a 60 s process-group timeout: only the watchdog can end them within
the test. The store lives in the test process, as torchrun's agent hosts it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch.distributed as dist

from pace_strategy.core.watchdog import HANG_EXIT_CODE
from pace_strategy.diagnose import load_arrays
from pace_strategy.diagnose.findings import diagnose
from pace_strategy.telemetry.run_record import read_run_record, summarize

pytestmark = [pytest.mark.integration]

JOB = Path(__file__).with_name("fault_job.py")
HANG_TIMEOUT_S = 3.0
#: how long after the stall the ranks may take to exit: the timeout, a verdict round, a slow start of
#: the exit on a loaded 2-core machine (not a timing claim: a hang waits 60 s for the group timeout)
EXIT_WITHIN_S = HANG_TIMEOUT_S + 12.0


@dataclass(eq=False)  # hashed by identity: the fixture keeps a set of (job, rank)
class Job:
    run_dir: Path
    world: int
    store: dist.TCPStore
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    stalled_at: float = 0.0  #: wall time the hang began (as near as the test knows it)
    exited_at: dict[int, float] = field(default_factory=dict)

    def log(self, rank: int) -> str:
        return (self.run_dir / f"rank{rank}.log").read_text()

    def reached(self, rank: int) -> bool:
        return (self.run_dir / f"reached{rank}").exists()


def _launch(tmp: Path, name: str, world: int, *args: str) -> Job:
    run_dir = tmp / name
    run_dir.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    job = Job(run_dir=run_dir, world=world, store=store)
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PACE_HOSTNAME=f"node{rank}")
        with (run_dir / f"rank{rank}.log").open("wb") as out:
            where = ["--rank", str(rank), "--world", str(world), "--store-port", str(store.port)]
            cmd = [sys.executable, str(JOB), str(run_dir), *where, *args]
            job.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
    return job


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hang")
    both: list[Job] = []
    try:
        yield from _run_both(tmp, both)
    finally:
        for job in both:
            for proc in job.procs:
                if proc.poll() is None:
                    proc.kill()  # SIGKILL ends a stopped process too
                    proc.wait(10)
            del job.store


def _run_both(tmp: Path, both: list[Job]):
    stopped = _launch(tmp, "sigstop", 3, "--hang-timeout", str(HANG_TIMEOUT_S))
    both.append(stopped)
    blocked = ["--hang-timeout", str(HANG_TIMEOUT_S), "--sleep-rank", "1", "--sleep-at", "8"]
    asleep = _launch(tmp, "sleep", 2, *blocked, "--sleep-in", "loader")
    both.append(asleep)
    locked = _launch(tmp, "lock", 2, *blocked, "--sleep-in", "lock")
    both.append(locked)
    # every process but the stopped one must exit; one loop watches both jobs, so that each exit is
    # seen within 50 ms whichever job hangs first
    waiting = {(j, r) for j in both for r in range(j.world) if not (j is stopped and r == 1)}
    deadline = time.time() + 150
    while waiting:
        now = time.time()
        if not stopped.stalled_at and stopped.reached(1):
            os.kill(stopped.procs[1].pid, signal.SIGSTOP)
            stopped.stalled_at = now
        for job in (asleep, locked):
            if not job.stalled_at and job.reached(1):
                # it is blocked two steps (~30 ms) after writing the marker
                job.stalled_at = (job.run_dir / "reached1").stat().st_mtime
        for j, r in list(waiting):
            if j.procs[r].poll() is not None:
                j.exited_at[r] = now
                waiting.discard((j, r))
        if now > deadline:
            logs = "\n".join(f"{j.run_dir.name} rank {r}: {j.log(r)[-1500:]}" for j, r in waiting)
            raise AssertionError(f"ranks still running after 150 s:\n{logs}")
        time.sleep(0.05)
    yield {"sigstop": stopped, "sleep": asleep, "lock": locked}


@pytest.mark.timeout(200)
def test_a_sigstopped_rank_is_named_by_the_ranks_that_arrived(jobs):
    job = jobs["sigstop"]
    for rank in (0, 2):
        log = job.log(rank)
        assert job.procs[rank].returncode == HANG_EXIT_CODE, log
        assert f"[rank {rank}/3] pace_strategy: rank 1 (host node1) has not reached step" in log, log
        assert "its heartbeat stopped" in log, log
        assert "rank 0 (host" not in log and "rank 2 (host" not in log, log  # nobody else is blamed


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["sleep", "lock"])
def test_a_blocked_rank_is_named_with_a_live_heartbeat(jobs, name):
    job = jobs[name]
    for rank in (0, 1):  # the blocked rank's own watchdog reaches the same verdict and leaves too
        log = job.log(rank)
        assert job.procs[rank].returncode == HANG_EXIT_CODE, log
        assert f"[rank {rank}/2] pace_strategy: rank 1 (host node1) has not reached step 8" in log, log
        assert "its heartbeat is live" in log, log


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("name", "where"), [("sleep", "in batches"), ("lock", "in deadlock")])
def test_the_evidence_holds_the_blocked_rank_s_own_stack(jobs, name, where):
    evidence = jobs[name].run_dir / "hang"
    summary = json.loads((evidence / "hang.json").read_text())
    assert summary["stacks"] == [0, 1] and summary["hang"]["ranks"] == [1]
    assert summary["flight_recorder"].startswith("skipped: the process group's backend is gloo")
    stacks = (evidence / "stacks_rank1.txt").read_text()
    assert where in stacks and 'Thread "pace-watchdog-1"' in stacks, stacks  # where it is stuck
    if name == "lock":
        assert "lock.acquire()" in stacks and 'Thread "holds-the-lock"' in stacks, stacks
    # rank 0 waits for rank 1 in DDP's collective: in its step, past its sync point
    assert summary["marks"]["0"]["where"] == "at its sync point", summary["marks"]
    blocked_where = "between steps" if name == "sleep" else "in a step, before its sync point"
    assert summary["marks"]["1"]["where"] == blocked_where and summary["marks"]["1"]["steps_ended"] == 8
    assert "backward" in (evidence / "stacks_rank0.txt").read_text()  # blocked in DDP's allreduce


@pytest.mark.timeout(200)
def test_the_evidence_of_a_frozen_rank_is_where_it_stood(jobs):
    evidence = jobs["sigstop"].run_dir / "hang"
    summary = json.loads((evidence / "hang.json").read_text())
    assert summary["stacks"] == [0, 2]  # a stopped process publishes nothing
    assert not (evidence / "stacks_rank1.txt").exists()
    assert summary["hang"]["pids"] == [jobs["sigstop"].procs[1].pid]
    # its marks are its last entry on the store, written at most a heartbeat before it froze: behind
    # the others', and its heartbeat stopped seconds before theirs
    marks = summary["marks"]
    assert marks["1"]["steps_ended"] <= min(marks["0"]["steps_ended"], marks["2"]["steps_ended"]), marks
    assert marks["1"]["heartbeat_s"] < marks["0"]["heartbeat_s"] - HANG_TIMEOUT_S / 2, marks
    # different host names (PACE_HOSTNAME): nobody ends it; the fixture does
    assert jobs["sigstop"].procs[1].returncode is None or jobs["sigstop"].procs[1].returncode < 0


@pytest.mark.timeout(200)
def test_the_ranks_abort_soon_after_the_hang_timeout(jobs):
    for job in jobs.values():
        for rank, exited in job.exited_at.items():
            assert exited - job.stalled_at < EXIT_WITHIN_S, (rank, exited - job.stalled_at)


@pytest.mark.timeout(200)
def test_rank_0_records_the_hang_and_closes_the_record_as_hung(jobs):
    for name, steps_before in (("sigstop", 6), ("sleep", 8), ("lock", 8)):
        record = read_run_record(jobs[name].run_dir)
        assert len(record.hangs) == 1, record.hangs
        hang = record.hangs[0]
        assert hang["ranks"] == [1] and hang["hosts"] == ["node1"], hang
        assert hang["step"] >= steps_before - 1 and hang["waited_s"] >= HANG_TIMEOUT_S, hang
        assert record.end is not None and record.end["status"] == "hung", record.end
        assert "rank 1 (host node1) has not reached step" in record.end["error"], record.end
        assert record.steps, "the steps measured before the hang are kept"
        assert "rank 1 (host node1) had not reached step" in summarize(record).table()
        notes = diagnose(load_arrays(jobs[name].run_dir), project_ranks=None).notes
        assert any("rank 1 (host node1) had not reached step" in n for n in notes), notes
        # the evidence: where each rank stood, the innermost frames of the live ranks' stacks
        assert any(n.startswith("hang evidence in ") for n in notes), notes
        hung = next(n for n in notes if n.startswith("hang: rank 1 (hung)"))
        assert ("no stacks" in hung) == (name == "sigstop"), hung
        if name == "lock":
            assert "innermost frames" in hung and "deadlock" in hung, hung
