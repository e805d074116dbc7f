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
from pace_strategy.diagnose.findings import diagnose  # noqa: E402
from pace_strategy.telemetry.arrays import DIAGNOSIS_SKIP, load_arrays  # noqa: E402
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


@pytest.mark.parametrize("fixture", ["run4_transient.jsonl", "gc_pauses_2ranks.jsonl"])
def test_the_diagnosis_loads_only_what_it_reads_and_finds_the_same(fixture, tmp_path):
    original = tmp_path / "jsonl"
    original.mkdir()
    # the fixture's steps, paced: every third step delays its ranks (the step line's delay_ms_max
    # is their largest, as the writer writes it)
    lines = [json.loads(x) for x in (FIXTURES / fixture).read_text().splitlines()]
    for i, line in enumerate(x for x in lines if x["record"] == "step"):
        if i % 3 == 0:
            delays = [round(0.25 * ((i + r) % 5), 3) for r in range(len(line["ranks"]["delay_ms"]))]
            line["ranks"]["delay_ms"], line["delay_ms_max"] = delays, max(delays)
            line["pacing_active"] = max(delays) > 0
    (original / "pace_run.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    arrow = convert_record(original, tmp_path / "arrow", to="arrow").parent
    for run_dir in (original, arrow):
        full, lean = load_arrays(run_dir), load_arrays(run_dir, skip=DIAGNOSIS_SKIP)
        assert full.delay is not None and full.rank_step is not None
        assert lean.delay is None and lean.rank_step is None
        _arrays_equal(dataclasses.replace(full, delay=None, rank_step=None), lean)
        assert lean.host_bound is not None and lean.host_bound.dtype == bool
        # the report's delays: the step lines' largest delay, the same as the ranks' largest
        assert np.array_equal(lean.step_delay_max, full.step_delay_max) and (full.delay > 0).any()
        without = {"seconds"}
        assert _strip(diagnose(lean).to_dict(), without) == _strip(diagnose(full).to_dict(), without)
    with pytest.raises(ValueError, match=r"cannot skip \['wait'\]: only \['delay', 'rank_step'\]"):
        load_arrays(original, skip=("wait",))


def _strip(value, keys):
    if isinstance(value, dict):
        return {k: _strip(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [_strip(v, keys) for v in value]
    return value


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
                                      "version": 2}  # fmt: skip
    steps = [json.loads(x) for x in arrow.read_text().splitlines() if '"record":"step"' in x]
    assert len(steps) == 8 * K and not any("ranks" in s for s in steps)
    table = pa.ipc.open_stream(str(arrow.with_name("pace_run.ranks.arrow"))).read_all()
    assert table.num_rows == 2 * 8 * K and table.column("rank").to_pylist()[:4] == [0, 1, 0, 1]
    assert table.schema.field("compute_ms").type == pa.float32()
    # the same run, the same numbers (ManualClock: both runs measure identical steps)
    assert read_run_record(arrow).steps == read_run_record(jsonl).steps
    _arrays_equal(load_arrays(arrow), load_arrays(jsonl))
    a = load_arrays(arrow)
    assert set(np.unique(a.samples)) == {24.0, 32.0, 40.0}  # the shares changed
    assert a.tokens is not None and np.array_equal(a.tokens, 128 * a.samples)  # the forwards' tokens, summed


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
    # a node leader's shard of its ranks, consecutive or not, from either layout of the window
    from pace_strategy.core.comm import field_major
    from pace_strategy.telemetry.columnar import read_rank_columns

    laid_out = field_major(*g.shape)
    laid_out.copy_(g)
    whole, _, _ = read_rank_columns(tmp_path / "a.arrow", world)
    from pace_strategy.core.summary import node_steps, node_transfer

    # the leads' reference from every node's reductions (a node leader's), or from every rank
    nodes = torch.stack([node_steps(g[r : r + 10], range(r, r + 10)) for r in range(0, world, 10)])
    for ranks in ((1, 5, 7), tuple(range(3, 9))):
        for window, transfer in ((g, None), (laid_out, None), (laid_out, node_transfer(nodes))):
            shard = RankColumnsWriter(tmp_path / "shard.arrow", len(ranks), ranks=ranks)
            shard.write_gathered(window, transfer)
            shard.close()
            part, _, _ = read_rank_columns(tmp_path / "shard.arrow", len(ranks))
            assert set(part) == set(whole)
            for k, v in part.items():
                assert np.array_equal(v, whole[k][:, list(ranks)], equal_nan=True), (ranks, k)


def test_node_shards_merge_into_every_ranks_columns_up_to_the_shortest(tmp_path):
    from pace_strategy.telemetry.columnar import RankColumnsWriter, iter_shard_rows, read_shards, shard_steps

    rng = np.random.default_rng(0)
    written: dict[str, np.ndarray] = {}  # [steps, 5 ranks] of what each shard wrote
    expected_bound = np.ones((10, 5), dtype=bool)  # a step without host_bound: every rank bound

    def shard(name: str, ranks: list[int], steps: int) -> None:
        writer = RankColumnsWriter(tmp_path / name, len(ranks), ranks=ranks)
        for first in range(0, steps, 4):
            n = min(4, steps - first)
            cols = {k: np.round(rng.random((n, len(ranks))) * 10, 3) for k in ("compute_ms", "wait_ms")}
            if first % 8 == 0:  # host_bound in every other batch only
                cols["host_bound"] = rng.random((n, len(ranks))) > 0.5
                expected_bound[first : first + n, ranks] = cols["host_bound"]
            for k, v in cols.items():
                if k != "host_bound":
                    written.setdefault(k, np.full((10, 5), np.nan))[first : first + n, ranks] = v
            writer.write_rows(list(range(first, first + n)), cols)
        writer.close()

    shard("node0.arrow", [0, 2, 4], 10)
    shard("node1.arrow", [1, 3], 7)  # its leader stopped first: 7 steps
    shards = [("node0.arrow", [0, 2, 4]), ("node1.arrow", [1, 3])]
    names = ["compute_ms", "wait_ms", "host_bound"]
    for keep in (None, np.array([0, 2, 3, 5, 6, 8, 9])):
        columns, labels, truncated = read_shards(tmp_path, shards, 5, names, keep, flags=("host_bound",))
        rows = np.arange(7) if keep is None else keep[keep < 7]
        assert labels.tolist() == list(range(7)) and truncated
        for k in ("compute_ms", "wait_ms"):
            assert np.array_equal(columns[k], written[k][rows])
        assert columns["host_bound"].dtype == bool
        assert np.array_equal(columns["host_bound"], expected_bound[rows])
    # read a few steps at a time, as the streaming diagnosis reads them: the same rows, in order
    labels, truncated = shard_steps(tmp_path, shards, 5)
    assert labels.tolist() == list(range(7)) and truncated
    # chunks across the files' 4-step batches, up to the steps every file holds (7) or fewer
    for steps, chunk, sizes in ((None, 3, [3, 3, 1]), (5, 3, [3, 2]), (None, 256, [7])):
        blocks = list(
            iter_shard_rows(tmp_path, shards, 5, names, flags=("host_bound",), steps=steps, chunk_steps=chunk)
        )
        assert [len(b["wait_ms"]) for b in blocks] == sizes
        held = 7 if steps is None else steps
        for k in ("compute_ms", "wait_ms"):
            assert np.array_equal(np.concatenate([b[k] for b in blocks]), written[k][:held])
        assert np.array_equal(np.concatenate([b["host_bound"] for b in blocks]), expected_bound[:held])


def test_a_shard_writer_holds_windows_into_fewer_batches(tmp_path):
    from pace_strategy.telemetry.columnar import RankColumnsWriter, read_rank_columns

    rng = np.random.default_rng(1)
    windows = [np.round(rng.random((2, 3)) * 10, 3) for _ in range(5)]  # 2 steps x 3 ranks each

    def batches(path: Path) -> list[int]:
        with pa.OSFile(str(path)) as f:
            return [b.num_rows for b in pa.ipc.open_stream(f)]

    held = RankColumnsWriter(tmp_path / "held.arrow", 3, ranks=[4, 5, 6], min_batch_rows=10)
    each = RankColumnsWriter(tmp_path / "each.arrow", 3, ranks=[4, 5, 6], min_batch_rows=10, max_hold_s=0.0)
    for i, w in enumerate(windows):
        for writer in (held, each):
            writer.write_rows([2 * i, 2 * i + 1], {"wait_ms": w})
        if i == 0:  # 6 rows held, fewer than 10: nothing written yet
            assert not held.path.exists() and held.rows_written == 0 and each.rows_written == 6
    held.close()  # the last window's 6 rows, held until now
    each.close()
    assert batches(held.path) == [12, 12, 6] and batches(each.path) == [6] * 5
    for path in (held.path, each.path):
        columns, labels, truncated = read_rank_columns(path, 3, ["wait_ms"])
        assert labels.tolist() == list(range(10)) and not truncated
        assert np.array_equal(columns["wait_ms"], np.concatenate(windows))
