"""Python jobs started from a process that has imported Lightning already, for the tests whose
subject is what the job does, not how its first process starts.

A new interpreter spends about 7 s of CPU importing Lightning (docs/testing.md). Each job here is
forked instead from a ``multiprocessing`` fork server that imported Lightning and pace_strategy once
for the pytest process; the job then runs its module or script as ``__main__`` with its own
arguments, environment, working directory and output files, in its own process group, and exits
as an interpreter would (non-daemon threads joined, ``atexit`` handlers run). Its further ranks are
whatever the job starts: forked from it (``paced_ddp_fork``) or new interpreters (``paced_ddp``).

Not for tests of the launch itself (signals to a whole job, what a fresh interpreter registers):
those start ``sys.executable`` as users do.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

#: imported once by the fork server; an import that fails there is left to the job
PRELOAD = [
    "lightning.pytorch",
    "pace_strategy.cli",
    "pace_strategy.integrations.lightning",
    "pace_strategy.apps.lightning_job",
]

_context: Any = None
_lock = threading.Lock()


def _fork_server() -> Any:
    global _context
    with _lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _context = context
        return _context


def _job(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str, cpus: list[int] | None) -> None:
    """The forked job: ``python ARGV`` as far as the job can tell (``-m MODULE`` or a script)."""
    import atexit
    import runpy

    os.setpgid(0, 0)  # its own group: a timeout ends the job and every rank it started
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    for fd, path in ((1, out), (2, err)):  # the same file twice: opened once, stderr into stdout
        if fd == 2 and err == out:
            os.dup2(1, 2)
            continue
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout.reconfigure(line_buffering=True)  # PYTHONUNBUFFERED is read at start-up only
    sys.stderr.reconfigure(line_buffering=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read by the OpenMP runtime when torch loaded, in the server
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code: int = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # what an interpreter does at exit: wait for non-daemon threads, then the atexit handlers
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class PreloadedJob:
    """A started job, used as a ``subprocess.Popen(..., stdout=PIPE, stderr=PIPE or STDOUT,
    text=True)`` is: ``communicate``, ``poll``, ``returncode``, ``kill``. ``argv``: ``["-m", MODULE,
    ...]`` or ``[SCRIPT, ...]``; ``cpus``: the job's CPU affinity (inherited by the ranks it forks);
    ``merge_stderr``: stderr into stdout (``stderr=STDOUT``). Its output goes to files outside its
    working directory (so that a test of what a job leaves there sees only the job's), read back and
    removed by ``communicate``."""

    def __init__(
        self,
        argv: list[str],
        *,
        cwd: Path,
        env: dict[str, str],
        cpus: list[int] | None = None,
        merge_stderr: bool = False,
    ) -> None:
        self.args = [sys.executable, *argv]
        self._out = _output_file("stdout")
        self._err = self._out if merge_stderr else _output_file("stderr")
        job = (argv, str(cwd), env, str(self._out), str(self._err), cpus)
        self._process = _fork_server().Process(target=_job, args=job)
        self._process.start()
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def communicate(self, timeout: float) -> tuple[str, str | None]:
        """Wait up to ``timeout`` s; stdout and stderr (``None`` when merged). On a timeout
        ``subprocess.TimeoutExpired``, the job left running (as ``Popen.communicate`` does)."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.kill()  # ranks the job left behind
        stdout = self._read(self._out)
        return stdout, (None if self._err == self._out else self._read(self._err))

    def kill(self) -> None:
        """End the job's process group (nothing when it has ended)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)

    @staticmethod
    def _read(path: Path) -> str:
        text = path.read_text() if path.exists() else ""
        path.unlink(missing_ok=True)
        return text


def _output_file(name: str) -> Path:
    fd, path = tempfile.mkstemp(prefix=f"pace-test-job-{name}-")
    os.close(fd)
    return Path(path)


def run_python(
    argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float, cpus: list[int] | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``, forked from
    the preloaded server (:class:`PreloadedJob`); on a timeout the job's process group is killed and
    ``subprocess.TimeoutExpired`` raised."""
    job = PreloadedJob(argv, cwd=cwd, env=env, cpus=cpus)
    try:
        stdout, stderr = job.communicate(timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        job._process.join(10)
        raise
    assert job.returncode is not None  # communicate returned: it has ended
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)
