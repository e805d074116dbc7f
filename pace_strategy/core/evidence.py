"""What a hang leaves behind: every live rank's Python stacks, where each rank stood by our own marks,
torch's NCCL Flight Recorder where there is one; and the end of frozen ranks on this host.

The watchdog thread of each rank that reaches a verdict gathers its own stacks
(:func:`python_stacks`) and publishes them on the job's store; rank 0, which owns the run record,
collects what the live ranks published within a bound and writes ``RUN_DIR/hang/`` with
:func:`write_evidence`. A rank whose heartbeat stopped (SIGSTOP, frozen) can neither publish nor
leave: a healthy rank on the same host ends it (:func:`kill_frozen_local_ranks`), so that the job
ends and its launcher and scheduler see it fail.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "EVIDENCE_DIR",
    "MAX_STACKS_BYTES",
    "flight_recorder_dump",
    "kill_frozen_local_ranks",
    "process_start",
    "python_stacks",
    "rank_marks",
    "top_frames",
    "write_evidence",
]

log = logging.getLogger(__name__)

#: the evidence directory, beside the run record
EVIDENCE_DIR = "hang"
#: most bytes of one rank's stacks kept (a deep recursion must not fill the store)
MAX_STACKS_BYTES = 64 * 1024
_PHASES = ("between steps", "in a step, before its sync point", "at its sync point")


def process_start(pid: int) -> int | None:
    """Linux: when process ``pid`` started (clock ticks since boot); ``None`` when there is no such
    process, or no ``/proc``. A zombie keeps its start time until it is reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None

    # the command name (field 2) may hold spaces and parentheses: fields start after the last ")"
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] here is field 3
    except (IndexError, ValueError):
        return None


def python_stacks() -> str:
    """Every thread's Python stack in this process, innermost frame last, each headed by the
    thread's name (``sys._current_frames``: also the frames of a thread blocked in C++, such as a
    collective or a lock)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"pid {os.getpid()}"]
    for ident, frame in sys._current_frames().items():
        here = " (this watchdog)" if ident == threading.get_ident() else ""
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}){here}:\n{stack}')
    text = "\n".join(parts)
    if len(text.encode()) > MAX_STACKS_BYTES:
        text = text.encode()[-MAX_STACKS_BYTES:].decode(errors="replace")
    return text


def rank_marks(progress: int, step: int, alive_s: float) -> dict[str, Any]:
    """Where a rank stood by the Pacer's marks (its watchdog entry: ``3 * steps ended + phase``)."""
    return {
        "steps_ended": progress // 3,
        "last_step_begun": step,
        "where": _PHASES[progress % 3],
        "heartbeat_s": round(alive_s, 3),
    }


def flight_recorder_dump() -> tuple[bytes | None, str]:
    """torch's NCCL Flight Recorder (the last collectives of every NCCL group of this process), and
    why there is none: it exists only with NCCL, and records only with ``TORCH_NCCL_TRACE_BUFFER_SIZE``
    > 0 (set it before the process group is created; ``TORCH_FR_DUMP_TEMP_FILE`` and
    ``TORCH_NCCL_DUMP_ON_TIMEOUT`` are torch's own dump-on-timeout, independent of this one)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return None, "skipped: torch is not importable"
    if not dist.is_available() or not dist.is_initialized():
        return None, "skipped: no process group"
    backend = str(dist.get_backend())
    if "nccl" not in backend or not torch.cuda.is_available():
        return None, f"skipped: the process group's backend is {backend}, not nccl"
    if int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") or 0) <= 0:
        return None, "skipped: TORCH_NCCL_TRACE_BUFFER_SIZE is not set (> 0) before the group was created"
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None, f"skipped: this torch ({torch.__version__}) has no _dump_nccl_trace"
    try:
        return bytes(dump()), "dumped"
    except Exception as error:  # evidence is best effort: the abort must still happen
        return None, f"failed: {type(error).__name__}: {error}"


def kill_frozen_local_ranks(
    frozen: Sequence[int], topology: Sequence[Mapping[str, Any]], host: str, rank: int
) -> list[int]:
    """SIGKILL the ``frozen`` ranks (heartbeat stopped) that run on ``host``, this rank's: a stopped
    process ignores every other signal and holds its launcher's pipes, so the job would never end.
    A rank is killed only when its recorded ``pid`` still names the same process (its start time,
    ``pid_start``, matches): a pid the kernel has given to another process since is left alone, as are
    ranks on other hosts (their launcher's job). Returns the ranks killed."""
    killed = []
    for r in frozen:
        placement = topology[r] if 0 <= r < len(topology) else {}
        pid, start = placement.get("pid"), placement.get("pid_start")
        if r == rank or placement.get("host") != host or type(pid) is not int or type(start) is not int:
            continue
        if process_start(pid) != start:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError as error:
            log.warning("pace_strategy: could not end frozen rank %d (pid %d): %s", r, pid, error)
            continue
        killed.append(r)
    return killed


def write_evidence(
    directory: Path,
    line: Mapping[str, Any],
    marks: Mapping[int, Mapping[str, Any] | None],
    stacks: Mapping[int, str],
    flight: tuple[bytes | None, str],
) -> Path:
    """``directory`` (``RUN_DIR/hang``): ``hang.json`` (the record's hang line, every rank's marks,
    whose stacks are there and the Flight Recorder's status), ``stacks_rank{r}.txt`` for each rank
    that published its stacks, ``flight_recorder.bin`` when there is a dump. Returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for r, text in sorted(stacks.items()):
        (directory / f"stacks_rank{r}.txt").write_text(text)
    data, status = flight
    if data is not None:
        (directory / "flight_recorder.bin").write_bytes(data)
    summary = {
        "hang": dict(line),
        "marks": {str(r): (dict(m) if m is not None else None) for r, m in sorted(marks.items())},
        "stacks": sorted(stacks),
        "flight_recorder": status,
    }
    (directory / "hang.json").write_text(json.dumps(summary, indent=1))
    return directory


def top_frames(stacks: str, threads: int = 3, frames: int = 2) -> list[str]:
    """The innermost ``frames`` frames of the first ``threads`` threads of a :func:`python_stacks` text,
    as ``thread: file:line in function`` lines (for the diagnosis report)."""
    out: list[str] = []
    blocks = stacks.split('\nThread "')[1:]
    # the training thread first, the watchdog that wrote the dump last
    blocks.sort(key=lambda b: (not b.startswith("MainThread"), "(this watchdog)" in b.split("\n", 1)[0]))
    for block in blocks[:threads]:
        name = block.split('"', 1)[0]
        calls = [ln.strip() for ln in block.splitlines() if ln.strip().startswith('File "')]
        for call in calls[-frames:]:
            out.append(f"{name}: {call}")
    return out
