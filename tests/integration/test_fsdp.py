"""paced_fsdp: real Lightning Trainers, FSDP2 over 2 CPU processes with gloo, through the recipe."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pace_strategy.telemetry import TAGS, lead_tag, read_run_record
from tests.integration.helpers import diagnose_json, only_version_dir, read_scalars, run_recipe, why_failed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WARMUP = 5  # PacingConfig().warmup_steps
# 3 hidden blocks of >= 16k parameters each become their own group; the output layer stays with
# the root, the LightningModule itself: 4 groups. The example module's training_step calls the layers
# one by one (never self.net's forward), as many LightningModules do: the root gathers for the step.
GROUPS = 4


@pytest.mark.alone
def test_paced_fsdp_times_every_collective_and_names_the_straggler(tmp_path):
    out = run_recipe(
        tmp_path,
        "lightning_fsdp.yaml",
        "trainer.max_steps=40",
        "straggler.delay_ms=40",
        "model.compute_ms=10",
    )
    assert out.returncode == 0, why_failed(out.stderr, 4000)
    log_dir = only_version_dir(tmp_path, "lightning_fsdp")
    scalars = read_scalars(log_dir)
    for tag in (*TAGS, lead_tag(0), lead_tag(1)):
        assert sorted(scalars.get(tag, {})) == list(range(40)), f"{tag} not logged at every global step"
    post = range(WARMUP, 40)
    assert sum(scalars["pace/straggler_rank"][s] == 1.0 for s in post) / len(post) >= 0.9
    assert abs(statistics.median(scalars["pace/skew_ms"][s] for s in post) - 40.0) <= 12.0
    record = read_run_record(log_dir)
    assert record.end["status"] == "completed" and record.header["world_size"] == 2
    # each rank's place in the strategy's data_parallel x tensor_parallel mesh, by our names
    assert [(p["dp_shard"], p["tp"]) for p in record.header["topology"]] == [(0, 0), (1, 0)]
    # forward all-gathers (one per group), backward re-gathers (all but the root, which FSDP keeps
    # unsharded after forward) and one reduce-scatter per group: all timed, every step
    assert {s["buckets"] for s in record.steps} == {GROUPS + (GROUPS - 1) + GROUPS}
    # the straggler's lateness is its own compute, not the collectives
    compute = record.steps[-1]["ranks"]["compute_ms"]
    assert compute[1] - compute[0] > 25.0, compute


@pytest.mark.long
def test_forced_pacing_gives_weights_identical_to_unpaced_fsdp(tmp_path):
    args = ("trainer.max_steps=24", "straggler.delay_ms=30")
    plain = run_recipe(
        tmp_path,
        "lightning_fsdp.yaml",
        *args,
        "trainer.strategy=fsdp",
        "pacing=null",
        "output.name=plain",
        f"output.save_weights={tmp_path / 'plain.pt'}",
    )
    assert plain.returncode == 0, why_failed(plain.stderr, 4000)
    paced = run_recipe(
        tmp_path,
        "lightning_fsdp.yaml",
        *args,
        "output.name=paced",
        f"output.save_weights={tmp_path / 'paced.pt'}",
        "pacing.mode=forced",
        "pacing.exchange_every_steps=4",
        "pacing.max_delay_step_fraction=0.5",
    )
    assert paced.returncode == 0, why_failed(paced.stderr, 4000)
    record = read_run_record(only_version_dir(tmp_path, "paced"))
    delays = [s["ranks"]["delay_ms"][0] for s in record.steps]
    assert max(delays) > 1.0, f"pacing was never applied: {delays}"
    wa, wb = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "paced.pt")
    assert wa.keys() == wb.keys() and len(wa) == 8
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"{key} differs between unpaced and paced FSDP"


@pytest.mark.long
def test_paced_fsdp_with_tensor_parallelism_records_the_mesh_and_says_what_it_cannot_tell(tmp_path):
    """Lightning's ModelParallelStrategy with ``tensor_parallel_size=2`` under ``paced_fsdp`` (4 CPU
    processes, rank 1 slow in backward): it trains, every step is recorded with each rank's place in
    the mesh, and the diagnosis notes that a tensor-parallel member's slowness cannot be told apart
    (its peers wait for it inside the tensor-parallel collectives, which are not timed)."""
    job = Path(__file__).with_name("lightning_tp_job.py")
    done = subprocess.run(
        [sys.executable, str(job), str(tmp_path)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, why_failed(done.stderr, 4000)
    assert "pace_strategy: a tensor-parallel mesh (2 ranks per tensor-parallel group)" in done.stderr
    record = read_run_record(tmp_path)
    assert record.end["status"] == "completed" and record.header["world_size"] == 4
    coords = [(t["dp_shard"], t["tp"]) for t in record.header["topology"]]
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [s["step"] for s in record.steps] == list(range(24))
    notes = diagnose_json(tmp_path)["notes"]
    assert any(n.startswith("a tensor-parallel mesh (2 ranks per tensor-parallel group)") for n in notes)
    # slow rank 1's group, dp_shard 0 (ranks 0 and 1), arrives last: named, with its share of steps
    (group,) = [n for n in notes if n.startswith("the tensor-parallel group of ")]
    found = re.match(r"the tensor-parallel group of dp_shard 0 \(ranks 0, 1\) arrived last in (\d+)%", group)
    assert found and int(found.group(1)) >= 80, group


@pytest.mark.long
def test_paced_fsdp_with_hsdp_built_in_configure_model_times_the_replicate_all_reduce(tmp_path):
    """HSDP under ``paced_fsdp``: ``configure_model`` shards over a 2 x 2 mesh of its own
    (``dp_replicate`` x ``dp_shard``; 4 CPU processes, rank 1 slow in backward). The record has the
    coordinates of that mesh (read from the sharded parameters, not the strategy's
    ``data_parallel`` mesh), every collective of the plain HSDP loop is timed, the replicate
    all-reduce included (test_meshes.py), and the slow rank is named with its place."""
    job = Path(__file__).with_name("lightning_tp_job.py")
    done = subprocess.run(
        [sys.executable, str(job), str(tmp_path), "hsdp"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, why_failed(done.stderr, 4000)
    record = read_run_record(tmp_path)
    assert record.end["status"] == "completed" and record.header["world_size"] == 4
    coords = [(t["dp_replicate"], t["dp_shard"]) for t in record.header["topology"]]
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {s["buckets"] for s in record.steps} == {3 + 2 + 3 + 3}  # the 3 all-reduces included
    measured = [s for s in record.steps if not s["warmup"]]
    assert sum(s["straggler_rank"] == 1 for s in measured) >= 0.8 * len(measured)
    top = diagnose_json(tmp_path)["findings"][0]
    assert top["mode"] == "persistent_straggler" and top["ranks"] == [1], top
    assert "dp_replicate 0, dp_shard 1" in top["evidence"], top["evidence"]
