"""The columnar per-rank record (``record_format: arrow``): written by real sessions, read back by the
record reader, the arrays loader and ``pace diagnose`` exactly as the JSON lines are; a crash between
the two files loses only the steps whose rows were not written."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from pace_strategy.cli import main as pace_main  # noqa: E402
from pace_strategy.core.config import PacingConfig  # noqa: E402
from pace_strategy.core.errors import PacingConfigError  # noqa: E402
from pace_strategy.diagnose.command import main as diagnose_main  # noqa: E402
from pace_strategy.telemetry.arrays import load_arrays  # noqa: E402
from pace_strategy.telemetry.convert import convert_record  # noqa: E402
from pace_strategy.telemetry.run_record import RunRecordError, read_run_record  # noqa: E402
from tests.distributed.ranks import raise_first, run_ranks  # noqa: E402
from tests.unit.test_rebalance_policy import CFG, K, Model, rank_loop  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _arrays_equal(a, b) -> None:
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None, field.name
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True), field.name


def _diagnosis(run_dir: Path, capsys) -> dict:
    assert diagnose_main([str(run_dir), "--json", "--no-report"]) == 0
    result = json.loads(capsys.readouterr().out)
    result.pop("run_record")  # the path
    result.get("projection", {}).pop("seconds", None)  # how long the projection took
    return result


@pytest.mark.parametrize("fixture", ["run4_transient.jsonl", "gc_pauses_2ranks.jsonl"])
def test_a_recorded_run_reads_the_same_in_either_form(fixture, tmp_path, capsys):
    original = tmp_path / "jsonl"
    original.mkdir()
    shutil.copy(FIXTURES / fixture, original / "pace_run.jsonl")
    arrow = convert_record(original, tmp_path / "arrow", to="arrow")
    assert arrow.with_name("pace_run.ranks.arrow").is_file()
    lines = [json.loads(x) for x in arrow.read_text().splitlines()]
    assert not any("ranks" in x for x in lines if x["record"] == "step")  # the global stream only
    before, after = read_run_record(original), read_run_record(arrow)
    assert after.steps == before.steps and after.decisions == before.decisions and after.end == before.end
    _arrays_equal(load_arrays(original), load_arrays(arrow))
    assert _diagnosis(arrow.parent, capsys) == _diagnosis(original, capsys)
    assert pace_main(["convert", str(arrow), str(tmp_path / "back"), "--to", "jsonl"]) == 0  # and back
    back = tmp_path / "back" / "pace_run.jsonl"
    assert [json.loads(x) for x in back.read_text().splitlines()] == [
        json.loads(x) for x in (original / "pace_run.jsonl").read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """The slow device through real thread-rank sessions (rebalanced: shares change mid-run), once
    with each record format."""
    out = {}
    for form in ("jsonl", "arrow"):
        run_dir, tags = tmp_path_factory.mktemp(form), []
        cfg = dataclasses.replace(CFG, record_format=form)
        loop = functools.partial(rank_loop, model=Model(per_sample_ms=(0.5, 1.0)), steps=8 * K, cfg=cfg)
        raise_first(run_ranks(2, lambda r, g, loop=loop, d=run_dir, t=tags: loop(r, g, run_dir=d, tags=t)))
        out[form] = run_dir
    return out


def test_a_session_writes_the_columns_beside_the_global_stream(sessions):
    arrow, jsonl = sessions["arrow"] / "pace_run.jsonl", sessions["jsonl"] / "pace_run.jsonl"
    header = json.loads(arrow.read_text().splitlines()[0])
    assert header["rank_columns"] == {"file": "pace_run.ranks.arrow", "schema": "pace_strategy/rank-columns",
                                      "version": 1}  # fmt: skip
    steps = [json.loads(x) for x in arrow.read_text().splitlines() if '"record":"step"' in x]
    assert len(steps) == 8 * K and not any("ranks" in s for s in steps)
    table = pa.ipc.open_stream(str(arrow.with_name("pace_run.ranks.arrow"))).read_all()
    assert table.num_rows == 2 * 8 * K and table.column("rank").to_pylist()[:4] == [0, 1, 0, 1]
    assert table.schema.field("compute_ms").type == pa.float32()
    # the same run, the same numbers (ManualClock: both runs measure identical steps)
    assert read_run_record(arrow).steps == read_run_record(jsonl).steps
    _arrays_equal(load_arrays(arrow), load_arrays(jsonl))
    assert set(np.unique(load_arrays(arrow).samples)) == {24.0, 32.0, 40.0}  # the shares changed


def test_steps_whose_rows_were_never_written_are_dropped_as_truncated(sessions, tmp_path):
    shutil.copytree(sessions["arrow"], tmp_path / "run")
    columns = tmp_path / "run" / "pace_run.ranks.arrow"
    data = columns.read_bytes()
    columns.write_bytes(data[: len(data) - 40])  # the last window's batch cut off mid-write
    record = read_run_record(tmp_path / "run")
    assert record.truncated and 0 < len(record.steps) < 8 * K and len(record.steps) % K == 0
    arrays = load_arrays(tmp_path / "run")
    assert (
        arrays.truncated and arrays.steps == int(arrays.wait.shape[0]) < load_arrays(sessions["arrow"]).steps
    )


def test_a_columnar_file_of_another_run_is_refused(sessions, tmp_path):
    shutil.copytree(sessions["arrow"], tmp_path / "run")
    record = tmp_path / "run" / "pace_run.jsonl"
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    for line in lines:
        if line["record"] == "step":
            line["step"] += 1  # the steps of another run
    record.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(RunRecordError, match="not one run"):
        load_arrays(tmp_path / "run")
    with pytest.raises(RunRecordError, match="not of one run"):
        read_run_record(tmp_path / "run")
    (tmp_path / "run" / "pace_run.ranks.arrow").unlink()
    for read in (load_arrays, read_run_record):
        with pytest.raises(RunRecordError, match="is missing"):
            read(tmp_path / "run")


def test_the_record_format_is_checked_at_start():
    with pytest.raises(PacingConfigError, match="record_format='parquet'"):
        PacingConfig(record_format="parquet")


def test_a_wide_world_is_summarized_without_per_rank_objects(tmp_path):
    # Above per_rank_tag_limit with the columnar record, rank 0 builds no per-rank tuples: the tags
    # and the columns come out the same as from the full summaries.
    import torch

    from pace_strategy.core.records import NUM_FIELDS, Field
    from pace_strategy.core.summary import StepSummarizer
    from pace_strategy.telemetry.columnar import RankColumnsWriter
    from pace_strategy.telemetry.schema import step_metrics

    world, steps = 100, 6
    g = (
        torch.rand(world, steps, NUM_FIELDS, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        * 50
    )
    g[:, :, Field.STEP] = torch.arange(steps, dtype=torch.float64)
    g[:, :, Field.VALID] = 1.0
    g[:, :, Field.WARMUP] = 0.0
    for f in (Field.GC_COLLECTIONS, Field.SAMPLES, Field.HOST_BOUND):
        g[:, :, f] = g[:, :, f].round() % 2
    full, lean = StepSummarizer(50).summarize(g), StepSummarizer(50).summarize(g, per_rank=False)
    assert not lean[0].wait_ms and full[0].wait_ms
    assert [step_metrics(s, 64) for s in lean] == [step_metrics(s, 64) for s in full]
    assert "pace/lead_ms/median" in step_metrics(lean[0], 64)
    a, b = RankColumnsWriter(tmp_path / "a.arrow", world), RankColumnsWriter(tmp_path / "b.arrow", world)
    a.write(full)
    b.write_gathered(g)
    a.close()
    b.close()
    read = [pa.ipc.open_stream(str(tmp_path / n)).read_all() for n in ("a.arrow", "b.arrow")]
    assert read[0].num_rows == world * steps and read[0].equals(read[1])
