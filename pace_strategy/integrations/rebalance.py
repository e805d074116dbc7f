"""One rank's rebalancing data path for the adapters (Lightning, Fabric, Accelerate): swap the
training DataLoader's sampler for a :class:`~pace_strategy.data.ShareBatchSampler`, attach its
schedule to the pacer, and per batch report the samples and the share factor of the loss.

The framework has already built the loader it trains on (with the ``DistributedSampler`` it
injects, or accelerate's batch sampler shard); :meth:`DataRebalance.replace` (and, for a loader the
script already holds, :meth:`DataRebalance.replace_prepared`) builds the same loader again around
the batch sampler, with the same shuffle, seed, drop_last, batch size and worker settings.
Everything else stays the framework's: the loader is still a ``DataLoader``, epochs still reach
``set_epoch``. See docs/rebalancing.md.
"""

# No ``from __future__ import annotations`` here: DDP checks a comm hook's annotations at run time.
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from pace_strategy.core.config import BalanceConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.shares import ShareSchedule
from pace_strategy.core.state import PacingStateError
from pace_strategy.data.balance import Balancer, CostModel, SampleCost, sample_lengths
from pace_strategy.data.share_sampler import ShareBatchSampler, check_indexable

__all__ = ["STATE_NAME", "DataRebalance", "loader_lookahead_steps", "share_scaled_allreduce"]

#: the session state component (``PacingSession.register_state``) of the sampler's position and shares
STATE_NAME = "rebalance_sampler"

log = logging.getLogger(__name__)

#: The DataLoader arguments a rebuilt loader keeps (everything but how batches are formed).
_KEPT = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


@dataclass(frozen=True)
class _Split:
    """How the framework's loader splits the data: what the batch sampler keeps."""

    batch_size: int  #: per rank, at even shares
    shuffle: bool
    seed: int
    drop_last: bool


def _order(sampler: object) -> tuple[bool, int]:
    """(shuffle, seed) of a single-process sampler; refused: a sampler that picks samples itself."""
    if isinstance(sampler, (RandomSampler, SequentialSampler)):
        return isinstance(sampler, RandomSampler), 0
    raise PacingConfigError(
        f"rebalance=True replaces the training loader's sampler with one global permutation split by "
        f"shares, but it has a custom sampler ({type(sampler).__name__}) that decides the samples "
        "itself. Use shuffle=True/False (no sampler), or set rebalance=False."
    )


def _loader_split(loader: DataLoader[Any], world_size: int) -> _Split:
    """The split of a loader the framework gave a ``DistributedSampler`` (or, with
    ``use_distributed_sampler=False``, a plain random or sequential one)."""
    if loader.batch_size is None:
        raise PacingConfigError(
            "rebalance=True builds the training loader's batches itself, from its batch_size, but the "
            f"loader has a custom batch_sampler ({type(loader.batch_sampler).__name__}). Pass batch_size= "
            "(and shuffle=) instead, or set rebalance=False."
        )
    inner = loader.sampler
    if type(inner) is DistributedSampler:  # the one the framework injects (or the user's own)
        if inner.num_replicas != world_size:
            raise PacingConfigError(
                f"the training loader's DistributedSampler splits the data over {inner.num_replicas} "
                f"ranks, but this job has {world_size}."
            )
        shuffle, seed = inner.shuffle, inner.seed
    else:
        shuffle, seed = _order(inner)
    return _Split(loader.batch_size, shuffle, seed, loader.drop_last)


