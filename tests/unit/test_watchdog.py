"""The hang watchdog's verdict, its rounds on a real store with a fake clock, its config fields, the
private torch accessor it depends on, and the run record's ``hang`` line and restart attempts."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from pace_strategy.core.config import HangConfig, PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.core.watchdog import HangWatchdog, RankProgress, hang_verdict, job_store, stale_after_s
from pace_strategy.diagnose.findings import diagnose
from pace_strategy.telemetry.arrays import find_run_record, load_arrays
from pace_strategy.telemetry.run_record import (
    RunRecordError,
    RunRecordWriter,
    attempt_number,
    read_run_record,
    record_filename,
    summarize,
)

pytestmark = pytest.mark.timeout(30)


def _entry(progress: int, alive_s: float, step: int = 7) -> RankProgress:
    return RankProgress(progress=progress, step=step, alive_s=alive_s)


def test_a_rank_behind_the_others_is_named_and_its_live_heartbeat_kept_apart():
    arrived, begun = 3 * 7 + 2, 3 * 7 + 1
    entries = {0: _entry(arrived, 30.0), 1: _entry(begun, 29.6), 2: _entry(arrived, 30.2)}
    report = hang_verdict(entries, 3, stale_s=1.5, waited_s=3.0)
    assert report.ranks == (1,) and report.behind == (1,) and report.stale == () and report.step == 7


def test_a_stopped_heartbeat_is_named_once_it_stayed_unchanged_even_at_the_same_progress():
    entries = {0: _entry(23, 30.0), 1: _entry(23, 26.0), 2: _entry(23, 30.1)}
    first = hang_verdict(entries, 3, stale_s=1.5, waited_s=4.0)
    assert first.ranks == () and first.unconfirmed == (1,), "a trailing heartbeat is confirmed first"
    starved = {**entries, 1: _entry(23, 28.0)}  # it wrote again meanwhile: alive, only starved
    assert hang_verdict(starved, 3, 1.5, 4.0, earlier=entries).unconfirmed == (1,)
    report = hang_verdict(entries, 3, stale_s=1.5, waited_s=5.5, earlier=entries)
    assert report.ranks == (1,) and report.stale == (1,) and report.behind == ()


def test_a_stopped_rank_ahead_of_its_waiting_peers_does_not_make_them_look_behind():
    # rank 1 wrote "step 7 ended" and stopped before its peers received its last bytes
    entries = {0: _entry(3 * 7 + 2, 30.0), 1: _entry(3 * 8, 25.0), 2: _entry(3 * 7 + 2, 30.1)}
    report = hang_verdict(entries, 3, stale_s=1.5, waited_s=4.0, earlier=entries)
    assert report.ranks == (1,) and report.behind == () and report.stale == (1,)


def test_a_live_rank_still_waiting_at_its_sync_point_for_a_frozen_one_is_not_named():
    # rank 1 froze inside step 8's ring all-reduce: rank 2 got its last bytes and began step 9,
    # rank 0 still waits for them at step 8's sync point (seen on a loaded 2-core machine)
    entries = {0: _entry(3 * 8 + 2, 30.0), 1: _entry(3 * 8 + 2, 25.0), 2: _entry(3 * 9 + 1, 30.1)}
    report = hang_verdict(entries, 3, stale_s=1.5, waited_s=4.0, earlier=entries)
    assert report.ranks == (1,) and 0 not in report.behind and report.stale == (1,)
    # without a frozen rank, a live rank left behind at its sync point is named (its own network)
    alive = {**entries, 1: _entry(3 * 9 + 1, 30.0)}
    assert hang_verdict(alive, 3, 1.5, 4.0).ranks == (0,)


def test_a_pause_on_every_rank_names_nobody_and_a_missing_entry_is_named():
    assert hang_verdict({0: _entry(24, 9.0), 1: _entry(24, 9.2)}, 2, 1.5, 3.0).ranks == ()
    missing = {0: _entry(24, 9.0), 1: None}
    assert hang_verdict(missing, 2, 1.5, 3.0).unconfirmed == (1,)
    assert hang_verdict(missing, 2, 1.5, 4.5, earlier=missing).ranks == (1,)


def test_every_rank_reaches_the_same_verdict_from_the_same_entries():
    entries = {0: _entry(22, 5.0), 1: _entry(23, 5.1), 2: _entry(23, 1.0), 3: _entry(23, 5.0)}
    shuffled = dict(reversed(list(entries.items())))
    verdict = hang_verdict(entries, 4, 1.5, 3.0, earlier=entries)
    assert verdict == hang_verdict(shuffled, 4, 1.5, 3.0, earlier=shuffled)
    assert verdict.ranks == (0, 2)


def test_torch_still_has_the_private_default_store_accessor_the_watchdog_uses(tmp_path):
    # If this fails, torch moved `_get_default_store`: update pace_strategy.core.watchdog.job_store.
    assert callable(dist.distributed_c10d._get_default_store)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        store = job_store()
        assert store is not None
        store.set("pace_probe", "1")
        assert store.get("pace_probe") == b"1"
    finally:
        dist.destroy_process_group()
    assert job_store() is None


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rounds_on_a_real_store_name_the_rank_whose_entry_stopped():
    """Two watchdogs on one store, a fake clock: rank 1 stops writing; rank 0 stands still in its
    step for the timeout and names rank 1, once."""
    store = dist.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    clock, reports = _Clock(), []
    progress = {0: (3 * 4 + 2, 4), 1: (3 * 4 + 2, 4)}

    def dog(rank: int) -> HangWatchdog:
        return HangWatchdog(
            store,
            "test/ns",
            rank=rank,
            world_size=2,
            hosts=["a", "b"],
            hang_timeout_s=3.0,
            progress=lambda: progress[rank],
            on_hang=reports.append,
            clock=clock,
        )

    dog0, dog1 = dog(0), dog(1)
    for _ in range(2):  # both alive and at the same place: nothing to say
        clock.now += 0.5
        assert dog0.tick() is None and dog1.tick() is None
    for _ in range(int((3.0 + 1.5) / 0.5) + 1):  # rank 1 stopped: rank 0 waits 3 s, confirms 1.5 s
        clock.now += 0.5
        dog0.tick()
    assert len(reports) == 1, reports
    report = reports[0]
    assert report.ranks == (1,) and report.stale == (1,) and report.hosts == ("b",)
    assert report.waited_s >= 4.5
    assert report.messages(0, 2)[0].startswith("[rank 0/2] pace_strategy: rank 1 (host b) has not reached")
    clock.now += 10
    assert dog0.tick() is None, "a stall is reported once"
    assert store.check(["test/ns/verdict0"])


def test_hang_fields_are_validated_at_start():
    assert PacingConfig().hang == HangConfig(timeout_s=120.0, action="auto")
    # observing ends no process unless asked; the modes that pace end a hung job
    assert PacingConfig(mode="monitor").hang_action == "log"
    assert PacingConfig(mode="adaptive").hang_action == PacingConfig(mode="forced").hang_action == "abort"
    assert PacingConfig(mode="monitor", hang={"action": "abort"}).hang_action == "abort"
    assert PacingConfig(hang={"action": "log"}).hang_action == "log"
    assert stale_after_s(120.0) == 60.0
    with pytest.raises(PacingConfigError, match=r"PacingConfig\.hang\.action="):
        PacingConfig(hang=HangConfig(action="kill"))
    with pytest.raises(PacingConfigError, match=r"PacingConfig\.hang\.timeout_s="):
        PacingConfig(hang={"timeout_s": -1})
    assert PacingConfig(hang=HangConfig(timeout_s=0)).hang.timeout_s == 0  # 0 disables


def _write(path, restart_count: int, status: str, hang: dict | None = None) -> None:
    writer = RunRecordWriter(
        path,
        world_size=2,
        config={},
        topology=[{"rank": 0, "host": "a"}, {"rank": 1, "host": "b"}],
        framework="torch",
        extra={"restart_count": restart_count},
    )
    if hang is not None:
        writer.write_line(hang)
    writer.close(status, "boom" if status != "completed" else None)


HANG = {"record": "hang", "ranks": [1], "step": 8, "waited_s": 20.5, "hosts": ["b"]}


def test_the_hang_line_is_read_summarized_and_checked(tmp_path):
    path = tmp_path / record_filename(0)
    _write(path, 0, "hung", HANG)
    record = read_run_record(tmp_path)
    assert record.hangs == [HANG] and record.end["status"] == "hung"
    assert "rank 1 (host b) had not reached step 8 after 20 s" in summarize(record).table()
    notes = diagnose(load_arrays(tmp_path), project_ranks=None).notes
    assert any(n.startswith("hang: rank 1 (host b)") for n in notes), notes
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({**HANG, "ranks": [5]})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RunRecordError, match=r"line 2: hang field 'ranks'=\[5\]"):
        read_run_record(path)


def test_restarted_attempts_keep_their_own_records_and_the_diagnosis_names_both(tmp_path):
    assert [record_filename(k) for k in (0, 2)] == ["pace_run.jsonl", "pace_run.restart2.jsonl"]
    assert attempt_number("pace_run.restart2.jsonl") == 2 and attempt_number("pace_run.json") is None
    _write(tmp_path / record_filename(0), 0, "failed")
    _write(tmp_path / record_filename(1), 1, "completed")
    assert find_run_record(tmp_path).name == "pace_run.restart1.jsonl"
    assert read_run_record(tmp_path).restart_count == 1
    assert "attempt 2 of the job" in summarize(read_run_record(tmp_path)).table()
    notes = diagnose(load_arrays(tmp_path), project_ranks=None).notes
    assert any(n.startswith("elastic restart: this record is attempt 2") for n in notes), notes
    assert any(n.startswith("attempt 1 of the job, pace_run.jsonl: failed") for n in notes), notes
    assert any(n.startswith("attempt 2 of the job (this record), pace_run.restart1.jsonl") for n in notes)
    bad = tmp_path / "other" / record_filename(0)
    bad.parent.mkdir()
    bad.write_text(
        json.dumps(
            {
                "record": "header",
                "schema": "pace_strategy/run-record",
                "version": 1,
                "world_size": 1,
                "restart_count": -1,
            }
        )
        + "\n"
    )
    with pytest.raises(RunRecordError, match="restart_count"):
        read_run_record(bad)


def test_a_training_thread_that_fails_during_the_hang_abort_waits_for_the_hang_exit_code():
    # Seen in a 3-process run: rank 0 aborted first, and rank 2's DDP all-reduce failed (its peer
    # closed the connection) before rank 2's own watchdog ended the process: exit 1, not 75.
    import subprocess
    import sys
    import textwrap

    from pace_strategy.core.watchdog import HANG_EXIT_CODE

    script = textwrap.dedent(
        f"""
        import os, threading, time
        from pace_strategy.core.hang_response import hold_uncaught_errors

        held = threading.Event()

        def watchdog():
            hold_uncaught_errors(30.0)  # as HangResponse does first
            held.set()
            time.sleep(1.0)  # evidence, then the exit
            os._exit({HANG_EXIT_CODE})

        threading.Thread(target=watchdog, daemon=True).start()
        held.wait(30)  # the training thread's collective fails once the abort has begun
        raise RuntimeError("Connection closed by peer")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == HANG_EXIT_CODE, done.stderr
    assert "failed while the hang abort runs: Connection closed by peer" in done.stderr
