import json

import pytest

from pace_strategy.core.records import Decision, PolicyState
from pace_strategy.telemetry.run_record import RunRecordError, RunRecordWriter, read_run_record, summarize
from tests.unit.test_schema import summary


def write(path, steps=4):
    w = RunRecordWriter(
        path,
        world_size=3,
        config={"mode": "adaptive"},
        topology=[{"rank": r} for r in range(3)],
        framework="test",
    )
    w.write_window(
        [summary(3) for _ in range(steps)], Decision(0, PolicyState.MONITOR, (0.0, 0.0, 0.0), "monitoring")
    )
    return w


def test_write_and_read_back(tmp_path):
    path = tmp_path / "pace_run.jsonl"
    write(path).close()
    record = read_run_record(tmp_path)  # a directory works too
    assert record.world_size == 3 and len(record.steps) == 4 and len(record.decisions) == 1
    assert record.end["status"] == "completed" and not record.truncated
    s = summarize(record)
    assert s.steps == 4 and s.straggler_rank == 1 and s.straggler_share == 1.0
    assert s.skew_ms_p50 == 12.5 and s.pacing_active_share == 1.0
    assert "rank 1 in 100% of steps" in s.table()


def test_truncated_last_line_is_tolerated(tmp_path):
    path = tmp_path / "pace_run.jsonl"
    write(path)  # never closed: a crashed run
    with path.open("a") as f:
        f.write('{"record": "step", "ste')
    record = read_run_record(path)
    assert record.truncated and record.end is None and len(record.steps) == 4


@pytest.mark.parametrize("content", ["", "not json\n{}\n", json.dumps({"record": "header"}) + "\n"])
def test_bad_records_fail_clearly(tmp_path, content):
    path = tmp_path / "pace_run.jsonl"
    path.write_text(content)
    with pytest.raises(RunRecordError):
        read_run_record(path)


def test_missing_record(tmp_path):
    with pytest.raises(RunRecordError, match="no run record"):
        read_run_record(tmp_path)