def share_scaled_allreduce(state: "DataRebalance", bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """A DDP comm hook: the bucket times this rank's share factor, then the default mean all-reduce.

    For Accelerate, whose ``accelerator.backward`` has no hook for the loss: scaling the gradient
    before DDP averages it is the same update as scaling the loss (up to rounding). With gradient
    accumulation it scales the accumulated gradient once, at the synchronizing micro-batch: exact
    where every micro-batch of a step has the step's shares (rebalancing); where their counts differ
    (cost-balanced batches), :meth:`DataRebalance.begin_batch` first brings the gradient accumulated
    so far to the new micro-batch's factor (``rescale_accumulated``)."""
    state.check_taken()
    if state.loss_scale != 1.0:
        bucket.buffer().mul_(state.loss_scale)
    return default_hooks.allreduce_hook(dist.group.WORLD, bucket)  # type: ignore[arg-type]


def loader_lookahead_steps(loader: DataLoader[Any], framework_prefetch: int) -> int:
    """How many batches beyond the one in training ``loader``'s pipeline may have built: its workers'
    prefetch (``num_workers x prefetch_factor`` index lists are handed out ahead) plus the
    framework's own prefetch (Lightning's fit loop fetches one batch ahead)."""
    workers = loader.num_workers
    ahead = workers * (loader.prefetch_factor or 2) if workers > 0 else 0
    return ahead + framework_prefetch


class DataRebalance:
    """The rebalanced training data of one rank.

    Args:
        pacer: this rank's pacer (its ``attach_shares`` receives the schedule); ``None`` until
            :meth:`attach` (Fabric may set up the loader before the model that starts the session).
        rank, world_size: this rank and the number of ranks.
        step_source: the optimizer steps trained so far (Lightning: the trainer's global step).
        framework_prefetch: batches the framework fetches ahead of the one it trains.
        micro_batches: batches per optimizer step (gradient accumulation); a step with more batches
            is refused (their shares would not be the step's).
        balance: cost-balanced batches (``balance.enabled``): each step's samples split by their
            cost (:class:`~pace_strategy.data.balance.Balancer`) within the shares; ``None``: the
            shares cut each step's slice.
        lengths: the samples' lengths in tokens, for ``balance`` (else read from the dataset:
            :func:`~pace_strategy.data.balance.sample_lengths`).
        cost: a user's cost model for ``balance``, each sample's cost from its length (an array
            of lengths in, as many positive costs out, non-decreasing), instead of the configured
            ``balance.cost``; the online fit is then off. ``None``: the configured model.
    """

    def __init__(
        self,
        pacer: Pacer | None,
        rank: int,
        world_size: int,
        step_source: Callable[[], int],
        framework_prefetch: int,
        micro_batches: int = 1,
        balance: BalanceConfig | None = None,
        lengths: Any = None,
        cost: CostModel | None = None,
    ) -> None:
        self.pacer = pacer
        self.balance = balance if balance is not None and balance.enabled else None
        self.lengths = lengths
        self.cost = cost
        self.rank = rank
        self.world_size = world_size
        self.step_source = step_source
        self.framework_prefetch = framework_prefetch
        self.micro_batches = micro_batches
        self.schedule: ShareSchedule | None = None  #: set by the first :meth:`replace`
        self.sampler: ShareBatchSampler | None = None  #: the training loader's batch sampler
        self.loss_scale = 1.0  #: the factor of the batch in training (:func:`share_loss_scale`)
        #: the comm-hook path (:func:`share_scaled_allreduce`): multiplies the gradient accumulated so
        #: far in this step by a ratio of factors; ``None`` where the loss itself is scaled
        self.rescale_accumulated: Callable[[float], None] | None = None
        self._step_samples = 0
        self._step_batches = 0
        self._lookahead = 0
        self._missed = False
        self._pending: dict[str, Any] | None = None  #: a restored sampler state, until the sampler exists

    def attach(self, pacer: Pacer) -> None:
        """Report to ``pacer`` from now on (and attach the schedule, if a loader was rebuilt)."""
        self.pacer = pacer
        self._attach_schedule()

    def _attach_schedule(self) -> None:
        pacer, schedule = self.pacer, self.schedule
        if pacer is not None and schedule is not None and pacer.shares is not schedule:
            pacer.attach_shares(schedule, self._lookahead)

    def replace(self, loader: object) -> object:
        """The training loader rebuilt around a :class:`ShareBatchSampler` (Lightning, Fabric: the
        framework takes the returned loader). Anything that is not a DataLoader is refused:
        rebalancing decides which samples each rank gets."""
        if not isinstance(loader, DataLoader):
            raise PacingConfigError(
                f"rebalance=True needs the training data as a torch DataLoader, got {type(loader).__name__}; "
                "pass a DataLoader over a map-style dataset, or set rebalance=False."
            )
        if isinstance(loader.batch_sampler, ShareBatchSampler):  # already rebalanced (a reload)
            self._adopt(loader, loader.batch_sampler)
            return loader
        check_indexable(loader.dataset)
        if type(loader) is not DataLoader:
            raise PacingConfigError(
                f"rebalance=True rebuilds the training DataLoader around its own batch sampler, but "
                f"{type(loader).__name__} is a DataLoader subclass whose constructor it cannot know. Use a "
                "plain torch DataLoader (or one with batch_sampler=ShareBatchSampler(...)), or set "
                "rebalance=False."
            )
        return self._rebuild(loader, self._sampler(loader, _loader_split(loader, self.world_size)))

    def replace_prepared(self, loader: object) -> None:
        """Rebalance an Accelerate-prepared loader in place (the script holds it already): its inner
        DataLoader is rebuilt around a :class:`ShareBatchSampler` from the accelerate batch sampler's
        batch size, drop_last and order (``split_batches`` too)."""
        check_indexable(getattr(loader, "dataset", None))
        base = getattr(loader, "base_dataloader", None)
        if not isinstance(base, DataLoader) or not hasattr(base.batch_sampler, "split_batches"):
            raise PacingConfigError(
                f"rebalance=True with Accelerate needs the prepared DataLoader of a map-style dataset that "
                f"each process loads itself; got {type(loader).__name__} (accelerate dispatches batches "
                "from process 0 for an IterableDataset or with dispatch_batches=True, and then no process "
                "can take a different share). Use a map-style dataset and dispatch_batches=False, or set "
                "rebalance=False."
            )
        if isinstance(base.batch_sampler, ShareBatchSampler):
            self._adopt(base, base.batch_sampler)
            return
        shard: Any = base.batch_sampler  # accelerate's BatchSamplerShard over the user's BatchSampler
        inner = shard.batch_sampler
        per_rank = inner.batch_size // self.world_size if shard.split_batches else inner.batch_size
        split = _Split(per_rank, *_order(getattr(inner, "sampler", None)), bool(inner.drop_last))
        # DataLoaderShard iterates its base_dataloader: a plain attribute, replaced like for like.
        loader.base_dataloader = self._rebuild(base, self._sampler(base, split))  # type: ignore[attr-defined]

    def _rebuild(self, loader: DataLoader[Any], sampler: ShareBatchSampler) -> DataLoader[Any]:
        if getattr(loader, "in_order", True) is False:
            raise PacingConfigError(
                "rebalance=True needs the training DataLoader's batches in order (in_order=True): the loss "
                "scale of a batch is matched to it by position."
            )
        kept = {name: getattr(loader, name) for name in _KEPT if hasattr(loader, name)}
        if loader.num_workers > 0:
            kept["prefetch_factor"] = loader.prefetch_factor
        rebuilt = DataLoader(loader.dataset, batch_sampler=sampler, **kept)
        self._adopt(rebuilt, sampler)
        return rebuilt

    def _sampler(self, loader: DataLoader[Any], split: _Split) -> ShareBatchSampler:
        global_batch = split.batch_size * self.world_size
        if self.schedule is None:
            self.schedule = ShareSchedule(global_batch, self.world_size)
            self.schedule.fixed_cost = self.cost is not None
        elif self.schedule.global_batch != global_batch:
            raise PacingConfigError(
                f"the training batch size changed to {split.batch_size} (global {global_batch}) from a "
                f"global batch of {self.schedule.global_batch}: rebalancing keeps the global batch constant."
            )
        return ShareBatchSampler(
            loader.dataset,  # type: ignore[arg-type]  # an IterableDataset is refused in there
            self.schedule,
            self.rank,
            shuffle=split.shuffle,
            seed=split.seed,
            drop_last=split.drop_last,
            micro_batches=self.micro_batches,
            step_source=self.step_source,
            balancer=self._balancer(loader),
        )

    def _balancer(self, loader: DataLoader[Any]) -> Balancer | None:
        """The cost-balanced split of ``loader``'s samples (``balance.enabled``), from their lengths."""
        b = self.balance
        if b is None:
            return None
        try:
            lengths = sample_lengths(loader.dataset, self.lengths)
        except ValueError as error:
            raise PacingConfigError(f"balance.enabled: {error}") from error
        cost = self.cost if self.cost is not None else SampleCost(b.cost, b.quadratic_tokens, b.per_sample)
        return Balancer(lengths, cost, b.layout, b.max_tokens)

    def _adopt(self, loader: DataLoader[Any], sampler: ShareBatchSampler) -> None:
        if self.sampler is not None and self.sampler is not sampler and self.sampler.epoch:
            sampler.set_epoch(self.sampler.epoch)
        if self._pending is not None:
            try:
                sampler.load_state_dict(self._pending)
            except PacingStateError as error:  # never fail a resume: this epoch starts from its beginning
                log.warning("pace_strategy: the rebalancing sampler's position is not restored: %s", error)
            self._pending = None
        self.sampler = sampler
        self.schedule = sampler.schedule
        self._lookahead = max(self._lookahead, loader_lookahead_steps(loader, self.framework_prefetch))
        self._attach_schedule()
        log.debug("pace_strategy: rebalancing rank %d, lookahead %d steps", self.rank, self._lookahead)

    def begin_batch(self) -> None:
        """A training batch goes to the model: take its share (loss scale, samples of the step)."""
        built = self.sampler.pop_built() if self.sampler is not None else None
        if built is None:
            if not self._missed:
                self._missed = True
                log.warning("pace_strategy: a training batch came from outside the rebalanced loader")
            self.loss_scale = 1.0
            return
        self._step_batches += 1
        if self._step_batches > self.micro_batches:
            raise PacingConfigError(
                f"rebalance=True saw {self._step_batches} batches in one optimizer step, expected "
                f"{self.micro_batches}: with Fabric, rebalancing supports one batch per optimizer step "
                "(no gradient accumulation); with Lightning, accumulate_grad_batches sets it; with "
                "Accelerate, the Accelerator's gradient_accumulation_steps (or "
                "attach_pacing(rebalance_loop=RebalanceLoop(micro_batches=...)))."
            )
        scale = built.loss_scale
        if self._step_batches > 1 and scale != self.loss_scale and self.rescale_accumulated is not None:
            # The hook applies the last micro-batch's factor to the whole accumulated gradient. Kept
            # as (accumulated x factor = the factor-weighted sum so far), the earlier micro-batches
            # get their own factors: one pass over the gradients per micro-batch whose factor changes.
            self.rescale_accumulated(self.loss_scale / scale)
        self.loss_scale = scale
        self._step_samples += built.samples
        if self.pacer is not None:
            self.pacer.set_samples(self._step_samples)

    def check_taken(self) -> None:
        """Fail when the loader has built more batches than the training side took (``begin_batch``)
        beyond what it fetches ahead: the loop never says when a batch is in hand (a plain loop
        without ``pace.begin_step()``), so no batch's factor would be applied and the update would
        silently not be the global batch's mean."""
        if self._step_batches or self.sampler is None:  # this step took its batch: nothing to check
            return
        untaken = self.sampler.untaken_batches
        if untaken > (self._lookahead + 1) * self.micro_batches + 1:
            raise PacingConfigError(
                f"the rebalanced loader has built {untaken} batches that no "
                "step took: call pace.begin_step() when each batch is in hand (and pace.end_step() after "
                "the optimizer step); without it no batch's share factor is applied and the update is not "
                "the global batch's mean."
            )

    def scale(self, loss: Tensor) -> Tensor:
        """``loss`` times this batch's share factor (unchanged, the same tensor, at even shares)."""
        return loss if self.loss_scale == 1.0 else loss * self.loss_scale

    # The session checkpoints this (``register_state``): the sampler's position and the shares.
    def state_dict(self) -> dict[str, Any]:
        """The sampler's :meth:`~pace_strategy.data.ShareBatchSampler.state_dict` (a restored one
        while no loader was rebuilt yet; empty before either)."""
        if self.sampler is not None:
            return self.sampler.state_dict()
        return dict(self._pending) if self._pending is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position and the shares now, or when the training loader is rebuilt."""
        if not state:
            return
        if self.sampler is not None:
            self.sampler.load_state_dict(state)
        else:
            self._pending = dict(state)

    def stop(self) -> None:
        """No more batches come from the rebalanced loader (the adapter detached): factor 1.0."""
        self.loss_scale = 1.0
        self.sampler = None

    def end_step(self) -> None:
        """The optimizer stepped: the next batch starts a new step's sample count."""
        self._step_samples = self._step_batches = 0
