"""PacingSession on one process: telemetry goes to the sinks it has, and costs nothing without any."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import pace_strategy.session
import pace_strategy.telemetry.sinks
from pace_strategy.core.config import PacingConfig
from pace_strategy.session import PacingSession
from pace_strategy.telemetry.run_record import read_run_record


def _session(tmp_path, **kwargs) -> PacingSession:
    config = PacingConfig(exchange_every_steps=4, warmup_steps=0, **kwargs.pop("config", {}))
    return PacingSession.start(
        config, rank=0, world_size=1, device=torch.device("cpu"), group=None, framework="test", **kwargs
    )


def _train(session: PacingSession, steps: int) -> list:
    results = []
    done = torch.futures.Future()
    done.set_result(torch.zeros(1))
    for step in range(steps):
        session.pacer.begin_step(step)
        session.pacer.enter_sync()
        session.pacer.sync_done_callback()(done)
        if (result := session.end_step()) is not None:
            results.append(result)
    return results


def test_every_step_reaches_the_metrics_sink_and_the_run_record(tmp_path):
    logged: dict[int, dict] = {}
    session = _session(tmp_path, log_dir=tmp_path, metrics_sink=lambda m, step: logged.update({step: m}))
    _train(session, 12)
    session.finish()
    assert sorted(logged) == list(range(12)) and "pace/skew_ms" in logged[0]
    assert session.record_path is not None and session.record_path.exists()
    assert session.publisher.publish_ns > 0  # the telemetry thread ran


def test_tag_every_steps_thins_the_tags_and_never_the_record(tmp_path):
    logged: dict[int, dict] = {}
    session = _session(
        tmp_path,
        log_dir=tmp_path,
        metrics_sink=lambda m, step: logged.update({step: m}),
        config={"tag_every_steps": 5},
    )
    _train(session, 23)
    session.finish()
    assert sorted(logged) == [0, 5, 10, 15, 20]  # multiples of 5, across window boundaries
    assert [s["step"] for s in read_run_record(tmp_path).steps] == list(range(23))
    with pytest.raises(ValueError, match="tag_every_steps"):
        PacingConfig(tag_every_steps=0)


def test_by_default_the_tags_follow_the_framework_s_logging_interval():
    from types import SimpleNamespace

    from pace_strategy.integrations.huggingface import logging_interval

    assert PacingConfig().tag_every_steps is None
    assert PacingConfig().tagging_every(50).tag_every_steps == 50  # Lightning's log_every_n_steps
    assert PacingConfig(tag_every_steps=1).tagging_every(50).tag_every_steps == 1  # set: kept
    assert PacingConfig().tagging_every(0).tag_every_steps == 1
    # the HF Trainer's logging_steps: a number of steps, or a fraction of max_steps; other strategies: 1
    assert logging_interval(SimpleNamespace(logging_strategy="steps", logging_steps=10), None) == 10
    fraction = SimpleNamespace(logging_strategy="steps", logging_steps=0.1)
    assert logging_interval(fraction, SimpleNamespace(max_steps=95)) == 10
    assert logging_interval(SimpleNamespace(logging_strategy="epoch", logging_steps=10), None) == 1


def test_a_sink_of_our_own_gets_every_window_off_the_training_thread_and_is_closed(tmp_path):
    import threading

    class Collect:  # the whole protocol: write, hang, close
        def __init__(self) -> None:
            self.steps: list[int] = []
            self.threads: set[str] = set()
            self.closed = 0

        def write(self, window) -> None:
            self.steps += [s.step for s in window.summaries]
            self.threads.add(threading.current_thread().name)
            assert window.result.decision is not None and window.tags

        def hang(self, line) -> None:
            raise AssertionError("no hang in this run")

        def close(self) -> None:
            self.closed += 1

    sink = Collect()
    session = _session(tmp_path, log_dir=tmp_path, sinks=[sink])
    _train(session, 12)
    session.finish()
    assert sink.steps == list(range(12)) and sink.threads == {"pace-telemetry"} and sink.closed == 1
    assert [type(s).__name__ for s in session.publisher.sinks] == ["RecordSink", "Collect"]


def test_without_sinks_no_telemetry_thread_runs_but_warnings_are_still_logged(tmp_path, caplog):
    session = _session(tmp_path, config={"run_record": False})
    results = _train(session, 12)
    assert len(results) >= 2  # windows did complete...
    assert not session.publisher.started and session.publisher.publish_ns == 0  # ...and nothing ran for them
    with caplog.at_level(logging.WARNING, logger="pace_strategy.telemetry.sinks"):
        session.publish(dataclasses.replace(results[0], warnings=("rank 3 is a persistent straggler",)))
    assert "rank 3 is a persistent straggler" in caplog.text
    session.finish()


def test_the_constructor_is_local_and_takes_the_gathered_topology(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("the constructor ran a collective")

    monkeypatch.setattr(pace_strategy.session, "gather_json", no_collective)
    monkeypatch.setattr(pace_strategy.telemetry.sinks, "gather_json", no_collective)
    topology = [{"rank": r, "host": f"node{r}"} for r in range(2)]
    kwargs = dict(rank=1, world_size=2, device=torch.device("cpu"), group=None, framework="test")
    session = PacingSession(PacingConfig(), topology=topology, **kwargs)
    assert session.topology == topology and session.record is None
    with pytest.raises(ValueError, match="topology has 1 placements but world_size is 2"):
        PacingSession(PacingConfig(), topology=topology[:1], **kwargs)


def test_start_gathers_this_ranks_placement(tmp_path):
    session = _session(tmp_path, local_rank=3)
    (placement,) = session.topology
    assert placement["rank"] == 0 and placement["local_rank"] == 3
    session.close()


def test_the_run_record_is_created_at_its_first_write_not_at_start(tmp_path):
    run_dir = tmp_path / "run"
    session = _session(tmp_path, log_dir=run_dir)
    assert session.record_path == run_dir / "pace_run.jsonl"
    assert not run_dir.exists() and not session.record_created  # started: nothing on disk yet
    _train(session, 3)  # less than a window
    assert not run_dir.exists()
    _train(session, 4)
    session.finish()
    assert session.record_created
    record = read_run_record(run_dir)
    assert record.end["status"] == "completed" and len(record.steps) == 7


@pytest.mark.parametrize("end", ["finish", "close", "fail"])
def test_a_session_that_never_stepped_leaves_nothing(tmp_path, end):
    run_dir = tmp_path / "run"
    session = _session(tmp_path, log_dir=run_dir)
    if end == "fail":
        session.fail(RuntimeError("boom"))
    else:
        getattr(session, end)()
    assert not run_dir.exists() and not session.record_created


def test_a_run_that_failed_before_its_first_window_keeps_a_record_of_the_failure(tmp_path, caplog):
    session = _session(tmp_path, log_dir=tmp_path / "run")
    _train(session, 2)
    with caplog.at_level(logging.ERROR, logger="pace_strategy.session"):
        session.fail(RuntimeError("boom"))
    record = read_run_record(tmp_path / "run")
    assert record.end["status"] == "failed" and "boom" in record.end["error"] and record.steps == []
    assert f"run record kept at {session.record_path}" in caplog.text


def test_gpu_placement_facts_come_from_sysfs(tmp_path):
    from pace_strategy.telemetry.topology import affinity_within_numa, local_placement, pci_numa_node

    pci = tmp_path / "bus/pci/devices/0000:17:00.0"
    pci.mkdir(parents=True)
    (pci / "numa_node").write_text("1\n")
    node = tmp_path / "devices/system/node/node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("32-63\n")
    assert pci_numa_node("0000:17:00.0", sysfs=tmp_path) == 1
    assert pci_numa_node("0000:99:00.0", sysfs=tmp_path) is None
    assert affinity_within_numa({40, 41}, 1, sysfs=tmp_path) is True
    assert affinity_within_numa({0, 40}, 1, sysfs=tmp_path) is False  # pinned across both sockets
    assert affinity_within_numa({0}, 0, sysfs=tmp_path) is None  # node 0 not described
    cpu = local_placement(0, torch.device("cpu"))  # on CPU every GPU fact is absent, not guessed
    assert (cpu.gpu_uuid, cpu.pci_bus_id, cpu.numa_node, cpu.affinity_on_gpu_numa) == (None,) * 4


def test_the_side_group_interface_follows_the_jobs_own_route(monkeypatch):
    from pace_strategy.core.netif import gloo_interface

    for name in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert gloo_interface()[0] is None  # no MASTER_ADDR: gloo's own choice
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert gloo_interface()[0] == "lo"  # the interface holding the route's source address
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    interface, why = gloo_interface()  # several nodes: loopback cannot be right, and it says so
    assert interface is None and "set GLOO_SOCKET_IFNAME" in why
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert gloo_interface() == ("eth7", "GLOO_SOCKET_IFNAME")  # what the user set always wins


def test_a_tag_writer_that_falls_behind_loses_tags_of_whole_windows_never_record_rows(tmp_path, monkeypatch):
    import threading

    import pace_strategy.telemetry.sinks

    # the library's own bound (the suite raises it: tests/conftest.py)
    MAX_TAG_BACKLOG_WINDOWS = 4
    monkeypatch.setattr(pace_strategy.telemetry.sinks, "MAX_TAG_BACKLOG_WINDOWS", MAX_TAG_BACKLOG_WINDOWS)

    release = threading.Event()
    logged: dict[int, dict] = {}

    def slow_sink(metrics, step):  # a TensorBoard writer stuck on its disk until released
        release.wait(30)
        logged[step] = metrics

    session = _session(tmp_path, log_dir=tmp_path, metrics_sink=slow_sink)
    _train(session, 4 * 12)  # 12 windows of 4 steps while the sink is stuck on the first
    dropped = session.publisher.tag_windows_dropped
    # the first window is in the sink, MAX_TAG_BACKLOG_WINDOWS windows waited: every later one drops its tags
    assert dropped >= 12 - 1 - MAX_TAG_BACKLOG_WINDOWS - 1, dropped
    release.set()
    session.finish()
    record = read_run_record(session.record_path)
    assert [s["step"] for s in record.steps] == list(range(48))  # every row, whatever the tags
    assert record.end["tag_windows_dropped"] == session.publisher.tag_windows_dropped >= dropped
    assert 0 < len(logged) <= 48 - 4 * dropped and set(logged) < set(range(48))
