"""A rank's device-mesh coordinates, read from a real DeviceMesh (one gloo process), in its placement."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pace_strategy.telemetry.topology import local_placement, mesh_caveats, mesh_coordinates


@pytest.fixture
def one_process(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_named_mesh_gives_this_rank_s_coordinates_by_our_names(one_process):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    assert mesh_coordinates(mesh) == {"dp_replicate": 0, "dp_shard": 0}
    # Lightning's ModelParallelStrategy names its dimensions in words: read as ours
    lightning = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    assert mesh_coordinates(lightning, pipeline_stage=3) == {"dp_shard": 0, "tp": 0, "pp": 3}
    placement = local_placement(0, torch.device("cpu"), coordinates=mesh_coordinates(lightning)).to_dict()
    assert (placement["dp_shard"], placement["tp"], placement["pp"], placement["cp"]) == (0, 0, None, None)


def test_what_cannot_be_read_fails_naming_it(one_process):
    with pytest.raises(ValueError, match="no dimension names"):
        mesh_coordinates(init_device_mesh("cpu", (1,)))
    with pytest.raises(ValueError, match="dimension 'experts' is none of dp_replicate"):
        mesh_coordinates(init_device_mesh("cpu", (1,), mesh_dim_names=("experts",)))
    with pytest.raises(ValueError, match="the mesh's pp coordinate is 0"):
        mesh_coordinates(init_device_mesh("cpu", (1,), mesh_dim_names=("pp",)), pipeline_stage=1)
    for stage in (-1, 1.5, True):
        with pytest.raises(ValueError, match="expected this rank's stage"):
            mesh_coordinates(pipeline_stage=stage)  # type: ignore[arg-type]
    assert mesh_coordinates() == {} and mesh_coordinates(pipeline_stage=0) == {"pp": 0}


def test_node_and_local_rank_come_from_torchrun_else_from_slurm(monkeypatch):
    """A plain loop started by ``srun`` without torchrun has SLURM's variables only: its placement
    still says where it runs (the locality diagnosis needs it); torchrun's win where both are set."""
    for name in ("NODE_RANK", "GROUP_RANK", "LOCAL_RANK", "SLURM_NODEID", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    cpu = torch.device("cpu")
    assert (local_placement(0, cpu).node_rank, local_placement(0, cpu).local_rank) == (-1, -1)
    monkeypatch.setenv("SLURM_NODEID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "5")
    assert (local_placement(0, cpu).node_rank, local_placement(0, cpu).local_rank) == (3, 5)
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert (local_placement(0, cpu).node_rank, local_placement(0, cpu).local_rank) == (1, 2)


def test_layouts_with_collectives_of_their_own_are_said_to_be_unreliable_per_rank_and_others_are_not():
    tp = [{"dp_shard": d, "tp": t} for d in (0, 1) for t in (0, 1)]
    (caveat,) = mesh_caveats(tp)
    assert "2 ranks per tensor-parallel group" in caveat and "which rank is slow is not reliable" in caveat
    cp = [{"dp_shard": d, "cp": c} for d in (0, 1) for c in (0, 1)]
    (caveat,) = mesh_caveats(cp)
    assert "2 ranks per context-parallel group" in caveat and "which rank is slow is not reliable" in caveat
    pp = [{"dp_shard": d, "pp": s} for d in (0, 1) for s in (0, 1, 2)]
    (caveat,) = mesh_caveats(pp)
    assert "a pipeline of 3 stages" in caveat and "which stage is slow is not reliable" in caveat
    assert len(mesh_caveats([{**a, **b} for a, b in zip(tp, cp, strict=True)])) == 2
    hsdp = [{"dp_replicate": r, "dp_shard": s} for r in (0, 1) for s in (0, 1)]
    assert mesh_caveats(hsdp) == []
    assert mesh_caveats([{"dp_shard": 0, "tp": 0}, {"dp_shard": 1, "tp": 0}]) == []  # tp size 1
    assert mesh_caveats([]) == []
