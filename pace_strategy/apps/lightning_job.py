"""The example job's Lightning pieces: the LightningModule and the callbacks the apps use (progress,
saving the weights, per-step times, fault injection)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import nn
from typing_extensions import override

from pace_strategy.apps.job import GcLoad, ProgressLine, build_net

if TYPE_CHECKING:
    from pace_strategy.apps.recipe_schema import ModelRecipe

__all__ = [
    "QUIET_TRAINER",
    "ExampleModule",
    "FailAt",
    "Progress",
    "SaveWeights",
    "ShardedExampleModule",
    "StepTimes",
]

#: Trainer settings of the apps: step-bounded, no bar/summary/checkpoints, log every step.
QUIET_TRAINER: dict[str, Any] = {
    "max_epochs": -1,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
}


class ExampleModule(L.LightningModule):
    """The MLP with SGD; each training step first sleeps ``compute_ms`` plus ``sample_ms`` per sample of
    its batch (stands in for accelerator time, so that two CPUs are not the bottleneck of a multi-rank
    run; 0 for real compute only). The step runs the blocks one by one, as many LightningModules do
    (never ``self.net``'s own ``forward``)."""

    def __init__(self, model: ModelRecipe) -> None:
        super().__init__()
        self.recipe = model
        self.net = build_net(model)
        self.gc_load: GcLoad | None = None

    @override
    def on_train_start(self) -> None:
        # per rank, once the rank is known; after the strategy's setup, as a real job's heap would be
        if self.recipe.gc_heap_objects or self.recipe.gc_garbage_objects:
            recipe = self.recipe
            self.gc_load = GcLoad(recipe.gc_heap_objects, recipe.gc_garbage_objects, self.global_rank)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        compute_ms = self.recipe.compute_ms + self.recipe.sample_ms * len(x)
        if compute_ms > 0:
            time.sleep(compute_ms / 1e3)
        if self.gc_load is not None:
            self.gc_load.step()
        h = x
        for layer in self.net:
            h = layer(h)
        return nn.functional.cross_entropy(h, y)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.recipe.lr)


class ShardedExampleModule(ExampleModule):
    """The unpaced FSDP baseline: Lightning's ``ModelParallelStrategy`` needs a ``configure_model`` that
    shards (``paced_fsdp`` auto-shards a module without one)."""

    def __init__(self, model: ModelRecipe, min_params: int) -> None:
        super().__init__(model)
        self.min_params = min_params

    @override
    def configure_model(self) -> None:
        from pace_strategy.hooks.fsdp import auto_shard_steps

        mesh = self.device_mesh
        assert mesh is not None  # set by ModelParallelStrategy before configure_model
        # the same layout paced_fsdp chooses: the module is the root group, its blocks by size
        auto_shard_steps(self, mesh["data_parallel"], min_params=self.min_params)


class Progress(L.Callback):
    """Rank 0 prints a progress line every tenth of the run (unless ``quiet``)."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.line = ProgressLine(total, quiet)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.line.start()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0:
            self.line.step(trainer.global_step)


class FailAt(L.Callback):
    """Fault injection: the chosen rank exits abruptly (no cleanup), as a crashed process would."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    @override
    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step >= self.step:
            print(f"[rank {self.rank}] fault injection: exiting at step {trainer.global_step}", flush=True)
            os._exit(17)


class SaveWeights(L.Callback):
    """Rank 0 saves the final full state_dict (FSDP shards are gathered first, on every rank)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        state = pl_module.state_dict()
        # Every rank holds the same kind of parameters, so every rank takes the same branch here.
        if any(isinstance(v, DTensor) for v in state.values()):
            state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
        if trainer.global_rank == 0:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            torch.save({k: v.detach().clone() for k, v in state.items()}, self.path)


class LogLoss(L.Callback):
    """The loss logged every step (``log_every_n_steps=1``) through the module's loggers, as a user's
    job logs it (``demo --log-loss``: what the tags share the loggers with)."""

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        pl_module.log("train_loss", outputs["loss"])


class StepTimes(L.Callback):
    """Rank 0 records the wall time between consecutive batch ends: the same ruler for every strategy."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.ends: list[float] = []

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0:
            self.ends.append(time.perf_counter())

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            steps_ms = [(b - a) * 1e3 for a, b in zip(self.ends[:-1], self.ends[1:], strict=True)]
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.path).write_text(json.dumps({"step_ms": steps_ms}))
