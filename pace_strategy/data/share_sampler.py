"""The rebalancing data path (torch only): :class:`ShareBatchSampler` hands each rank its share of one
seeded global permutation per epoch, step by step, and :func:`share_loss_scale` makes DDP's mean over
ranks the mean over the global batch.

Step ``t`` of an epoch is one contiguous slice of ``N`` positions of the epoch's permutation (``N`` =
the schedule's global batch); rank ``r`` trains on its contiguous sub-slice, sized by
``ShareSchedule.shares_for_step(global step)``. Whatever the shares, the union of the ranks' batches
of a step is the same slice, so every sample of an epoch is seen exactly once across ranks, and a
share change moves samples between ranks, never in or out of a step.

The sampler runs where a DataLoader iterates its batch sampler: in the training process, also with
worker processes (they receive index lists from it). It reports every step it builds to the schedule
(``note_built``) before it reads that step's shares, so a decision can never change a split some rank
has already built.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, Sampler

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.core.shares import ShareSchedule
from pace_strategy.core.state import STATE_VERSION, PacingStateError, check_state

if TYPE_CHECKING:
    from pace_strategy.data.balance import Balancer

__all__ = [
    "BuiltBatch",
    "ShareBatchSampler",
    "check_indexable",
    "restore_schedule",
    "scaled_shares",
    "share_loss_scale",
]


@dataclass(frozen=True)
class BuiltBatch:
    """One batch the sampler built: the global (optimizer) step it belongs to and every rank's
    sample count in it (their sum is the global batch of that step; smaller only in an epoch's last,
    partial step)."""

    step: int
    shares: tuple[int, ...]
    rank: int

    @property
    def samples(self) -> int:
        """This rank's samples in the batch."""
        return self.shares[self.rank]

    @property
    def loss_scale(self) -> float:
        """:func:`share_loss_scale` of this rank in this batch."""
        return share_loss_scale(self.shares, self.rank)


def share_loss_scale(shares: Sequence[int], rank: int) -> float:
    """The factor ``n_r * W / N`` by which rank ``rank`` multiplies its loss before backward.

    DDP averages gradients over the ``W`` ranks. When every rank's loss is the mean over its own
    ``n_r`` samples, that average weights a sample of a small share more than one of a large share;
    scaled by ``n_r * W / N`` (``N = sum(shares)``), the average over ranks is exactly the mean over
    the ``N`` samples of the global batch, the update a single process would make on the whole batch.
    With even shares the factor is 1.0 (exactly: nothing changes).
    """
    total = sum(shares)
    return shares[rank] * len(shares) / total


def scaled_shares(shares: Sequence[int], samples: int) -> tuple[int, ...]:
    """Split ``samples`` (>= the number of ranks) in proportion to ``shares``, every rank at least one
    (largest remainder, ties to the lowest rank): the split of an epoch's last, partial step."""
    world = len(shares)
    if samples < world:
        raise ValueError(f"{samples} samples cannot give each of {world} ranks one")
    total = sum(shares)
    spare = samples - world  # one sample per rank first, the rest by share
    exact = [spare * s / total for s in shares]
    out = [1 + math.floor(e) for e in exact]
    order = sorted(range(world), key=lambda r: (-(exact[r] - math.floor(exact[r])), r))
    for r in order[: samples - sum(out)]:
        out[r] += 1
    return tuple(out)


def check_indexable(dataset: object) -> None:
    """Refuse an ``IterableDataset`` (a :class:`PacingConfigError` saying why and what to do)."""
    if isinstance(dataset, IterableDataset):
        raise PacingConfigError(
            f"rebalancing needs indexable data: the training dataset {type(dataset).__name__} is an "
            "IterableDataset, whose samples cannot be handed out by index. Use a map-style dataset "
            "(__getitem__ and __len__), or set rebalance=False."
        )


def restore_schedule(schedule: ShareSchedule, entries: Sequence[Mapping[str, Any]]) -> None:
    """Re-add checkpointed entries (``{"from_step", "samples", "reason", "balanced", "cost"}``) to
    ``schedule`` before its pipeline has built a step; entries it already holds are skipped, so
    restoring twice (the sampler's state and, in a state written before the sampler owned them, the
    decision's own) is harmless."""
    schedule.restore(entries)


