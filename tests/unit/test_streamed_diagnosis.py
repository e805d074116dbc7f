"""The diagnosis reads a run's per-rank numbers a block of steps at a time (the digest): every number
it keeps is the one the whole ``[steps, ranks]`` arrays give, and a record read from disk block by
block (``load_lines``) is diagnosed exactly as the same record loaded whole (``load_arrays``)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.digest import digest_run, floor_rows, growth_rows
from pace_strategy.diagnose.findings import diagnose, diagnose_run
from pace_strategy.diagnose.noise import jitter_floor
from pace_strategy.diagnose.report import _bin_steps, render_report
from pace_strategy.telemetry import arrays as arrays_module
from pace_strategy.telemetry.arrays import DIAGNOSIS_SKIP, RunArrays, load_arrays, load_lines, sample_steps
from tests.unit.test_diagnose_findings import arrays as synthetic

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _close(x, y, path: str = "") -> None:
    """Equal, but floats to 1e-12 relative (the compute spread is merged over blocks)."""
    if isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), path
        for k in x:
            _close(x[k], y[k], f"{path}.{k}")
    elif isinstance(x, list):
        assert isinstance(y, list) and len(x) == len(y), path
        for i, (a, b) in enumerate(zip(x, y, strict=True)):
            _close(a, b, f"{path}[{i}]")
    elif isinstance(x, float):
        assert math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-12), (path, x, y)
    else:
        assert x == y, (path, x, y)


def _result(d) -> dict:
    out = d.to_dict()
    out.get("projection", {}).pop("seconds", None)  # how long the projection took
    return out


def _arrays(steps: int, world: int, seed: int = 0, per_node: int = 3) -> RunArrays:
    """A run whose numbers hold ties (waits on a 0.5 ms grid), an optimizer step, GC and samples."""
    rng = np.random.default_rng(seed)
    wait = np.round(rng.random((steps, world)) * 8) / 2
    compute = 30 + np.round(rng.normal(0, 1, (steps, world)), 3)
    data = np.round(rng.random((steps, world)), 3)
    opt = np.round(1 + rng.random((steps, world)), 3)
    gap = np.round(data + 2 * rng.random((steps, world)), 3)
    gc = np.where(rng.random((steps, world)) < 0.1, 12.0, 0.0)
    ranks = range(world)
    run = synthetic(
        compute,
        data=data,
        gap=gap,
        hosts=[f"h{r // per_node}" for r in ranks],
        nodes=[r // per_node for r in ranks],
        local=[r % per_node for r in ranks],
    )
    return dataclasses.replace(
        run,
        wait=wait,
        opt=opt,
        gc_ms=gc,
        gc_collections=(gc > 0).astype(float),
        samples=np.full((steps, world), 8.0),
        host_bound=rng.random((steps, world)) < 0.8,
        step_ms=np.round(40 + rng.random(steps), 3),
    )


@pytest.mark.parametrize("block", [7, 1000])  # steps per block: several blocks, or one
@pytest.mark.parametrize("max_rows", [4, 128])  # the heat map by node, or by rank
def test_the_digest_keeps_what_the_whole_arrays_give(block, max_rows, monkeypatch):
    steps, world = 50, 9
    monkeypatch.setattr(arrays_module, "_BLOCK_NUMBERS", block * world)
    a = _arrays(steps, world)
    cfg = DiagnosisConfig(
        max_heatmap_rows=max_rows, max_heatmap_columns=8, projection_calibration_steps=20, slow_ms_floor=3.6
    )
    d = digest_run(a, cfg)
    w = a.wait
    late = w.argmin(axis=1)
    assert np.array_equal(d.straggler, late) and np.array_equal(d.transfer, w.min(axis=1))
    assert np.array_equal(d.skew, w.max(axis=1) - w.min(axis=1))
    assert np.array_equal(d.median_wait, np.median(w, axis=1))
    assert np.array_equal(d.lost, (w - w.min(axis=1, keepdims=True)).mean(axis=1))
    before = a.opt[np.maximum(np.arange(steps) - 1, 0)]  # the optimizer step of the step before
    between = before + a.data
    fields = {"wait": w, "compute": a.compute, "data": a.data, "between": between,
              "loop": np.clip(a.gap - between, 0.0, None)}  # fmt: skip
    for name, x in fields.items():
        others = [np.median(np.delete(x[s], late[s])) for s in range(steps)]
        assert np.array_equal(d.others[name], others), name
        if name != "wait":
            assert np.array_equal(d.own[name], x[np.arange(steps), late]), name
    local = np.arange(world) % 3
    group = [np.median(w[s, local != local[late[s]]]) for s in range(steps)]
    assert d.local_others_wait is not None and np.array_equal(d.local_others_wait, group)
    assert d.gc is not None and d.host_bound is not None
    assert np.array_equal(d.gc.own, a.gc_ms[np.arange(steps), late])
    costly = d.skew >= cfg.slow_ms_floor  # the steps the GC check reads (the noise: above 5% of 40 ms)
    assert 0 < costly.sum() < steps and np.isnan(d.gc.others[~costly]).all()
    others = [np.median(np.delete(a.gc_ms[s], late[s])) for s in np.nonzero(costly)[0]]
    assert np.array_equal(d.gc.others[costly], others)
    assert sorted(d.gc.pauses) == sorted(a.gc_ms[a.gc_ms >= cfg.slow_ms_floor]) and d.gc.longest == 12.0
    assert d.gc.collections == float(a.gc_collections.sum())
    assert np.array_equal(d.host_bound, a.host_bound[np.arange(steps), late])
    np.testing.assert_allclose(d.compute_std, a.compute.std(axis=0), rtol=1e-12)
    np.testing.assert_allclose(d.compute_mean, a.compute.mean(axis=0), rtol=1e-12)
    # the sampled rows, whole
    assert d.floor == jitter_floor(w[floor_rows(steps)], a.step_ms) and d.floor.sigma_ms > 0
    assert np.array_equal(d.growth_wait, w[growth_rows(np.random.default_rng(0), steps)])
    rows = sample_steps(steps, 20)
    assert len(rows) == 20 and np.array_equal(d.sample_rows, rows)
    for name in ("wait", "compute", "data", "gap", "samples", "step_ms", "step"):
        assert np.array_equal(getattr(d.sample, name), getattr(a, name)[rows]), name
    # the heat map, bit for bit as the report binned the whole run's
    lead = w - w.min(axis=1, keepdims=True)
    if max_rows >= world:
        matrix = lead
    else:
        matrix = np.stack([lead[:, r : r + 3].mean(axis=1) for r in range(0, world, 3)], axis=1)
    edges = np.linspace(0, steps, 9).astype(int)  # the report's bins of 50 steps into 8
    binned = (
        np.stack([matrix[a:b].sum(axis=0) for a, b in itertools.pairwise(edges)]) / np.diff(edges)[:, None]
    )
    assert d.heat_binned and np.array_equal(d.heat, binned)  # whatever the blocks
    np.testing.assert_allclose(d.heat, _bin_steps(matrix, 8)[1], rtol=1e-12)


def test_without_an_optimizer_step_in_every_step_the_own_work_is_the_input(monkeypatch):
    monkeypatch.setattr(arrays_module, "_BLOCK_NUMBERS", 10 * 9)
    a = _arrays(30, 9)
    blocks = list(a.rank_blocks())
    del blocks[1]["opt"]  # a block whose steps lack it: the run has no optimizer step in every step
    monkeypatch.setattr(RunArrays, "rank_blocks", lambda self: iter(blocks))
    d = digest_run(a, DiagnosisConfig())
    assert np.array_equal(d.own["between"], d.own["data"]) and np.array_equal(
        d.others["between"], d.others["data"]
    )
    late = a.wait.argmin(axis=1)
    loop = np.clip(a.gap - a.data, 0.0, None)
    assert np.array_equal(d.own["loop"], loop[np.arange(30), late])


def _record(tmp_path: Path, fixture: str, form: str) -> Path:
    from pace_strategy.telemetry.convert import convert_record

    original = tmp_path / "jsonl"
    original.mkdir(exist_ok=True)
    shutil.copy(FIXTURES / fixture, original / "pace_run.jsonl")
    if form == "jsonl":
        return original
    pytest.importorskip("pyarrow")
    return convert_record(original, tmp_path / "arrow", to="arrow").parent


@pytest.mark.parametrize("form", ["jsonl", "arrow"])
@pytest.mark.parametrize("fixture", ["run4_transient.jsonl", "gc_pauses_2ranks.jsonl"])
def test_a_record_read_block_by_block_is_diagnosed_as_the_record_loaded_whole(
    fixture, form, tmp_path, monkeypatch
):
    run_dir = _record(tmp_path, fixture, form)
    whole = load_arrays(run_dir, skip=DIAGNOSIS_SKIP)
    lines = load_lines(run_dir)
    assert not hasattr(lines, "wait") and lines.steps == whole.steps
    assert np.array_equal(lines.step, whole.step) and np.array_equal(lines.step_ms, whole.step_ms)
    expected = _result(diagnose(whole))
    monkeypatch.setattr(arrays_module, "_BLOCK_NUMBERS", 37 * lines.world_size)  # many small blocks
    blocks = list(lines.rank_blocks())
    assert len(blocks) > 3 and all(len(b["wait"]) <= 37 for b in blocks)
    for name in ("wait", "compute", "data", "gap", "host_bound"):
        assert np.array_equal(np.concatenate([b[name] for b in blocks]), getattr(whole, name)), name
    _close(_result(diagnose(lines)), expected)
    # a selection of steps reads only those rows (a rebalanced run's kept split)
    keep = np.arange(whole.steps) % 3 != 1
    chosen = np.concatenate([b["compute"] for b in lines.select(keep).rank_blocks()])
    assert np.array_equal(chosen, whole.compute[keep])


def test_the_report_of_a_streamed_run_is_the_report_of_the_run_in_memory(tmp_path):
    run_dir = _record(tmp_path, "run4_transient.jsonl", "jsonl")
    cfg = DiagnosisConfig(max_heatmap_columns=50)
    lines, whole = load_lines(run_dir), load_arrays(run_dir)
    diagnosis, digest = diagnose_run(lines, cfg, project_ranks=None)
    streamed = render_report(lines, diagnosis, tmp_path / "streamed", cfg, digest)
    loaded = render_report(whole, diagnose(whole, cfg, project_ranks=None), tmp_path / "loaded", cfg)
    for name in ("skew", "lead_heatmap", "stragglers", "step_time", "delays"):
        assert streamed[name].read_bytes() == loaded[name].read_bytes(), name
    assert json.dumps(diagnosis.to_dict())  # serializable as pace diagnose --json prints it


def test_the_jitter_floor_in_place_and_by_blocks_of_ranks_is_the_floor_of_the_whole():
    rng = np.random.default_rng(3)
    wait, step_ms = np.round(rng.gamma(2.0, 1.5, (400, 300)), 3), 40 + rng.random(400)
    # the floor as the whole arrays give it: each rank's median over the steps removed, then the MAD
    late = wait.mean(axis=1, keepdims=True) - wait
    late = late - np.median(late, axis=0)
    late = np.abs(late - np.median(late))
    sigma = 1.4826 * float(np.median(late)) * math.sqrt(300 / 299)
    floor = jitter_floor(wait, step_ms)
    assert floor.sigma_ms == sigma and floor.ranks == 300
    kept = wait.copy()
    assert jitter_floor(kept, step_ms, overwrite_input=True) == floor
    assert not np.array_equal(kept, wait)  # overwritten, as asked
