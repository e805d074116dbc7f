"""The one example training job that the demo, the recipes and the benchmarks share (torch only).

An MLP on seeded random classification data, a slow data loader for injected input stalls, and the
progress line every app prints. The Lightning pieces (module, callbacks) are in
:mod:`pace_strategy.apps.lightning_job`; both are built from the sections of
:mod:`pace_strategy.apps.recipes`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from pace_strategy.testing import Straggler, sleep_injected

if TYPE_CHECKING:
    from pace_strategy.apps.recipes import ModelRecipe, TrainRecipe

__all__ = ["ProgressLine", "SlowCollate", "build_net", "make_dataset"]


def build_net(model: ModelRecipe) -> nn.Sequential:
    """``depth`` hidden blocks (Linear + ReLU, each its own submodule: an FSDP shard group when large
    enough), then a Linear to ``classes``."""
    layers: list[nn.Module] = []
    width_in = model.inputs
    for _ in range(model.depth):
        layers.append(nn.Sequential(nn.Linear(width_in, model.width), nn.ReLU()))
        width_in = model.width
    layers.append(nn.Linear(width_in, model.classes))
    return nn.Sequential(*layers)


def make_dataset(recipe: TrainRecipe, world_size: int) -> TensorDataset:
    """Exactly enough seeded samples for ``max_steps`` optimizer steps on ``world_size`` ranks."""
    trainer, data = recipe.trainer, recipe.data
    n = trainer.max_steps * trainer.accumulate * data.batch_size * world_size
    g = torch.Generator().manual_seed(data.seed)
    x = torch.randn(n, recipe.model.inputs, generator=g)
    return TensorDataset(x, torch.randint(0, recipe.model.classes, (n,), generator=g))


class SlowCollate:
    """Default collation, plus an injected input delay on chosen ranks (a slow data loader)."""

    def __init__(self, stragglers: Sequence[Straggler]) -> None:
        self.stragglers = list(stragglers)
        self.calls = 0

    def __call__(self, items: Any) -> Any:
        if self.stragglers:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            sleep_injected(self.stragglers, rank, self.calls)
        self.calls += 1
        return default_collate(items)


class ProgressLine:
    """Prints ``step N/TOTAL  T s`` every tenth of the run (the caller decides which rank prints)."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.quiet = total, quiet
        self.every = max(1, total // 10)
        self.t0 = time.monotonic()

    def start(self) -> None:
        self.t0 = time.monotonic()

    def step(self, step: int) -> None:
        if not self.quiet and (step % self.every == 0 or step == self.total):
            print(f"  step {step:>5}/{self.total}  {time.monotonic() - self.t0:6.1f} s", flush=True)
