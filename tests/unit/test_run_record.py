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


# --- one typed class per kind of line: the writer builds them, the reader checks against them ---


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_written_line_is_one_of_the_typed_kinds_with_every_field_it_declares(tmp_path):
    import dataclasses

    from pace_strategy.telemetry.record_lines import LINE_KINDS, json_fields

    path = tmp_path / "pace_run.jsonl"
    write(path).close("failed", "boom", extra={"unresolved_steps_dropped": 2})
    lines = _lines(path)
    assert [line["record"] for line in lines] == ["header", "step", "step", "step", "step", "decision", "end"]
    for line in lines[1:]:
        required, added = json_fields(LINE_KINDS[line["record"]])
        declared = {**required, **{k: t for k, t in added.items() if k in line}}
        assert set(required) <= set(line) and all(type(line[k]) in t for k, t in declared.items()), line
    end = lines[-1]
    assert end == {
        "record": "end",
        "status": "failed",
        "steps": 4,
        "error": "boom",
        "unresolved_steps_dropped": 2,
    }
    assert "local_steps" not in end  # an omitted field while it is None
    assert "host_bound" not in lines[1]["ranks"]  # every rank host-bound: the sparse column is left out
    assert {f.name for f in dataclasses.fields(LINE_KINDS["header"])} >= {"schema", "version", "world_size"}


def _with_line(tmp_path, line):
    path = tmp_path / "pace_run.jsonl"
    write(path).close()
    lines = _lines(path)
    lines.insert(-1, line)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_a_field_added_later_may_be_absent_but_a_declared_one_may_not(tmp_path):
    # a hang line from before "behind", "stale" and "action" existed reads; one without "hosts" does not
    old = {"record": "hang", "ranks": [1], "step": 3, "waited_s": 20.0, "hosts": ["a"]}
    assert read_run_record(_with_line(tmp_path, old)).hangs == [old]
    with pytest.raises(RunRecordError, match="hang has no 'hosts' field"):
        read_run_record(_with_line(tmp_path, {k: v for k, v in old.items() if k != "hosts"}))
    # a later field, where present, is checked like the others
    with pytest.raises(RunRecordError, match=r"hang field 'stale'='x' is not a list"):
        read_run_record(_with_line(tmp_path, {**old, "stale": "x"}))
    with pytest.raises(RunRecordError, match=r"shares field 'from_step'='3' is not an integer or null"):
        shares = {"record": "shares", "window": 0, "after_step": 3, "state": "trial", "samples": [1, 1, 1]}
        shares.update(from_step="3", reason="r", baseline_step_ms=None, trial_step_ms=None)
        read_run_record(_with_line(tmp_path, shares))
    with pytest.raises(RunRecordError, match=r"end field 'steps'=True is not an integer"):
        path = tmp_path / "pace_run.jsonl"
        write(path).close()
        lines = _lines(path)
        lines[-1]["steps"] = True  # a bool is not a count
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        read_run_record(path)


def test_arrays_are_written_in_place_and_keep_every_value(tmp_path):
    import numpy as np

    import pace_strategy.telemetry.arrays as arrays

    path = tmp_path / "pace_run.jsonl"
    w = write(path, steps=10)
    w.close()
    lines = [x for x in _lines(path) if x["record"] == "step"]
    lines[4]["ranks"]["wait_ms"][1] = None  # a non-finite value, written as null
    text = "".join(json.dumps(x) + "\n" for x in [_lines(path)[0], *lines, *_lines(path)[-2:]])
    path.write_text(text.rstrip("\n"))  # the last line without its newline: still counted
    assert arrays._line_count(path) == 13
    a = arrays.load_arrays(path)
    expected = np.array([[np.nan if v is None else v for v in s["ranks"]["wait_ms"]] for s in lines])
    assert a.wait.shape == (10, 3) and np.array_equal(a.wait, expected, equal_nan=True)
    assert np.isnan(a.wait[4, 1]) and a.host_bound.shape == (10, 3) and a.host_bound.all()
    assert np.array_equal(a.compute, [s["ranks"]["compute_ms"] for s in lines])
