"""The training recipe's schema: one omegaconf YAML (plus dotlist overrides) -> one typed, validated job.

The runners are in :mod:`pace_strategy.apps.recipes`; this module imports none of the jobs, so the
jobs can import it.

A recipe is the example job of :mod:`pace_strategy.apps.job` (an MLP on seeded random data) with an
optional injected straggler, run by Lightning (``paced_ddp``, ``paced_fsdp`` and their unpaced
baselines) or by Accelerate. The scripts in ``recipes/train/`` call :func:`main_for`; ``pace demo`` is
a built-in recipe plus overrides. CPU or GPU and the process count come from the recipe or an
override (``trainer.accelerator=gpu trainer.devices=8``), nothing else changes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pace_strategy.core.config import PacingConfig, check_known_keys
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.settings import build, load_mapping
from pace_strategy.testing import PHASES, Straggler

__all__ = [
    "DataRecipe",
    "FSDPRecipe",
    "ModelRecipe",
    "OutputRecipe",
    "StragglerRecipe",
    "TrainRecipe",
    "TrainerRecipe",
    "fail_field",
    "load_recipe",
]

#: strategy name -> (paced?, FSDP?). ``ddp`` and ``fsdp`` are the unpaced baselines.
LIGHTNING_STRATEGIES = {
    "paced_ddp": (True, False),
    "paced_ddp_spawn": (True, False),
    "paced_ddp_fork": (True, False),
    "paced_fsdp": (True, True),
    "ddp": (False, False),
    "ddp_fork": (False, False),
    "fsdp": (False, True),
}
FRAMEWORKS = ("lightning", "accelerate")


#: ``output.logger`` values
LOGGERS = ("tensorboard", "mlflow")


def fail_field(where: str, value: Any, expected: str) -> None:
    raise PacingConfigError(f"{where}={value!r} is invalid: expected {expected}.")


@dataclass(frozen=True)
class TrainerRecipe:
    """Where and how long to train."""

    accelerator: str = "cpu"  #: Lightning accelerator name: ``cpu`` or ``gpu`` (Accelerate: from its config)
    devices: int = 2  #: processes per node (Lightning; Accelerate takes ``num_processes`` from its config)
    num_nodes: int = 1  #: nodes (Lightning)
    #: Lightning: paced_ddp, paced_ddp_spawn, paced_ddp_fork, paced_fsdp; the baselines ddp, ddp_fork, fsdp
    strategy: str = "paced_ddp"
    max_steps: int = 60  #: optimizer steps
    accumulate: int = 1  #: micro-batches per optimizer step (gradient accumulation)

    def __post_init__(self) -> None:
        if self.strategy not in LIGHTNING_STRATEGIES:
            fail_field("trainer.strategy", self.strategy, "one of " + ", ".join(LIGHTNING_STRATEGIES))
        for name in ("devices", "num_nodes", "max_steps", "accumulate"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail_field(f"trainer.{name}", value, "an integer >= 1")


@dataclass(frozen=True)
class ModelRecipe:
    """The MLP being trained."""

    inputs: int = 64  #: input features
    width: int = 256  #: hidden width
    depth: int = 3  #: hidden blocks (Linear + ReLU), each its own FSDP shard group when large enough
    classes: int = 10  #: output classes
    lr: float = 0.05  #: SGD learning rate
    compute_ms: float = 10.0  #: sleep per micro-batch standing in for accelerator time (0 on a real GPU)
    #: sleep per sample of the micro-batch, on top of ``compute_ms``: emulated accelerator time that
    #: scales with the batch (what rebalancing can shorten)
    sample_ms: float = 0.0
    gc_heap_objects: int = 0  #: long-lived objects each rank holds (``GcLoad``; 0: none)
    gc_garbage_objects: int = 0  #: cyclic garbage objects per micro-batch, on average (``GcLoad``; 0: none)
    #: hidden block after which the injection point sits (a ``backward`` or ``forward_backward``
    #: straggler spends its time there): 1, right after the first block, lands a backward delay at the
    #: very end of backward; ``depth``, right before the output layer, just after the first gradients
    inject_after: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.inject_after, int) or not 1 <= self.inject_after <= self.depth:
            fail_field(
                "model.inject_after", self.inject_after, f"a hidden block index in [1, depth={self.depth}]"
            )
        for name in ("inputs", "width", "depth", "classes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                fail_field(f"model.{name}", value, "an integer >= 1")
        if self.lr <= 0:
            fail_field("model.lr", self.lr, "a learning rate > 0")
        if self.compute_ms < 0:
            fail_field("model.compute_ms", self.compute_ms, "milliseconds >= 0")
        if self.sample_ms < 0:
            fail_field("model.sample_ms", self.sample_ms, "milliseconds per sample >= 0")
        for name in ("gc_heap_objects", "gc_garbage_objects"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                fail_field(f"model.{name}", value, "an integer >= 0")


@dataclass(frozen=True)
class DataRecipe:
    """Seeded random classification data, the same on every run."""

    batch_size: int = 32  #: samples per rank per micro-batch
    seed: int = 1234  #: data seed (the model seed is ``TrainRecipe.seed``)
    workers: int = 0  #: DataLoader worker processes per rank (0: load in the training process)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            fail_field("data.batch_size", self.batch_size, "an integer >= 1")
        if self.workers < 0:
            fail_field("data.workers", self.workers, "an integer >= 0")


@dataclass(frozen=True)
class StragglerRecipe:
    """An injected straggler: ``rank`` spends ``delay_ms`` more per step (``rank: null``: none), before
    its forward, in its backward, or in both (``phase``)."""

    rank: int | None = None  #: global rank to slow down; ``null`` for a clean run
    delay_ms: float = 30.0  #: added time per affected step, milliseconds
    probability: float = 1.0  #: chance per step (1.0: a persistent straggler)
    jitter_ms: float = 0.0  #: uniform +/- spread on affected steps
    seed: int = 0  #: seed of the per-step draws
    #: ``step`` (before the forward), ``backward`` (in backward, at ``model.inject_after``) or
    #: ``forward_backward`` (half in each)
    phase: str = "step"
    spin: bool = False  #: real CPU work instead of a sleep

    def __post_init__(self) -> None:
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 0):
            fail_field("straggler.rank", self.rank, "a global rank >= 0, or null for none")
        if self.phase not in PHASES:
            fail_field("straggler.phase", self.phase, "one of " + ", ".join(PHASES))
        # the field checks of Straggler, also for a section that is switched off (rank: null)
        Straggler(rank=0, delay_ms=self.delay_ms, probability=self.probability, jitter_ms=self.jitter_ms)
        if not isinstance(self.spin, bool):
            fail_field("straggler.spin", self.spin, "true or false")

    def injection(self) -> Straggler | None:
        """The :class:`~pace_strategy.testing.Straggler` this section describes (validated), or ``None``."""
        if self.rank is None:
            return None
        return Straggler(
            rank=self.rank,
            delay_ms=self.delay_ms,
            probability=self.probability,
            jitter_ms=self.jitter_ms,
            seed=self.seed,
            phase=self.phase,
            spin=self.spin,
        )


@dataclass(frozen=True)
class FSDPRecipe:
    """How ``paced_fsdp`` (and the ``fsdp`` baseline) shard the model."""

    min_params: int = 10_000  #: parameters a block must hold to become its own shard group

    def __post_init__(self) -> None:
        if self.min_params < 1:
            fail_field("fsdp.min_params", self.min_params, "an integer >= 1")


@dataclass(frozen=True)
class OutputRecipe:
    """Where the logs, the run record and (optionally) the final weights go."""

    root: str = "runs/recipes"  #: log root (Lightning: TensorBoard root; Accelerate: project_dir parent)
    name: str = "recipe"  #: experiment name under ``root``
    save_weights: str | None = None  #: rank 0 saves the final full state_dict here (``torch.save``)
    #: ``tensorboard`` or ``mlflow`` (a file store, ``$MLFLOW_TRACKING_URI`` or ``ROOT/mlruns``): the
    #: Lightning logger or the Accelerate tracker the job and the ``pace/`` tags log to
    logger: str = "tensorboard"
    log_loss: bool = False  #: the job logs its loss every step, as a user's job does

    def __post_init__(self) -> None:
        if self.logger not in LOGGERS:
            fail_field("output.logger", self.logger, "one of " + ", ".join(LOGGERS))

    def mlflow_uri(self) -> str:
        """The MLflow tracking URI of ``logger: mlflow``: ``$MLFLOW_TRACKING_URI``, else a file store
        in ``ROOT/mlruns`` (then ``MLFLOW_ALLOW_FILE_STORE`` is set for this process and the ranks it
        starts: MLflow 3 refuses a file store without it)."""
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            return uri
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return (Path(self.root).resolve() / "mlruns").as_uri()


@dataclass(frozen=True)
class TrainRecipe:
    """One training job. ``pacing`` holds :class:`~pace_strategy.PacingConfig` fields (empty or null:
    the defaults; for Accelerate, the ``pacing_config:`` section of the accelerate config)."""

    framework: str = "lightning"  #: ``lightning`` or ``accelerate``
    seed: int = 0  #: model seed
    trainer: TrainerRecipe = field(default_factory=TrainerRecipe)
    model: ModelRecipe = field(default_factory=ModelRecipe)
    data: DataRecipe = field(default_factory=DataRecipe)
    straggler: StragglerRecipe = field(default_factory=StragglerRecipe)
    fsdp: FSDPRecipe = field(default_factory=FSDPRecipe)
    output: OutputRecipe = field(default_factory=OutputRecipe)
    pacing: dict[str, Any] | None = field(default_factory=dict)  #: ``pacing=null`` clears the section

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            fail_field("framework", self.framework, "one of " + ", ".join(FRAMEWORKS))
        if self.pacing:
            check_known_keys(self.pacing, list(PacingConfig.__dataclass_fields__), "key", prefix="pacing.")
            self.pacing_config()  # validate now: a bad value fails at load, naming the field
        if self.framework == "accelerate" and self.trainer.strategy not in ("paced_ddp", "ddp"):
            fail_field(
                "trainer.strategy", self.trainer.strategy, "paced_ddp or ddp with framework=accelerate"
            )

    def pacing_config(self) -> PacingConfig | None:
        """The pacing config of the recipe, or ``None`` when the section is empty."""
        return PacingConfig.from_dict(self.pacing) if self.pacing else None

    @property
    def paced(self) -> bool:
        return LIGHTNING_STRATEGIES[self.trainer.strategy][0]

    @property
    def sharded(self) -> bool:
        return LIGHTNING_STRATEGIES[self.trainer.strategy][1]


def load_recipe(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> TrainRecipe:
    """Load a recipe YAML merged with ``key.sub=value`` overrides; unknown keys are errors that name
    the dotted path and suggest the nearest valid key."""
    values = load_mapping(path, overrides)
    where = f"{os.fspath(path)}: " if path is not None else ""
    try:
        return build(TrainRecipe, values)
    except PacingConfigError as error:
        raise PacingConfigError(f"{where}{error}") from error
