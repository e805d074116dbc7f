"""The hang evidence's parts: stacks, marks, the Flight Recorder's status, the files, and ending a
frozen rank on this host only when its pid still names the same process (a real stopped process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from pace_strategy.core.evidence import (
    flight_recorder_dump,
    kill_frozen_local_ranks,
    process_start,
    python_stacks,
    rank_marks,
    top_frames,
    write_evidence,
)

pytestmark = pytest.mark.timeout(60)


def test_the_stacks_hold_every_thread_and_the_innermost_frames_come_from_the_training_thread():
    release = threading.Event()

    def stuck_in_io():
        release.wait()

    worker = threading.Thread(target=stuck_in_io, name="reader")
    worker.start()
    try:
        text = python_stacks()
    finally:
        release.set()
        worker.join()
    assert f"pid {os.getpid()}" in text and 'Thread "reader"' in text and "in stuck_in_io" in text
    assert 'Thread "MainThread"' in text and "(this watchdog)" in text  # the caller's own thread
    frames = top_frames(text, threads=1, frames=1)
    assert frames == [f for f in frames if f.startswith("MainThread: ")] and len(frames) == 1


def test_marks_say_where_a_rank_stood():
    assert rank_marks(3 * 8 + 0, 8, 12.5) == {
        "steps_ended": 8,
        "last_step_begun": 8,
        "where": "between steps",
        "heartbeat_s": 12.5,
    }
    assert rank_marks(3 * 8 + 1, 8, 1.0)["where"] == "in a step, before its sync point"
    assert rank_marks(3 * 8 + 2, 8, 1.0)["where"] == "at its sync point"


def test_without_nccl_the_flight_recorder_is_skipped_with_the_reason():
    data, status = flight_recorder_dump()
    assert data is None and status == "skipped: no process group"


def test_the_evidence_files(tmp_path):
    line = {"record": "hang", "ranks": [1], "pids": [4242]}
    marks = {0: rank_marks(26, 8, 9.0), 1: None}
    out = write_evidence(tmp_path / "hang", line, marks, {0: "stacks of 0"}, (None, "skipped: gloo"))
    summary = json.loads((out / "hang.json").read_text())
    assert (
        summary["hang"] == line and summary["stacks"] == [0] and summary["flight_recorder"] == "skipped: gloo"
    )
    assert summary["marks"]["1"] is None and summary["marks"]["0"]["where"] == "at its sync point"
    assert (out / "stacks_rank0.txt").read_text() == "stacks of 0" and not (
        out / "flight_recorder.bin"
    ).exists()


def test_a_frozen_rank_on_this_host_is_ended_only_if_its_pid_is_still_the_same_process():
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        start = process_start(frozen.pid)
        assert start is not None and process_start(os.getpid()) != start
        me = {"host": "a", "pid": os.getpid(), "pid_start": process_start(os.getpid())}
        reused = [me, {"host": "a", "pid": frozen.pid, "pid_start": start + 1}]  # another process now
        elsewhere = [me, {"host": "b", "pid": frozen.pid, "pid_start": start}]
        assert kill_frozen_local_ranks([1], reused, "a", 0) == []
        assert kill_frozen_local_ranks([1], elsewhere, "a", 0) == []
        assert kill_frozen_local_ranks([0], [me], "a", 0) == []  # never itself
        assert frozen.poll() is None
        same = [me, {"host": "a", "pid": frozen.pid, "pid_start": start}]
        assert kill_frozen_local_ranks([1], same, "a", 0) == [1]
        assert frozen.wait(10) == -signal.SIGKILL
    finally:
        if frozen.poll() is None:
            frozen.kill()
            frozen.wait()
    assert process_start(frozen.pid) is None  # ended and reaped: no such process