class ShareBatchSampler(Sampler[list[int]]):
    """A distributed batch sampler whose per-rank batch sizes follow a :class:`ShareSchedule`.

    Give it to a ``DataLoader`` as ``batch_sampler=`` (no ``batch_size``, ``shuffle``, ``sampler`` or
    ``drop_last`` there); every rank builds its own with its ``rank`` and the same schedule entries.
    The paced strategies build it for you when ``PacingConfig.rebalance`` is on (docs/rebalancing.md).

    Args:
        dataset: the map-style dataset (only its length is used). An ``IterableDataset`` is refused:
            moving samples between ranks needs indexable data.
        schedule: the shares of every step; ``schedule.global_batch`` is N, the samples of one step
            summed over ranks.
        rank: this rank, in ``[0, schedule.world_size)``.
        shuffle: a new seeded permutation every epoch (``torch.randperm`` seeded ``seed + epoch``, as
            ``DistributedSampler`` does); ``False``: dataset order.
        seed: the permutation's seed; must be the same on every rank.
        drop_last: drop the epoch's last, partial step (fewer than N samples). ``False``: it is split
            in proportion to that step's shares (:func:`scaled_shares`), padded from the epoch's start
            when it has fewer samples than ranks (so a few samples are then seen twice).
        micro_batches: batches per optimizer step (gradient accumulation): the ``micro_batches``
            batches of a step all use that step's shares.
        step_source: returns the number of optimizer steps trained so far; read when an epoch's first
            batch is built, it maps the epoch's batches to global steps (the steps of the schedule).
            ``None``: the sampler counts the batches it has built (right when every built batch is
            trained; a loop that stops an epoch early must pass one).
        balancer: splits each step's samples (its dataset indices, and the step's shares as the
            ranks' weights) into each rank's batch by their cost instead of cutting the slice by the
            shares (cost-balanced batches, :class:`~pace_strategy.data.balance.Balancer`); the ranks'
            sample counts then follow from it. The same function of the same indices on every rank.
            Steps whose schedule entry is not ``balanced`` (the plain arm of balancing's A/B check)
            are cut by the shares instead.
    """

    def __init__(
        self,
        dataset: Sized,
        schedule: ShareSchedule,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        micro_batches: int = 1,
        step_source: Callable[[], int] | None = None,
        balancer: Balancer | None = None,
    ) -> None:
        check_indexable(dataset)
        if not 0 <= rank < schedule.world_size:
            raise ValueError(f"rank must be in [0, {schedule.world_size}), got {rank}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.length = len(dataset)
        if self.length < schedule.world_size:
            raise PacingConfigError(
                f"the training dataset has {self.length} samples, fewer than the {schedule.world_size} "
                "ranks: every rank needs at least one sample per step."
            )
        self.schedule = schedule
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.micro_batches = micro_batches
        self.step_source = step_source
        self.balancer = balancer
        self.epoch = 0
        self._lock = threading.Lock()
        self._built: collections.deque[BuiltBatch] = collections.deque()
        self._consumed = 0  #: batches of the current epoch popped by the training side
        self._yielded = 0  #: batches of the current epoch built
        self._popping = False
        self._epoch_start_step = 0
        self._next_start_step = 0  #: without a step source: the first step of the next epoch
        self._resume: tuple[int, int, int] | None = None  #: (epoch, position, start step) to resume
        #: Lightning's fit loop and Fabric's loaders call ``set_epoch`` on a loader's ``sampler`` and on
        #: ``batch_sampler.sampler``, never on the batch sampler itself: this view forwards it here.
        self.sampler = _EpochView(self)

    # ------------------------------------------------------------------ the plan of an epoch
    def __len__(self) -> int:
        """Batches per epoch (this rank builds one for every step, whatever its share)."""
        full, rest = divmod(self.length, self.schedule.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def batch_size(self) -> int:
        """The even share, N / W (rounded down): what a framework that reads a batch sampler's
        ``batch_size`` gets; the real sizes of each step follow the schedule."""
        return self.schedule.global_batch // self.schedule.world_size

    @property
    def num_processes(self) -> int:
        """W (accelerate takes a loader's global batch for ``batch_size x num_processes``)."""
        return self.schedule.world_size

    def set_epoch(self, epoch: int) -> None:
        """The next iteration uses epoch ``epoch``'s permutation (call it before every epoch)."""
        self.epoch = epoch

    def permutation(self, epoch: int) -> torch.Tensor:
        """The epoch's global order of dataset indices (the same on every rank)."""
        if not self.shuffle:
            return torch.arange(self.length)
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.length, generator=generator)

    def _chunk(self, order: list[int], index: int) -> list[int]:
        """Batch ``index`` of an epoch, every rank's samples: its slice of ``order`` (an epoch's last,
        partial one padded from the epoch's start when it has fewer samples than ranks)."""
        n, world = self.schedule.global_batch, self.schedule.world_size
        chunk = order[index * n : (index + 1) * n]
        if len(chunk) < world:
            chunk = chunk + order[: world - len(chunk)]
        return chunk

    def _split(self, order: list[int], index: int, shares: tuple[int, ...]) -> list[list[int]]:
        """Batch ``index`` of an epoch: its slice of ``order``, cut by ``shares`` (scaled when
        partial)."""
        chunk = self._chunk(order, index)
        if len(chunk) < self.schedule.global_batch:
            shares = scaled_shares(shares, len(chunk))
        out, at = [], 0
        for s in shares:
            out.append(chunk[at : at + s])
            at += s
        return out

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[list[int]]:
        return self._iterate(self.epoch)

    def _iterate(self, epoch: int) -> Iterator[list[int]]:
        # A generator: this body runs at the first batch's request, when the previous epoch's steps
        # have been trained, so the step source gives this epoch's first step.
        skip, start = 0, self._next_start_step if self.step_source is None else self.step_source()
        if self._resume is not None and self._resume[0] == epoch:
            skip = self._resume[1]
            start = self._resume[2] if self.step_source is None else start - skip // self.micro_batches
        self._resume = None
        with self._lock:
            self._built.clear()
            self._epoch_start_step = start
            self._consumed = self._yielded = skip
        order = self.permutation(epoch).tolist()
        count = len(self)
        for i in range(skip, count):
            step = start + i // self.micro_batches
            # Noted before the shares are read: an entry added from now on starts after this step.
            self.schedule.note_built(step)
            entry = self.schedule.entry_for_step(step)
            shares = entry.samples
            parts = None
            if self.balancer is not None and entry.balanced:
                cost = None if entry.cost is None else self.balancer.cost_of(entry.cost)
                parts = self.balancer(self._chunk(order, i), shares, cost)
                shares = tuple(len(b) for b in parts)
                batch = parts[self.rank]
            elif i == count - 1 and self.length % self.schedule.global_batch:
                indices = self._split(order, i, shares)
                shares = tuple(len(b) for b in indices)
                batch = indices[self.rank]
            else:
                offset = i * self.schedule.global_batch + sum(shares[: self.rank])
                batch = order[offset : offset + shares[self.rank]]
            if self.balancer is not None and self.schedule.work_ranks is not None:
                self._note_work(step, parts or self._split(order, i, shares))
            with self._lock:
                self._built.append(BuiltBatch(step, shares, self.rank))
                self._yielded = i + 1
            yield batch
        self._next_start_step = start + math.ceil(count / self.micro_batches)

    def _note_work(self, step: int, parts: list[list[int]]) -> None:
        """The work of the ranks the online cost fit reads, in this step's batch (every rank's split
        is known here: it is the same function of the same indices everywhere)."""
        assert self.balancer is not None and self.schedule.work_ranks is not None
        self.schedule.note_work(step, self.balancer.work([parts[r] for r in self.schedule.work_ranks]))

    def pop_built(self) -> BuiltBatch | None:
        """The oldest built batch not yet trained: the training side calls it once per batch, in
        order (a DataLoader returns batches in its sampler's order, also with workers, unless
        ``in_order=False``). ``None`` when none is waiting."""
        with self._lock:
            self._popping = True
            if not self._built:
                return None
            self._consumed += 1
            return self._built.popleft()

    @property
    def untaken_batches(self) -> int:
        """Batches built that the training side never took, while it has taken none at all
        (:meth:`pop_built` never called); 0 once it takes them."""
        with self._lock:
            return 0 if self._popping else self._yielded - self._consumed

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The position (epoch and batches trained in it: those popped by :meth:`pop_built`, else
        those built) and the schedule's entries, as plain Python values."""
        with self._lock:
            position = self._consumed if self._popping else self._yielded
            start = self._epoch_start_step
        if self._resume is not None:  # restored, not iterated yet: still where the checkpoint was
            _, position, start = self._resume
        if position >= len(self):  # the epoch is over: the next one starts from its beginning
            epoch, position, start = self.epoch + 1, 0, start + math.ceil(len(self) / self.micro_batches)
        else:
            epoch = self.epoch
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "start_step": start,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch": self.schedule.global_batch,
            "world_size": self.schedule.world_size,
            "entries": [
                {
                    "from_step": e.from_step,
                    "samples": list(e.samples),
                    "reason": e.reason,
                    "balanced": e.balanced,
                    "cost": None if e.cost is None else list(e.cost),
                }
                for e in self.schedule.entries
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration of the saved epoch skips the batches
        already trained, and the schedule gets the saved entries back. Refuses (a
        :class:`~pace_strategy.core.state.PacingStateError`) a damaged state, or one of another global
        batch, world size, seed or order, which would not continue the same epoch."""
        fields = {"epoch": int, "position": int, "start_step": int, "entries": list}
        check_state(state, "the rebalancing sampler's state", fields)
        mine = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch": self.schedule.global_batch,
            "world_size": self.schedule.world_size,
        }
        differ = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if differ:
            raise PacingStateError(
                f"cannot resume the rebalancing sampler from this checkpoint: {differ} (saved, now) "
                "differ; resume with the same batch size, world size, seed and shuffle."
            )
        restore_schedule(self.schedule, state["entries"])
        self.epoch = int(state["epoch"])
        self._resume = (self.epoch, int(state["position"]), int(state["start_step"]))
        self._next_start_step = int(state["start_step"])


class _EpochView(Sampler[int]):
    """``ShareBatchSampler.sampler``: the epoch's global order, and ``set_epoch`` for the frameworks
    that look for it there."""

    def __init__(self, owner: ShareBatchSampler) -> None:
        self._owner = owner
        self.shuffle = owner.shuffle

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self._owner.permutation(self._owner.epoch).tolist())

    def __len__(self) -> int:
        return self._owner.length
