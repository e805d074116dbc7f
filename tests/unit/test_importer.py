"""``pace import table``: per-rank step tables recorded elsewhere become run records that ``pace diagnose``
reads unchanged; bad tables fail naming the file, row and column, with nothing written."""

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pace_strategy.cli import main as pace
from pace_strategy.diagnose import diagnose, load_arrays
from pace_strategy.telemetry.importer import TableImportError, import_ops, import_table

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def write_csv(path, columns, rows):
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)
    return path


def worker_table(path, compute, hosts=None):
    """One row per worker and iteration, the worker's mini-batch time as compute_ms (rank-major, as a
    per-worker export lists them)."""
    steps, world = compute.shape
    rows = [
        [r, s, f"{compute[s, r]:.3f}", *([hosts[r]] if hosts else [])]
        for r in range(world)
        for s in range(steps)
    ]
    return write_csv(path, ["rank", "step", "compute_ms", *(["host"] if hosts else [])], rows)


def diagnosed(tmp_path, table):
    out = tmp_path / "run"
    assert pace(["import", "table", str(table), str(out)]) == 0
    return diagnose(load_arrays(out), project_ranks=None)


def test_a_slow_group_in_an_imported_worker_table_is_named(tmp_path):
    # gamma-distributed mini-batch times (not the log-normal the rules were checked on), three of
    # ten workers 9% slower, each on its own host
    rng = np.random.default_rng(42)
    compute = rng.gamma(400.0, 0.25, (297, 10))  # ~100 ms, sd 5%
    compute[:, [1, 4, 8]] *= 1.09
    d = diagnosed(tmp_path, worker_table(tmp_path / "t.csv", compute, hosts=[f"n{r}" for r in range(10)]))
    top = d.findings[0]
    assert top.mode == "persistent_straggler" and top.ranks == [1, 4, 8], d.summary
    assert any("synchronous model" in n for n in d.notes)
    truth = float((compute.max(axis=1) - np.delete(compute, [1, 4, 8], axis=1).max(axis=1)).sum())
    assert abs(top.lost_step_fraction - truth / float(compute.max(axis=1).sum())) < 0.05


def test_an_episode_in_an_imported_table_is_named_with_its_steps(tmp_path):
    rng = np.random.default_rng(43)
    compute = rng.gamma(400.0, 0.25, (3000, 16))
    compute[1700:1830, 9] *= 1.35
    d = diagnosed(tmp_path, worker_table(tmp_path / "t.csv", compute))
    top = d.findings[0]
    assert top.mode == "straggler_episode" and top.ranks == [9], d.summary
    first, last = top.details["episodes"][0]["steps"]
    assert abs(first - 1700) <= 6 and abs(last - 1829) <= 6


def test_a_real_record_exported_as_a_table_diagnoses_the_same(tmp_path):
    """A record of a real 4-rank run here, written out as a table with its waits, read back."""
    shutil.copy(FIXTURES / "run4_transient.jsonl", tmp_path / "pace_run.jsonl")
    a = load_arrays(tmp_path)
    rows = [
        [r, int(a.step[i]), a.compute[i, r], a.wait[i, r], a.data[i, r], a.step_ms[i]]
        for i in range(a.steps)
        for r in range(a.world_size)
    ]
    table = write_csv(
        tmp_path / "real.csv", ["rank", "step", "compute_ms", "wait_ms", "data_ms", "step_ms"], rows
    )
    out = tmp_path / "imported"
    import_table(table, out)
    b = load_arrays(out)
    np.testing.assert_allclose(b.wait, a.wait, atol=1e-3)
    np.testing.assert_allclose(b.compute, a.compute, atol=1e-3)
    assert b.header["imported"]["waits"] == "recorded"
    before, after = diagnose(a, project_ranks=None), diagnose(b, project_ranks=None)
    # the hosts' threads and cores are the record's header, which a table does not carry: the crowded
    # host is the one finding read from it rather than from the timings (and, absent, leaves its share
    # of the waiting to the transient stragglers beside it)
    crowded = "host_oversubscription"
    assert crowded in [f.mode for f in before.findings]
    kept = [(f.mode, f.ranks) for f in before.findings if f.mode != crowded]
    assert [(f.mode, f.ranks) for f in after.findings] == kept
    assert before.stats["lost_step_fraction"] == pytest.approx(after.stats["lost_step_fraction"], abs=1e-4)


