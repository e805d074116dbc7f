"""attach_pacing on accelerate's real Accelerator (one CPU process): the private lists it reads (pinned to
accelerate 1.16), attaching twice, config and run-directory precedence, and undoing the FSDP2
collectives. The multi-process hooks and detach are in tests/integration/test_accelerate.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch.utils.data import DataLoader, TensorDataset

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.integrations.accelerate import PacingHandle, attach_pacing
from pace_strategy.integrations.accelerate.attach import _prepared, _run_dir

pytestmark = pytest.mark.timeout(60)


def prepared(accelerator: Accelerator):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    return accelerator.prepare(model, optimizer, loader)


def test_the_prepared_objects_are_where_accelerate_1_16_keeps_them():
    # If this fails, accelerate moved Accelerator._optimizers / _dataloaders: update _prepared.
    accelerator = Accelerator(cpu=True)
    _, optimizer, loader = prepared(accelerator)
    assert _prepared(accelerator, "optimizer") == [optimizer]
    assert _prepared(accelerator, "dataloader") == [loader]


def test_a_moved_private_list_fails_loudly_and_says_what_to_pass():
    with pytest.raises(PacingConfigError, match=r"Accelerator\._optimizers.*Pass optimizer="):
        _prepared(SimpleNamespace(), "optimizer")
    with pytest.raises(PacingConfigError, match=r"Accelerator\._dataloaders.*Pass dataloaders="):
        _prepared(SimpleNamespace(_dataloaders=None), "dataloader")


def test_attaching_twice_raises_and_detach_allows_it_again():
    accelerator = Accelerator(cpu=True)
    model, _, _ = prepared(accelerator)
    handle = attach_pacing(accelerator, model)
    assert isinstance(handle, PacingHandle) and handle.attached and handle.session is None
    with pytest.raises(PacingConfigError, match=r"already paced.*detach"):
        attach_pacing(accelerator, model)
    handle.detach()
    assert not handle.attached
    with attach_pacing(accelerator, model) as again:
        assert again.attached
    assert not again.attached  # finish() detaches


def test_an_explicit_config_beats_pace_variables(monkeypatch):
    accelerator = Accelerator(cpu=True)
    model, _, _ = prepared(accelerator)
    monkeypatch.setenv("PACE_MODE", "forced")
    with attach_pacing(accelerator, model) as handle:
        assert handle.config.mode == "forced"
    with attach_pacing(accelerator, model, PacingConfig(mode="monitor")) as handle:
        assert handle.config.mode == "monitor"
    # pacing= as every adapter takes it: a PacingConfig or a mapping of its fields
    with attach_pacing(
        accelerator, model, pacing={"mode": "monitor", "rebalance": {"enabled": True}}
    ) as handle:
        assert handle.config.mode == "monitor" and handle.config.rebalance.enabled
    monkeypatch.delenv("PACE_MODE")
    with attach_pacing(accelerator, model) as handle:
        assert handle.config == PacingConfig()


def test_run_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("PACE_RUN_DIR", str(tmp_path / "env"))
    config = ProjectConfiguration(project_dir=str(tmp_path / "proj"), logging_dir=str(tmp_path / "logs"))
    with_dirs = Accelerator(cpu=True, project_config=config)
    assert _run_dir(with_dirs, tmp_path / "arg") == tmp_path / "arg"  # the argument first
    assert _run_dir(with_dirs, None) == tmp_path / "logs"  # then the trackers' directory
    assert _run_dir(Accelerator(cpu=True, project_dir=tmp_path / "proj"), None) == tmp_path / "proj"
    plain = Accelerator(cpu=True)
    assert _run_dir(plain, None) == tmp_path / "env"  # then $PACE_RUN_DIR
    monkeypatch.delenv("PACE_RUN_DIR")
    default = _run_dir(plain, None)
    assert default.parent == Path.cwd() / "pace_runs"


def test_unregister_restores_the_fsdp2_collectives_it_wrapped():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pace_strategy.hooks.fsdp import (
        PacedAllGather,
        _param_group,
        register_paced_collectives,
        unregister_paced_collectives,
    )

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        groups = [_param_group(m) for m in (model[0], model)]
        own = [(g._all_gather_comm, g._reduce_scatter_comm) for g in groups]
        assert register_paced_collectives(model, SimpleNamespace(clock_is_host_time=True)) == 2
        assert all(isinstance(g._all_gather_comm, PacedAllGather) for g in groups)
        assert unregister_paced_collectives(model) == 2
        assert [(g._all_gather_comm, g._reduce_scatter_comm) for g in groups] == own
        assert unregister_paced_collectives(model) == 0
    finally:
        dist.destroy_process_group()


def test_hsdp_times_the_replicate_all_reduce_through_the_group_s_hook_and_keeps_the_user_s():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pace_strategy.hooks.fsdp import (
        PacedReduceScatter,
        _param_group,
        register_paced_collectives,
        unregister_paced_collectives,
    )

    class Pacer:  # the two calls the all-reduce's timing makes, recorded
        clock_is_host_time = True

        def __init__(self):
            self.calls = []

        def enter_collective(self):
            self.calls.append("enter")
            return len(self.calls)

        def exit_collective(self, start):
            self.calls.append(("exit", start))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        fully_shard(model, mesh=mesh)  # a 2-D mesh: HSDP
        seen = []
        model.set_all_reduce_hook(seen.append)  # the user's own hook
        group = _param_group(model)
        pacer = Pacer()
        assert register_paced_collectives(model, pacer) == 1
        assert isinstance(group._reduce_scatter_comm, PacedReduceScatter) and group._is_hsdp
        # one rank: FSDP copies instead of reduce-scattering and then calls the all-reduce hook, which
        # ends no interval (the intervals at four ranks: tests/integration/test_meshes.py)
        model(torch.randn(3, 4)).sum().backward()
        assert pacer.calls == [("exit", None)], pacer.calls
        assert len(seen) == 1  # the user's hook still runs, after ours
        register_paced_collectives(model, pacer)  # again: composes over the user's, not over ours
        assert group._all_reduce_hook.previous == seen.append
        unregister_paced_collectives(model)
        assert group._all_reduce_hook == seen.append
    finally:
        dist.destroy_process_group()


def test_the_parallelism_config_s_mesh_coordinates_are_recorded(caplog):
    """The mesh accelerate builds from a ParallelismConfig (its state's device_mesh, named as
    accelerate names it) gives each rank's coordinates; a dimension the record has no name for
    (accelerate's ``sp``) leaves them out, said once. accelerate 1.16 refuses a ParallelismConfig on
    CPU processes (docs/accelerate.md), so the mesh is built here as accelerate builds it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pace_strategy.integrations.accelerate.attach import accelerator_coordinates

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        accelerator = SimpleNamespace(state=SimpleNamespace(device_mesh=mesh))
        assert accelerator_coordinates(accelerator) == {"dp_replicate": 0, "dp_shard": 0, "tp": 0}
        assert accelerator_coordinates(SimpleNamespace(state=SimpleNamespace(device_mesh=None))) is None
        sp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "sp"))
        with caplog.at_level("WARNING"):
            assert accelerator_coordinates(SimpleNamespace(state=SimpleNamespace(device_mesh=sp))) is None
        assert "device mesh is not recorded" in caplog.text and "'sp'" in caplog.text
    finally:
        dist.destroy_process_group()
