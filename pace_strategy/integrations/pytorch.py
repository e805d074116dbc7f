"""Plain PyTorch: :func:`attach`, pacing for a training loop you write yourself (DDP or FSDP2).

::

    with pace_strategy.attach(ddp_model, run_dir="runs/x", writer=writer) as pace:
        for batch in pace.dataloader(loader):
            pace.begin_step()
            loss = loss_fn(ddp_model(batch))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            pace.end_step(samples=len(batch))
    print(pace.summary())

Launched by ``torchrun`` (or anything that initialized the default process group). The session,
the monitors, the run record, the watchdog and GC sync are the same as under Lightning or
Accelerate; what this adapter adds is only the translation of a loop's own events: ``begin_step``
when the batch is in hand, ``end_step`` after the optimizer step.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.data.balance import CostModel
from pace_strategy.driver import PacingDriver
from pace_strategy.integrations._model import data_rebalance, model_is_fsdp2, pace_model
from pace_strategy.integrations.dashboard import add_scalars, custom_scalars_sink
from pace_strategy.integrations.data import loader_workers, time_dataloader
from pace_strategy.integrations.env import (
    PacingArg,
    as_pacing_config,
    config_from_env,
    default_run_dir,
    record_dir,
    runs_alone,
)
from pace_strategy.integrations.rebalance import DataRebalance
from pace_strategy.session import PacingSession
from pace_strategy.telemetry.topology import mesh_coordinates

__all__ = ["Pace", "PaceSummary", "attach"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PaceSummary:
    """What the run measured, the same on every rank (from the exchanged windows).

    ``median_skew_ms`` and ``median_step_ms`` are medians over the windows' medians (unpaced skew:
    the delay given is added back); ``straggler_counts[r]`` is how often rank ``r`` arrived last.
    """

    steps: int  #: steps this rank ended
    windows: int  #: windows exchanged
    median_skew_ms: float
    median_step_ms: float
    straggler_counts: tuple[int, ...]
    delay_ms: float  #: the delay this rank applies now
    record: Path | None  #: rank 0's run record (``None`` elsewhere, or none written)

    def __str__(self) -> str:
        total = sum(self.straggler_counts)
        rank = max(range(len(self.straggler_counts)), key=self.straggler_counts.__getitem__, default=-1)
        share = f"rank {rank} last in {self.straggler_counts[rank]}/{total} steps" if total else "no steps"
        return (
            f"pace_strategy: {self.steps} steps, {self.windows} windows; skew {self.median_skew_ms:.1f} ms "
            f"of a {self.median_step_ms:.1f} ms step at the median; {share}; delay {self.delay_ms:.1f} ms"
            + (f"; record {self.record}" if self.record is not None else "")
        )


class Pace(PacingDriver):
    """The pacing of one model in a plain PyTorch loop (what :func:`attach` returns): the
    :class:`~pace_strategy.driver.PacingDriver` calls (``begin_step``, ``end_step``, ``state_dict``,
    ``finish``, ``detach``, a context manager) plus the loop's loader and a summary.

    Every method is a no-op without a session (one process). :meth:`begin_step` and :meth:`end_step`
    are called on every rank, every step; :meth:`end_step` and :meth:`finish` are collective.
    """

    rebalance: DataRebalance | None

    def __init__(self, model: nn.Module, config: PacingConfig, session: PacingSession | None) -> None:
        super().__init__(config, session)
        self.model = model

    def dataloader(self, loader: Any, lengths: Any = None, cost: CostModel | None = None) -> Any:
        """Iterate this instead of ``loader``: its input wait is measured, and with ``rebalance=True``
        or ``balance=True`` it is ``loader`` rebuilt around the rebalancing batch sampler (same
        dataset, batch size, shuffle, drop_last and workers; each rank's share of the global batch
        follows the decisions, or each step's samples are split by their cost; the gradient is scaled
        by the rank's count in the DDP comm hook, so the loop and its loss stay as they are). Call it
        once, after :func:`attach`, before the first step. ``lengths``: every sample's length in
        tokens, for ``balance`` (else read from the dataset: docs/balancing.md). ``cost``: for
        ``balance``, your cost model instead of ``balance.cost``: a function from an array of lengths
        to as many positive costs, non-decreasing in the length (e.g. measured per length bucket);
        the online fit is then off."""
        if self.session is None:
            return loader
        if cost is not None and (self.rebalance is None or self.rebalance.balance is None):
            raise PacingConfigError(
                "pace.dataloader(cost=...) is the cost model of cost-balanced batches: set "
                "pacing={'balance': {'enabled': True}} in attach, or leave cost out."
            )
        if self.rebalance is not None:
            if self.rebalance.sampler is not None:
                raise PacingConfigError("pace.dataloader(...) rebalances one training loader; call it once.")
            if lengths is not None:
                self.rebalance.lengths = lengths
            if cost is not None:
                self.rebalance.cost = cost
            loader = self.rebalance.replace(loader)
        self.session.note_dataloader_workers(loader_workers(loader))
        hook = time_dataloader(loader, lambda: self.live_session)
        if hook is not None:
            self.on_detach(hook.remove)
        return loader

    def summary(self) -> PaceSummary:
        """What was measured so far (all of it after :meth:`finish`)."""
        session, tally = self.session, self.tally
        world = session.world_size if session is not None else 1
        skews, steps_ms = sorted(tally.skew_ms), sorted(tally.step_ms)
        return PaceSummary(
            steps=self.steps,
            windows=tally.windows,
            median_skew_ms=skews[len(skews) // 2] if skews else 0.0,
            median_step_ms=steps_ms[len(steps_ms) // 2] if steps_ms else 0.0,
            straggler_counts=tuple(tally.straggler_counts or [0] * world),
            delay_ms=session.pacer.delay_ms if session is not None else 0.0,
            record=session.record_path if session is not None and session.record_created else None,
        )


def attach(
    model: nn.Module,
    *,
    pacing: PacingArg = None,
    run_dir: str | os.PathLike[str] | None = None,
    writer: Any | None = None,
    mesh: Any | None = None,
    pipeline_stage: int | None = None,
) -> Pace:
    """Monitor and pace ``model`` (a ``DistributedDataParallel`` model, or one sharded with FSDP2's
    ``fully_shard``) in a plain PyTorch training loop. Collective: every rank, after the model is
    wrapped and the default process group initialized (``torchrun``).

    Args:
        pacing: a :class:`~pace_strategy.PacingConfig`, a mapping of its fields, or ``None``: the
            ``PACE_*`` variables, else the defaults.
        run_dir: rank 0's run record directory. Default: ``writer``'s log directory, else
            ``$PACE_RUN_DIR``, else ``./pace_runs/<date-time>``.
        writer: a TensorBoard ``SummaryWriter`` (or anything with ``add_scalar(tag, value, step)``)
            that gets the ``pace/`` tags on rank 0, off the training thread. ``None``: the record only.
        mesh: the ``DeviceMesh`` the model trains on, with named dimensions (``dp_replicate``,
            ``dp_shard``, ``tp``, ``pp``, ``cp``, or Lightning's ``data_parallel``/``tensor_parallel``):
            each rank's coordinates go into the run record, where ``pace diagnose`` names a slow
            pipeline stage, one coordinate slow in every replica and a slow tensor-parallel group.
        pipeline_stage: this rank's pipeline stage, for a loop whose schedule pace_strategy does not
            see (the same as a ``pp`` dimension of ``mesh``).
    """
    config = as_pacing_config(pacing) if pacing is not None else config_from_env() or PacingConfig()
    coordinates = mesh_coordinates(mesh, pipeline_stage)  # a bad mesh fails here, on every rank
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if runs_alone(world_size, run_dir, record_alone=False, runs_as="attach does nothing"):
        return Pace(model, config, None)
    fsdp = model_is_fsdp2(model, "pace_strategy.attach needs the model you train")
    rank = dist.get_rank()
    log_dir = None
    if rank == 0:
        logged = writer.get_logdir() if writer is not None and hasattr(writer, "get_logdir") else None
        log_dir = record_dir(run_dir, logged, fallback=default_run_dir())
    session = PacingSession.with_side_group(
        config,
        rank=rank,
        world_size=world_size,
        device=_device(model),
        framework="pytorch",
        log_dir=log_dir,
        metrics_sink=None if writer is None else functools.partial(add_scalars, writer),
        dashboard=None if writer is None else custom_scalars_sink(lambda: [writer]),
        coordinates=coordinates,
    )
    pace = Pace(model, config, session)
    try:
        if config.splits_batches:  # a plain loop trains the batch it just took: no prefetch
            data_rebalance(pace, session, fsdp, lambda: pace.steps, prefetch=0)
        pace_model(pace, model, session, fsdp)  # the share factor goes on the gradient, in the comm hook
    except BaseException:
        pace.detach()
        raise
    return pace


def _device(model: nn.Module) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")
