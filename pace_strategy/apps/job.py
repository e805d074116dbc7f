"""The one example training job that the demo, the recipes and the benchmarks share (torch only).

An MLP on seeded random classification data, a slow data loader for injected input stalls, and the
progress line every app prints. The Lightning pieces (module, callbacks) are in
:mod:`pace_strategy.apps.lightning_job`; both are built from the sections of
:mod:`pace_strategy.apps.recipes`.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from pace_strategy.testing import Straggler, sleep_injected

if TYPE_CHECKING:
    from pace_strategy.apps.recipe_schema import ModelRecipe, TrainRecipe

__all__ = ["GcLoad", "ProgressLine", "Samples", "SlowCollate", "build_net", "make_dataset"]

#: steps a batch of the GC load's cyclic garbage stays referenced: long enough to survive two young
#: collections into the old generation, where only a full collection frees it
GC_GARBAGE_LIFETIME_STEPS = 3


def build_net(model: ModelRecipe) -> nn.Sequential:
    """``depth`` hidden blocks (Linear + ReLU, each its own submodule: an FSDP shard group when large
    enough), then a Linear to ``classes``. Block ``model.inject_after`` ends with an
    :class:`~pace_strategy.testing.slow.InjectionPoint`, where a ``backward`` or ``forward_backward``
    straggler spends its time (no parameters: the state dict's keys are the MLP's)."""
    from pace_strategy.testing.slow import InjectionPoint

    layers: list[nn.Module] = []
    width_in = model.inputs
    for index in range(1, model.depth + 1):
        block: list[nn.Module] = [nn.Linear(width_in, model.width), nn.ReLU()]
        if index == model.inject_after:
            block.append(InjectionPoint())
        layers.append(nn.Sequential(*block))
        width_in = model.width
    layers.append(nn.Linear(width_in, model.classes))
    return nn.Sequential(*layers)


class Samples(TensorDataset):
    """The demo's samples, with their lengths as a tokenized corpus has them (``lengths``): each is a
    vector of the model's inputs, so every length is that width, the same (uniform inputs: what
    cost-balanced batches, ``balance.enabled``, split evenly)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__(x, y)
        self.lengths = [int(x.shape[1])] * len(x)


def make_dataset(recipe: TrainRecipe, world_size: int) -> Samples:
    """Exactly enough seeded samples for ``max_steps`` optimizer steps on ``world_size`` ranks."""
    trainer, data = recipe.trainer, recipe.data
    n = trainer.max_steps * trainer.accumulate * data.batch_size * world_size
    g = torch.Generator().manual_seed(data.seed)
    x = torch.randn(n, recipe.model.inputs, generator=g)
    return Samples(x, torch.randint(0, recipe.model.classes, (n,), generator=g))


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


class GcLoad:
    """Makes the example job garbage-collector heavy, as a Python-heavy training loop is: a long-lived
    heap (``heap_objects`` small lists: think tokenizer tables, dataset indexes, module trees) and,
    every step, cyclic garbage that stays referenced for a few steps. The amount per step varies per
    rank (uniform 0.5-1.5 x ``garbage_objects``, seeded by rank), as per-rank data does, so each
    rank's collector reaches its full collections at its own steps."""

    def __init__(self, heap_objects: int, garbage_objects: int, rank: int, seed: int = 0) -> None:
        self.heap = [[i] for i in range(heap_objects)]
        self.garbage_objects = garbage_objects
        self._alive: deque[list[object]] = deque(maxlen=GC_GARBAGE_LIFETIME_STEPS)
        self._rng = random.Random(seed * 1_000_003 + rank)

    def step(self) -> None:
        """One step's garbage: ``garbage_objects`` (on average) self-referencing lists."""
        if self.garbage_objects <= 0:
            return
        count = int(self.garbage_objects * self._rng.uniform(0.5, 1.5))
        batch: list[object] = []
        for _ in range(count):
            cycle: list[object] = []
            cycle.append(cycle)
            batch.append(cycle)
        batch.append(batch)
        self._alive.append(batch)  # the batch it pushes out becomes cyclic garbage


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
