"""The strategy names resolve to the paced classes in both Lightning packages, and the Lightning
extension points the strategies rely on are still there (no training here)."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from datetime import timedelta
from subprocess import PIPE

import pytest
import torch

import pace_strategy  # registers the strategies
from pace_strategy.integrations import lightning as adapter
from pace_strategy.integrations._lightning_fsdp import configure_model_stand_in


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_registered_names_build_the_paced_strategies(package):
    pl = pytest.importorskip(package)
    expected = {
        "paced_ddp": "PacedDDPStrategy",
        "paced_ddp_spawn": "PacedDDPStrategy",
        "paced_ddp_fork": "PacedDDPStrategy",
        "paced_fsdp": "PacedFSDPStrategy",
    }
    for name, cls in expected.items():
        trainer = pl.Trainer(
            strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False
        )
        strategy = trainer.strategy
        assert type(strategy).__name__.endswith(cls), (name, type(strategy))
        assert strategy.pacing_config == pace_strategy.PacingConfig()
    fsdp = pl.Trainer(strategy="paced_fsdp", accelerator="cpu", devices=2, logger=False).strategy
    assert fsdp.auto_shard_min_params == 100_000 and isinstance(fsdp, pl.strategies.ModelParallelStrategy)


def test_bad_fsdp_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="auto_shard_min_params=0"):
        adapter.PacedFSDPStrategy(auto_shard_min_params=0)
    with pytest.raises(ValueError, match=r"PacingConfig\.max_delay_ms"):
        adapter.PacedFSDPStrategy(pacing={"max_delay_ms": -1})


ADAPTERS = {
    "lightning.pytorch": ("pace_strategy.integrations.lightning", "register_lightning_strategies"),
    "pytorch_lightning": (
        "pace_strategy.integrations.pytorch_lightning",
        "register_pytorch_lightning_strategies",
    ),
}


@pytest.mark.parametrize("package", list(ADAPTERS))
def test_the_register_function_maps_the_names_to_that_package_s_own_classes(package):
    pl = pytest.importorskip(package)
    module_name, register_name = ADAPTERS[package]
    module = importlib.import_module(module_name)
    register = getattr(module, register_name)
    register()
    register()  # idempotent
    expected = {
        "paced_ddp": (module.PacedDDPStrategy, {"start_method": "popen"}),
        "paced_ddp_spawn": (module.PacedDDPStrategy, {"start_method": "spawn"}),
        "paced_ddp_fork": (module.PacedDDPStrategy, {"start_method": "fork"}),
        "paced_fsdp": (module.PacedFSDPStrategy, {}),
    }
    for name, (cls, init_params) in expected.items():
        assert pl.strategies.StrategyRegistry[name]["init_params"] == init_params
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert type(trainer.strategy) is cls, (name, type(trainer.strategy))


IMPORT_ALONE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == {blocked!r}:
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
import {module} as adapter
adapter.{register}()
from {package}.strategies import StrategyRegistry
assert StrategyRegistry['paced_ddp']['strategy'] is adapter.PacedDDPStrategy
print('ok')
"""


@pytest.mark.long
def test_each_adapter_imports_and_registers_without_the_other_package():
    runs = []
    for package, blocked in (("lightning.pytorch", "pytorch_lightning"), ("pytorch_lightning", "lightning")):
        module, register = ADAPTERS[package]
        code = IMPORT_ALONE.format(blocked=blocked, module=module, register=register, package=package)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        runs.append(
            subprocess.Popen([sys.executable, "-c", code], stdout=PIPE, stderr=PIPE, text=True, env=env)
        )
    for run in runs:
        stdout, stderr = run.communicate(timeout=90)
        assert run.returncode == 0 and stdout.strip() == "ok", stderr[-3000:]


@pytest.mark.parametrize("package", list(ADAPTERS))
def test_lightning_still_has_the_private_mesh_size_paced_fsdp_sets(package):
    # _lightning_fsdp._set_data_parallel_size writes it (Lightning 2.6 has no public way): if this
    # fails, Lightning renamed the attribute or stopped reading it in setup_environment.
    pl = pytest.importorskip(package)
    strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=3)
    assert strategy._data_parallel_size == 3
    assert "self._data_parallel_size" in inspect.getsource(
        pl.strategies.ModelParallelStrategy.setup_environment
    )


@pytest.mark.parametrize(("tensor_parallel", "data_parallel"), [("auto", 4), (2, 2)])
def test_paced_fsdp_defaults_to_data_parallelism_over_the_world(tensor_parallel, data_parallel):
    strategy = adapter.PacedFSDPStrategy(tensor_parallel_size=tensor_parallel)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.num_nodes = 2
    strategy.sharding.resolve_data_parallel_size()  # what setup_environment does first
    assert strategy._data_parallel_size == data_parallel
    assert strategy._tensor_parallel_size == (1 if tensor_parallel == "auto" else tensor_parallel)
    fixed = adapter.PacedFSDPStrategy(data_parallel_size=3)
    fixed.sharding.resolve_data_parallel_size()
    assert fixed._data_parallel_size == 3


