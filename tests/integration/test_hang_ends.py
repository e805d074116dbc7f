"""A hung job ends: a SIGSTOPped rank (its heartbeat stops; it ignores every signal but SIGKILL and
keeps its launcher's pipes open) is ended by the healthy rank on its host, so the whole job exits
non-zero within ``hang.timeout_s + 30 s`` and leaves no process behind; under Lightning's subprocess
launcher (rank 0 is rank 1's parent) and under torchrun (its agent sees the workers fail). Both jobs
run at once (one module-scoped fixture)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pace_strategy.core.evidence import process_start
from pace_strategy.core.watchdog import HANG_EXIT_CODE
from tests.integration.helpers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(200)]

HERE = Path(__file__).resolve().parent
HANG_TIMEOUT_S = 3.0
ENDS_WITHIN_S = HANG_TIMEOUT_S + 30.0


def _is_job(pid: int) -> bool:
    """Whether ``pid`` is still one of this test's job scripts (not a process that reused the pid)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"hang_lightning_job.py" in command or b"fault_job.py" in command


def _gone(pid: int) -> bool:
    """No such process, or a zombie (ended; its parent, gone too, cannot reap it here)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return state[state.rfind(")") + 2 :].split()[0] in ("Z", "X")


def _start(out: Path, kind: str) -> subprocess.Popen[str]:
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if kind == "lightning":
        command = [sys.executable, str(HERE / "hang_lightning_job.py"), str(out)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(free_port()), str(HERE / "fault_job.py"), str(out),
                   "--hang-timeout", str(HANG_TIMEOUT_S)]  # fmt: skip
    with (out / "output.txt").open("w") as log:  # a file, not a pipe: a full pipe would stall the job
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    root = tmp_path_factory.mktemp("hang_ends")
    jobs = {kind: (root / kind, _start(root / kind, kind)) for kind in ("lightning", "torchrun")}
    results = {}
    stopped: dict[str, tuple[int, float]] = {}
    try:
        deadline = time.time() + 170
        while len(results) < len(jobs) and time.time() < deadline:
            for kind, (out, proc) in jobs.items():
                marker = out / "reached1"
                if kind not in stopped and marker.exists() and (out / "reached0").exists():
                    pid = int(marker.read_text())
                    os.kill(pid, signal.SIGSTOP)
                    stopped[kind] = (pid, time.time())
                if kind not in results and proc.poll() is not None:
                    results[kind] = (proc.returncode, time.time())
            time.sleep(0.05)
        yield {
            kind: (
                *results.get(kind, (None, None)),
                (out / "output.txt").read_text(),
                *stopped.get(kind, (None, None)),
            )
            for kind, (out, _) in jobs.items()
        }
    finally:
        for _, proc in jobs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        # every rank that wrote its pid, stopped or not: a launcher's kill leaves the ranks it spawned
        # (Lightning's rank 1) running when the loop above failed before stopping one
        pids = {pid for pid, _ in stopped.values()}
        for out, _ in jobs.values():
            pids |= {int(t) for m in out.glob("reached[0-9]") if (t := m.read_text()).isdigit()}
        for pid in pids:
            if not _gone(pid) and _is_job(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("kind", ["lightning", "torchrun"])
def test_a_sigstopped_rank_ends_the_whole_job(ended, kind):
    code, exited_at, output, pid, stopped_at = ended[kind]
    assert pid is not None, f"rank 1 never reached step 6:\n{output[-3000:]}"
    assert code is not None, f"the job still ran {170} s after rank 1 was stopped:\n{output[-3000:]}"
    assert code != 0 and exited_at - stopped_at < ENDS_WITHIN_S, (code, exited_at - stopped_at)
    assert "ended frozen rank(s) 1 on this host (SIGKILL)" in output, output[-3000:]
    assert _gone(pid), "the stopped rank is still there"
    if kind == "lightning":
        assert code == HANG_EXIT_CODE  # rank 0, the launcher's own process, aborted
    assert process_start(os.getpid()) is not None  # /proc is what the identity check reads