def test_parquet_with_mesh_coordinates_lands_in_the_topology(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    steps, world = 50, 4
    rank = np.tile(np.arange(world), steps)
    step = np.repeat(np.arange(steps), world)
    table = pa.table(
        {
            "rank": rank,
            "step": step,
            "step_ms": 100.0 + (rank == 3) * 20.0,
            "samples": np.full(steps * world, 8),
            "pp": rank % 2,
            "dp": rank // 2,
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    import_table(tmp_path / "t.parquet", tmp_path / "run")
    a = load_arrays(tmp_path / "run")
    assert a.topology("pp") == [0, 1, 0, 1] and a.topology("dp") == [0, 0, 1, 1]
    assert a.samples is not None and (a.samples == 8).all()
    # a worker's own iteration time with no waits in it is its compute; rank 3 is 20 ms slower
    np.testing.assert_allclose(a.wait[:, 0], 20.0) and np.testing.assert_allclose(a.wait[:, 3], 0.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rank,step,compute\n0,0,1\n", r"unknown column 'compute'. Did you mean 'compute_ms'\?"),
        ("rank,step,data_ms\n0,0,1\n", "at least one of the columns compute_ms, wait_ms, step_ms"),
        ("rank,compute_ms\n0,1\n", "no 'step' column"),
        ("rank,step,compute_ms\n0,0,1\n1,0,fast\n", r"line 3: column 'compute_ms': expected a finite number"),
        ("rank,step,compute_ms\n0,0,1\n0,0,2\n", "line 3: rank 0 step 0 appears twice"),
        ("rank,step,compute_ms\n0,0,1\n2,0,1\n", "rank 1 has no row"),
        ("rank,step,compute_ms\n0,0,1\n1,0,1\n0,1,1\n", "step 1 has no row for rank 1"),
        ("rank,step,compute_ms\n0,0,1\n1,0,\n", "line 3: column 'compute_ms' is empty"),
        ("rank,step,compute_ms\n0,0,1\n1.5,0,1\n", "line 3: column 'rank': expected a whole number"),
        ("rank,step,compute_ms\n0,0,1,9\n", "line 2: 4 fields for 3 columns"),
        (
            "rank,step,compute_ms,host\n0,0,1,a\n0,1,1,b\n",
            "line 3: column 'host': rank 0 is 'b' here and 'a' at line 2",
        ),
    ],
)
def test_a_bad_table_names_its_row_and_column_and_writes_nothing(tmp_path, capsys, text, message):
    table = tmp_path / "bad.csv"
    table.write_text(text)
    with pytest.raises(TableImportError, match=message) as e:
        import_table(table, tmp_path / "run")
    assert str(table) in str(e.value)
    assert pace(["import", "table", str(table), str(tmp_path / "run")]) == 2
    assert "pace import:" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv"]  # no record, no staging left


def test_an_existing_output_directory_is_refused(tmp_path):
    table = write_csv(tmp_path / "t.csv", ["rank", "step", "compute_ms"], [[0, 0, 1], [1, 0, 2]])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("mine")
    with pytest.raises(TableImportError, match="not an empty directory"):
        import_table(table, tmp_path / "run")
    assert (tmp_path / "run" / "keep.txt").read_text() == "mine"


def test_the_record_is_valid_json_lines_with_the_import_in_its_header(tmp_path):
    table = write_csv(
        tmp_path / "t.csv",
        ["rank", "step", "compute_ms"],
        [[r, s, 10 + r] for s in range(3) for r in range(2)],
    )
    path = import_table(table, tmp_path / "run")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [x["record"] for x in lines] == ["header", "step", "step", "step", "end"]
    assert lines[0]["imported"]["waits"] == "synchronous_model" and lines[-1]["status"] == "completed"


def op_rows(compute_ms, stage_of=None, *, transfer_ms=5.0, rng=None):
    """An op table of a synchronous job: per rank and step its input (2 ms), forward (a third of its
    compute), backward (the rest); where ``stage_of`` is given, a pipeline receive that waits behind the
    slowest stage; then its gradient all-reduce, which waits for the slowest rank of its data-parallel
    group (the same stage) plus the transfer; then its optimizer step (3 ms)."""
    steps, world = compute_ms.shape
    rows = []
    for s in range(steps):
        slowest = compute_ms[s].max()
        for r in range(world):
            c = compute_ms[s, r]
            t = 1000.0 * s
            ops = [("data", 2.0), ("forward", c / 3)]
            if stage_of is not None:
                ops.append(("pp_recv", slowest - c))
            ops.append(("backward", 2 * c / 3 - 2.0))
            peers = [q for q in range(world) if stage_of is None or stage_of[q] == stage_of[r]]
            ops += [("dp_collective", compute_ms[s, peers].max() - c + transfer_ms), ("optimizer", 3.0)]
            for op, d in ops:
                rows.append([r, s, op, f"{t:.3f}", f"{d:.3f}", *([stage_of[r], r // 4] if stage_of else [])])
                t += d
    return rows


def test_a_pipeline_stage_in_an_op_table_is_stage_imbalance_not_the_network(tmp_path):
    # data x pipeline, 8 workers in 4 stages; the last stage (loss, output layer) has 40% more work, so
    # the other stages wait in their pipeline receives
    rng = np.random.default_rng(44)
    stage_of = [r % 4 for r in range(8)]
    compute = 90.0 * rng.gamma(400.0, 1 / 400.0, (120, 8))
    compute[:, [3, 7]] *= 1.4
    table = write_csv(
        tmp_path / "ops.csv",
        ["rank", "step", "op", "start_ms", "duration_ms", "pp", "dp"],
        op_rows(compute, stage_of),
    )
    out = tmp_path / "run"
    assert pace(["import", "ops", str(table), str(out)]) == 0
    a = load_arrays(out)
    assert a.topology("pp") == stage_of and a.header["imported"]["format"] == "ops"
    np.testing.assert_allclose(a.compute, compute, atol=1e-2)  # the receives are not compute
    d = diagnose(a, project_ranks=None)
    modes = [f.mode for f in d.findings]
    assert modes[0] == "stage_imbalance" and d.findings[0].ranks == [3, 7], d.summary
    assert "fabric_contention" not in modes


def test_an_op_table_without_a_pipeline_measures_the_waits_of_its_collectives(tmp_path):
    rng = np.random.default_rng(45)
    compute = 50.0 * rng.gamma(400.0, 1 / 400.0, (100, 4))
    compute[:, 2] += 15.0
    table = write_csv(
        tmp_path / "ops.csv", ["rank", "step", "op", "start_ms", "duration_ms"], op_rows(compute)
    )
    import_ops(table, tmp_path / "run")
    a = load_arrays(tmp_path / "run")
    assert a.header["imported"]["waits"] == "recorded"
    np.testing.assert_allclose(a.wait, compute.max(axis=1, keepdims=True) - compute + 5.0, atol=1e-2)
    assert a.opt is not None and np.allclose(a.opt, 3.0) and np.allclose(a.data, 2.0)
    top = diagnose(a, project_ranks=None).findings[0]
    assert top.mode == "persistent_straggler" and top.ranks == [2]


def test_an_unknown_op_is_named_with_its_line(tmp_path):
    table = tmp_path / "ops.csv"
    table.write_text("rank,step,op,start_ms,duration_ms\n0,0,forward,0,1\n0,0,backwards,1,2\n")
    with pytest.raises(
        TableImportError, match=r"line 3: column 'op': 'backwards' is not an op \(did you mean 'backward'\?\)"
    ):
        import_ops(table, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_real_cpu_profiler_traces_name_the_rank_slow_in_backward(tmp_path):
    """Traces of a real 2-rank gloo DDP run here (tests/fixtures/record_profiler_traces.py): rank 1
    sleeps 15 ms in its backward."""
    out = tmp_path / "run"
    assert pace(["import", "torch-profiler", str(FIXTURES / "profiler_2ranks"), str(out)]) == 0
    a = load_arrays(out)
    assert a.world_size == 2 and a.steps == 12 and a.header["imported"]["waits"] == "recorded"
    late = float(np.median(a.compute[:, 1] - a.compute[:, 0]))
    lead = float(np.median(a.wait[:, 0] - a.wait[:, 1]))
    # a sleep is never shorter than asked; both signals see it (arrival = the end of the backward)
    assert 15.0 <= late <= 30.0 and 15.0 * 0.8 <= lead <= 30.0, (late, lead)
    top = diagnose(a, project_ranks=None).findings[0]
    assert top.mode == "persistent_straggler" and top.ranks == [1], top.evidence


def gpu_trace(rank, compute_ms, transfer_ms=3.0):
    """A synthetic GPU trace: per step, a host span, kernel launches (cudaLaunchKernel, correlated), a
    compute kernel of ``compute_ms[step]`` and an NCCL all-reduce kernel that ends when the slowest rank
    has arrived (``max(compute) + transfer``), then the optimizer's kernel."""
    events, corr = [], 0
    for n, (mine, slowest) in enumerate(compute_ms):
        t = 100_000.0 * n
        events.append(
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": t, "dur": 90_000.0}
        )
        kernels = [
            ("ampere_sgemm_128x64_nn", t + 1_000.0, mine * 1000.0, t + 100.0),
            (
                "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                t + 1_000.0 + 200.0,
                (slowest + transfer_ms) * 1000.0 - 200.0,
                t + 300.0,
            ),
            (
                "void at::native::vectorized_elementwise_kernel",
                t + 1_000.0 + (slowest + transfer_ms) * 1000.0,
                500.0,
                t + 50_000.0,
            ),
        ]
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "Optimizer.step#AdamW.step",
                "ts": t + 49_000.0,
                "dur": 2_000.0,
            }
        )
        for name, ts, dur, launched in kernels:
            corr += 1
            events.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "ts": launched,
                    "dur": 5.0,
                    "args": {"correlation": corr},
                }
            )
            events.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": name,
                    "ts": ts,
                    "dur": dur,
                    "args": {"correlation": corr},
                }
            )
    return {
        "traceEvents": events,
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
        "host_name": f"gpu{rank}",
    }


def test_a_gpu_trace_is_read_by_its_kernels(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    compute = np.array([[40.0, 52.0]] * 10)
    for r in range(2):
        pairs = [(compute[n, r], compute[n].max()) for n in range(10)]
        (traces / f"worker{r}.pt.trace.json").write_text(json.dumps(gpu_trace(r, pairs)))
    from pace_strategy.telemetry.importer import import_traces

    import_traces(traces, tmp_path / "run")
    a = load_arrays(tmp_path / "run")
    np.testing.assert_allclose(a.compute, compute, atol=1e-6)
    np.testing.assert_allclose(a.wait, compute.max(axis=1, keepdims=True) - compute + 3.0, atol=1e-6)
    assert a.topology("host") == ["gpu0", "gpu1"] and np.allclose(a.opt, 2.0)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"rank0.json": "{not json"}, "not a readable Chrome-trace JSON"),
        ({"rank0.json": '{"traceEvents": []}'}, "no ProfilerStep#N spans"),
        (
            {"a.json": '{"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "ts": 0, "dur": 1}]}'},
            "no distributedInfo.rank",
        ),
        ({}, "no \\*.json or \\*.json.gz trace files"),
    ],
)
def test_bad_traces_are_named(tmp_path, files, message):
    traces = tmp_path / "traces"
    traces.mkdir()
    for name, text in files.items():
        (traces / name).write_text(text)
    from pace_strategy.telemetry.importer import import_traces

    with pytest.raises(TableImportError, match=message):
        import_traces(traces, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_arrow_record_of_a_table_is_diagnosed_as_its_json_lines(tmp_path):
    pytest.importorskip("pyarrow")
    rng = np.random.default_rng(46)
    compute = rng.gamma(400.0, 0.25, (200, 12))
    compute[:, [2, 9]] *= 1.15
    table = worker_table(tmp_path / "t.csv", compute)
    assert pace(["import", "table", str(table), str(tmp_path / "arrow"), "--format", "arrow"]) == 0
    import_table(table, tmp_path / "jsonl")
    assert (tmp_path / "arrow" / "pace_run.ranks.arrow").exists()
    a, b = load_arrays(tmp_path / "arrow"), load_arrays(tmp_path / "jsonl")
    np.testing.assert_allclose(a.wait, b.wait) and np.testing.assert_allclose(a.compute, b.compute)
    da, db = diagnose(a, project_ranks=None), diagnose(b, project_ranks=None)
    assert [(f.mode, f.ranks) for f in da.findings] == [(f.mode, f.ranks) for f in db.findings]
    assert da.findings[0].ranks == [2, 9]


def test_a_table_larger_than_a_chunk_is_read_across_chunks(tmp_path, monkeypatch):
    """Rows are read a chunk at a time: a table of several chunks, its rows in rank-major order (each
    chunk holding a few ranks' steps), gives the arrays of the whole, and a duplicate in a later
    chunk is named with its line."""
    from pace_strategy.telemetry import importer

    monkeypatch.setattr(importer, "_CHUNK_ROWS", 7)
    rng = np.random.default_rng(47)
    compute = rng.gamma(400.0, 0.25, (10, 4))
    table = worker_table(tmp_path / "t.csv", compute, hosts=["a", "a", "b", "b"])
    t = importer.read_table(table)
    np.testing.assert_allclose(t.values["compute_ms"], compute, atol=1e-3)
    assert [p["host"] for p in t.placement] == ["a", "a", "b", "b"]
    lines = table.read_text().splitlines()
    (tmp_path / "dup.csv").write_text("\n".join([*lines, lines[5]]) + "\n")
    with pytest.raises(TableImportError, match=f"line {len(lines) + 1}: rank 0 step 4 appears twice"):
        importer.read_table(tmp_path / "dup.csv")


def test_step_labels_with_gaps_are_kept_as_recorded(tmp_path):
    rows = [[r, s, 10.0 + r] for s in (7, 3, 500, 12) for r in range(2)]  # a sampled export, any order
    table = write_csv(tmp_path / "t.csv", ["rank", "step", "compute_ms"], rows)
    import_table(table, tmp_path / "run")
    a = load_arrays(tmp_path / "run")
    assert a.step.tolist() == [3, 7, 12, 500] and np.allclose(a.compute, [[10.0, 11.0]] * 4)