def test_the_configure_model_stand_in_satisfies_lightning_only_while_it_is_needed():
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    module = LightningModule()
    assert not is_overridden("configure_model", module)
    with pytest.raises(RuntimeError, match="boom"), configure_model_stand_in(module):
        assert is_overridden("configure_model", module)  # what ModelParallelStrategy.setup checks
        raise RuntimeError("boom")
    assert not is_overridden("configure_model", module)
    assert "configure_model" not in vars(module) and "configure_model" not in vars(LightningModule)

    class OwnHook(LightningModule):
        def configure_model(self):
            pass

    own = OwnHook()
    with configure_model_stand_in(own):
        assert "configure_model" not in vars(own)  # the user's own hook is left alone
    assert is_overridden("configure_model", own)


def test_the_user_comm_hook_and_its_wrapper_are_kept_for_configure_ddp():
    def hook(state, bucket): ...

    wrapped = []

    def wrapper(inner):
        wrapped.append(inner)
        return "the wrapped hook"

    state = object()
    strategy = adapter.PacedDDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook, ddp_comm_wrapper=wrapper)
    assert strategy.user_comm_hook.state is state
    assert strategy.user_comm_hook.inner_hook() == "the wrapped hook" and wrapped == [hook]
    assert adapter.PacedDDPStrategy(ddp_comm_hook=hook).user_comm_hook.inner_hook() is hook
    assert adapter.PacedDDPStrategy().user_comm_hook.inner_hook() is None


def _drop_in_arguments(parent):
    """A distinct value for every parameter ``parent.__init__`` takes positionally, in order."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    values = {
        "accelerator": "cpu-accelerator",
        "parallel_devices": [torch.device("cpu")] * 3,
        "cluster_environment": LightningEnvironment(),
        "checkpoint_io": "checkpoint-io",
        "precision_plugin": "precision",
        "precision": "precision",
        "ddp_comm_state": "state",
        "ddp_comm_hook": "hook",
        "ddp_comm_wrapper": "wrapper",
        "model_averaging_period": 7,
        "process_group_backend": "gloo",
        "timeout": timedelta(seconds=77),
        "start_method": "spawn",
        "data_parallel_size": 3,
        "tensor_parallel_size": 1,
        "save_distributed_checkpoint": False,
    }
    params = list(inspect.signature(parent.__init__).parameters.values())[1:]
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    return positional, [values[name] for name in positional]


def _state(strategy):
    """What a strategy's constructor stored, less what pacing adds and the comm hook (which the paced
    strategy registers itself instead of handing to Lightning)."""
    skip = {"pacing", "user_comm_hook", "sharding", "_ddp_comm_hook", "_ddp_comm_wrapper"}
    skip.add("_tensor_parallel_size")  # "auto" is 1 for paced_fsdp: pure data parallelism
    plain = (str, int, float, bool, type(None), list, timedelta)
    return {
        k: (v if isinstance(v, plain) else type(v).__name__)  # objects each constructor makes anew
        for k, v in vars(strategy).items()
        if k not in skip
    }


def _paced_and_parent():
    import lightning.fabric.strategies as fabric_strategies
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from pace_strategy.integrations.fabric import PacedFabricDDPStrategy

    pairs = [
        (adapter.PacedDDPStrategy, DDPStrategy),
        (adapter.PacedFSDPStrategy, ModelParallelStrategy),
        (PacedFabricDDPStrategy, fabric_strategies.DDPStrategy),
    ]
    try:
        import pytorch_lightning as standalone

        from pace_strategy.integrations import pytorch_lightning as standalone_adapter
    except ImportError:
        return pairs
    pairs += [
        (standalone_adapter.PacedDDPStrategy, standalone.strategies.DDPStrategy),
        (standalone_adapter.PacedFSDPStrategy, standalone.strategies.ModelParallelStrategy),
    ]
    return pairs


@pytest.mark.parametrize(("paced", "parent"), _paced_and_parent(), ids=lambda c: c.__module__ + c.__name__)
def test_a_paced_strategy_takes_its_parent_s_arguments_in_the_same_positions(paced, parent):
    names, args = _drop_in_arguments(parent)
    assert len(names) >= 2  # every parent takes several positionally; all of them are given here
    for count in (1, len(args)):  # the first alone (PacedDDPStrategy(accelerator)), then all
        plain, ours = parent(*args[:count]), paced(*args[:count], pacing={"max_delay_ms": 5.0})
        assert _state(ours) == _state(plain), names[:count]
        assert ours.pacing_config.max_delay_ms == 5.0
    if hasattr(ours, "user_comm_hook"):  # given positionally, the hook is still the paced strategy's
        assert (ours.user_comm_hook.state, ours.user_comm_hook.hook) == ("state", "hook")
        assert ours.user_comm_hook.wrapper == "wrapper" and ours._ddp_comm_state == "state"
    with pytest.raises(TypeError, match="positional"):
        paced(*args, "one too many")
    with pytest.raises(TypeError, match="multiple values"):
        paced(args[0], **{names[0]: args[0]})
