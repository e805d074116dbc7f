"""Lightning adapter (``lightning.pytorch``): the ``paced_ddp`` / ``paced_ddp_spawn`` / ``paced_fsdp``
strategies.

Each strategy is one subclass below Lightning's own (``DDPStrategy``, ``ModelParallelStrategy`` for
FSDP2) plus a mixin that forwards its step events to a :class:`~pace_strategy.session.PacingSession`
(:mod:`pace_strategy.integrations._lightning_mixins`, shared with the standalone
``pytorch_lightning`` classes in :mod:`pace_strategy.integrations.pytorch_lightning`). Importing this
module registers the strategies (:func:`register_lightning_strategies`, idempotent); ``import
pace_strategy`` imports it as soon as ``lightning.pytorch`` is imported.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, StrategyRegistry

from pace_strategy.integrations._lightning_mixins import PacedDDPMixin, PacedFSDPMixin

__all__ = ["PacedDDPStrategy", "PacedFSDPStrategy", "register_lightning_strategies"]


class PacedDDPStrategy(PacedDDPMixin, DDPStrategy):
    """Lightning ``DDPStrategy`` with barrier-arrival skew monitoring and adaptive pacing.

    Args:
        pacing: a :class:`~pace_strategy.PacingConfig`, a mapping of its fields, or ``None`` for the
            defaults.
        run_dir: the directory of rank 0's run record ``pace_run.jsonl``. Default: the logger's
            ``log_dir``, else ``$PACE_RUN_DIR``, else ``./pace_runs/<date-time>`` for a logger without
            a directory (W&B, MLflow); none with ``logger=False``. With one
            process, a run directory (this or ``$PACE_RUN_DIR``) is what turns monitoring on; under
            ``fast_dev_run`` nothing is written at all.
        *args, **kwargs: ``DDPStrategy``'s arguments, in its positions (a drop-in:
            ``PacedDDPStrategy(accelerator)`` as ``DDPStrategy(accelerator)``). A DDP communication
            hook among them (``ddp_comm_state``, ``ddp_comm_hook``, ``ddp_comm_wrapper``) is
            registered on every device (stock Lightning drops it on CPU) and keeps doing the
            communication.
    """

    strategy_name = "paced_ddp"


class PacedFSDPStrategy(PacedFSDPMixin, ModelParallelStrategy):
    """FSDP2 (``fully_shard``) with skew monitoring and adaptive pacing, on Lightning's
    ``ModelParallelStrategy``.

    Every forward/backward all-gather and every gradient reduce-scatter is timed; the pacing delay
    goes before the step's first collective. When the LightningModule's ``configure_model`` does not
    call ``fully_shard`` (or there is none), the model is sharded by :func:`pace_strategy.auto_shard`.

    Args:
        pacing: a :class:`~pace_strategy.PacingConfig`, a mapping of its fields, or ``None``.
        run_dir: the run record's directory, as for :class:`PacedDDPStrategy`.
        auto_shard_min_params: parameters a block must hold to become its own shard group.
        auto_shard_classes: module classes that are each a shard group (overrides the size rule).
        *args, **kwargs: ``ModelParallelStrategy``'s arguments, in its positions:
            ``data_parallel_size`` (the FSDP shard dimension; ``"auto"`` = world size / tensor
            parallel size), ``tensor_parallel_size`` (``"auto"`` means 1 here: pure data
            parallelism), and the rest.
    """

    strategy_name = "paced_fsdp"


def register_lightning_strategies() -> None:
    """Register ``paced_ddp``, ``paced_ddp_spawn`` and ``paced_fsdp`` in ``lightning.pytorch``'s
    ``StrategyRegistry`` (idempotent)."""
    PacedDDPStrategy.register_strategies(StrategyRegistry)
    PacedFSDPStrategy.register_strategies(StrategyRegistry)


# Registered as soon as the classes exist: ``import pace_strategy`` imports this module when
# ``lightning.pytorch`` is imported, and a program that imports this module first (so that it is this module
# that imports Lightning) gets the names too.
register_lightning_strategies()
