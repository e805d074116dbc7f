"""Device meshes paced with ``pace_strategy.attach`` in plain loops under torchrun: 4 CPU processes,
gloo, one launch (``mesh_script.py``): HSDP (2 replicas x 2 shards), whose replicate dimension's
gradient all-reduce is timed, and FSDP x tensor parallelism (2 x 2), whose tensor-parallel
collectives are part of each rank's compute. In each, forced pacing leaves the weights bit-identical
to the same layout unpaced; HSDP's slow rank is named with its place in the mesh."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pace_strategy.telemetry import read_run_record
from tests.integration.helpers import diagnose_json, free_port, read_scalars, why_failed

pytestmark = [pytest.mark.integration, pytest.mark.alone, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).resolve().parent / "mesh_script.py"
WORLD = 4
# HSDP: up, down and the root are groups: per step 3 forward all-gathers, 2 backward re-gathers
# (the root stays unsharded after forward), 3 reduce-scatters and 3 replicate all-reduces
HSDP_COLLECTIVES = 3 + 2 + 3 + 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("meshes")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr"]
    command = [*launch, "127.0.0.1", "--master_port", str(free_port()), str(SCRIPT), str(out)]
    done = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=220
    )
    assert done.returncode == 0, why_failed(done.stderr, 4000)
    return out


@pytest.mark.parametrize("layout", ["hsdp", "tp"])
def test_forced_pacing_leaves_the_weights_bit_identical_to_the_same_layout_unpaced(run, layout):
    plain, paced = torch.load(run / layout / "plain.pt"), torch.load(run / layout / "paced.pt")
    assert plain.keys() == paced.keys() and len(plain) == 8
    for key in plain:
        assert torch.equal(plain[key], paced[key]), key
    record = read_run_record(run / layout / "record")
    assert max(max(s["ranks"]["delay_ms"]) for s in record.steps) > 1.0, "pacing was never applied"


def _measured(record):
    return [s for s in record.steps if not s["warmup"]]


def _lead(step, k, of):
    """How long rank ``k`` waited beyond rank ``of`` (wait + delay: forced pacing moves part of a
    wait into the delay)."""
    r = step["ranks"]
    return r["wait_ms"][k] + r["delay_ms"][k] - r["wait_ms"][of]


def test_hsdp_times_the_replicate_all_reduce_and_records_the_mesh(run):
    record = read_run_record(run / "hsdp" / "record")
    assert record.end["status"] == "completed" and record.header["world_size"] == WORLD
    coords = [(t["dp_replicate"], t["dp_shard"]) for t in record.header["topology"]]
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {s["buckets"] for s in record.steps} == {HSDP_COLLECTIVES}
    measured = _measured(record)
    assert sum(s["straggler_rank"] == 1 for s in measured) >= 0.8 * len(measured)
    # rank 1's 30 ms, waited for by its shard peer in the reduce-scatters and by the other replica
    # in the all-reduce, give or take their own compute's few ms against rank 1's
    for k in (0, 2, 3):
        late = statistics.median(_lead(s, k, 1) for s in measured)
        assert 0.75 * 30.0 <= late <= 2 * 30.0, (k, late)
    # its compute reads the 30 ms (medians over the steps: 4 ranks on 2 cores make single steps noisy)
    compute = [statistics.median(s["ranks"]["compute_ms"][r] for s in measured) for r in range(WORLD)]
    assert compute[1] - max(compute[r] for r in (0, 2, 3)) > 0.67 * 30.0, compute


def test_hsdp_s_slow_rank_is_named_with_its_place_in_the_mesh(run):
    top = diagnose_json(run / "hsdp" / "record")["findings"][0]
    assert top["mode"] == "persistent_straggler" and top["ranks"] == [1], top
    assert "dp_replicate 0, dp_shard 1" in top["evidence"], top["evidence"]


def test_fsdp_x_tp_records_each_rank_s_place_and_times_the_data_parallel_collectives(run):
    # What a slow tensor-parallel member looks like is not asserted: its peers wait for it inside the
    # tensor-parallel collectives, which are not timed apart (docs/pytorch.md, "Device meshes")
    record = read_run_record(run / "tp" / "record")
    assert record.end["status"] == "completed"
    coords = [(t["dp_shard"], t["tp"]) for t in record.header["topology"]]
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # FSDP over dp_shard alone: 3 forward all-gathers, 2 backward re-gathers, 3 reduce-scatters
    assert {s["buckets"] for s in record.steps} == {3 + 2 + 3}
    # and the diagnosis says what it cannot tell on this mesh (HSDP's has no such note)
    caveat = "a tensor-parallel mesh (2 ranks per tensor-parallel group)"
    assert any(n.startswith(caveat) for n in diagnose_json(run / "tp" / "record")["notes"])
    assert not any(n.startswith(caveat) for n in diagnose_json(run / "hsdp" / "record")["notes"])


@pytest.mark.parametrize(("layout", "group"), [("hsdp", "replica_0"), ("tp", "dp_0")])
def test_above_the_per_rank_limit_the_tags_name_the_slow_rank_s_group(run, layout, group):
    """4 ranks, ``per_rank_tag_limit`` 2: one lead tag per replica (HSDP) or tensor-parallel group
    (FSDP x TP) instead of per rank, and at every step the group holding the record's straggler has
    lead 0. Under HSDP slow rank 1's replica 0 is last in most steps. Under FSDP x TP this forced
    run holds the other group back by about its lead, so the two groups arrive together and either
    may be last (11 and 14 of 22 steps in two runs): only the consistency is checked there."""
    scalars = read_scalars(run / layout / "tb")
    kind = group.split("_")[0]
    band = {"pace/lead_ms/median", "pace/lead_ms/min", "pace/lead_ms/max"}
    groups = {f"pace/lead_ms/{kind}_0", f"pace/lead_ms/{kind}_1"}
    assert {t for t in scalars if t.startswith("pace/lead_ms/")} == band | groups
    record = read_run_record(run / layout / "record")
    topology = {t["rank"]: t for t in record.header["topology"]}
    key = "dp_replicate" if kind == "replica" else "dp_shard"
    measured = _measured(record)
    for step in measured:
        straggler_group = topology[step["straggler_rank"]][key]
        assert scalars[f"pace/lead_ms/{kind}_{straggler_group}"][step["step"]] == 0.0, step["step"]
    if layout == "hsdp":
        last = [scalars[f"pace/lead_ms/{group}"][s["step"]] == 0.0 for s in measured]
        assert sum(last) >= 0.8 * len(measured), last


def test_fsdp_x_tp_s_diagnosis_names_the_tensor_parallel_group_that_arrived_last(run):
    """A group arrives with its last member: the diagnosis names the group that did most often, with
    its ranks and share (under this forced run either group may be last: the share is not bounded;
    the 30 ms case under monitor mode is test_fsdp.py's Lightning job)."""
    notes = diagnose_json(run / "tp" / "record")["notes"]
    (group,) = [n for n in notes if n.startswith("the tensor-parallel group of ")]
    assert re.match(
        r"the tensor-parallel group of dp_shard (0 \(ranks 0, 1\)|1 \(ranks 2, 3\)) arrived last in", group
    )
