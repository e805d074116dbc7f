"""Training recipes: one omegaconf YAML (plus dotlist overrides) -> one typed, validated job.

A recipe is the example job of :mod:`pace_strategy.apps.job` (an MLP on seeded random data) with an
optional injected straggler, run by Lightning (``paced_ddp``, ``paced_fsdp`` and their unpaced
baselines) or by Accelerate. The scripts in ``recipes/train/`` call :func:`main_for`; ``pace demo`` is
a built-in recipe plus overrides. CPU or GPU and the process count come from the recipe or an
override (``trainer.accelerator=gpu trainer.devices=8``), nothing else changes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

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
    "load_recipe",
    "run_accelerate",
    "run_lightning",
]

#: strategy name -> (paced?, FSDP?). ``ddp`` and ``fsdp`` are the unpaced baselines.
LIGHTNING_STRATEGIES = {
    "paced_ddp": (True, False),
    "paced_ddp_spawn": (True, False),
    "paced_fsdp": (True, True),
    "ddp": (False, False),
    "fsdp": (False, True),
}
FRAMEWORKS = ("lightning", "accelerate")


def _fail(where: str, value: Any, expected: str) -> None:
    raise PacingConfigError(f"{where}={value!r} is invalid: expected {expected}.")


@dataclass(frozen=True)
class TrainerRecipe:
    """Where and how long to train."""

    accelerator: str = "cpu"  #: Lightning accelerator name: ``cpu`` or ``gpu`` (Accelerate: from its config)
    devices: int = 2  #: processes per node (Lightning; Accelerate takes ``num_processes`` from its config)
    num_nodes: int = 1  #: nodes (Lightning)
    strategy: str = "paced_ddp"  #: Lightning: paced_ddp, paced_ddp_spawn, paced_fsdp, ddp or fsdp
    max_steps: int = 60  #: optimizer steps
    accumulate: int = 1  #: micro-batches per optimizer step (gradient accumulation)

    def __post_init__(self) -> None:
        if self.strategy not in LIGHTNING_STRATEGIES:
            _fail("trainer.strategy", self.strategy, "one of " + ", ".join(LIGHTNING_STRATEGIES))
        for name in ("devices", "num_nodes", "max_steps", "accumulate"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(f"trainer.{name}", value, "an integer >= 1")


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
            _fail("model.inject_after", self.inject_after, f"a hidden block index in [1, depth={self.depth}]")
        for name in ("inputs", "width", "depth", "classes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                _fail(f"model.{name}", value, "an integer >= 1")
        if self.lr <= 0:
            _fail("model.lr", self.lr, "a learning rate > 0")
        if self.compute_ms < 0:
            _fail("model.compute_ms", self.compute_ms, "milliseconds >= 0")
        if self.sample_ms < 0:
            _fail("model.sample_ms", self.sample_ms, "milliseconds per sample >= 0")
        for name in ("gc_heap_objects", "gc_garbage_objects"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                _fail(f"model.{name}", value, "an integer >= 0")


@dataclass(frozen=True)
class DataRecipe:
    """Seeded random classification data, the same on every run."""

    batch_size: int = 32  #: samples per rank per micro-batch
    seed: int = 1234  #: data seed (the model seed is ``TrainRecipe.seed``)
    workers: int = 0  #: DataLoader worker processes per rank (0: load in the training process)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            _fail("data.batch_size", self.batch_size, "an integer >= 1")
        if self.workers < 0:
            _fail("data.workers", self.workers, "an integer >= 0")


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
            _fail("straggler.rank", self.rank, "a global rank >= 0, or null for none")
        if self.phase not in PHASES:
            _fail("straggler.phase", self.phase, "one of " + ", ".join(PHASES))
        # the field checks of Straggler, also for a section that is switched off (rank: null)
        Straggler(rank=0, delay_ms=self.delay_ms, probability=self.probability, jitter_ms=self.jitter_ms)
        if not isinstance(self.spin, bool):
            _fail("straggler.spin", self.spin, "true or false")

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
            _fail("fsdp.min_params", self.min_params, "an integer >= 1")


@dataclass(frozen=True)
class OutputRecipe:
    """Where the logs, the run record and (optionally) the final weights go."""

    root: str = "runs/recipes"  #: log root (Lightning: TensorBoard root; Accelerate: project_dir parent)
    name: str = "recipe"  #: experiment name under ``root``
    save_weights: str | None = None  #: rank 0 saves the final full state_dict here (``torch.save``)


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
            _fail("framework", self.framework, "one of " + ", ".join(FRAMEWORKS))
        if self.pacing:
            check_known_keys(self.pacing, list(PacingConfig.__dataclass_fields__), "key", prefix="pacing.")
            self.pacing_config()  # validate now: a bad value fails at load, naming the field
        if self.framework == "accelerate" and self.trainer.strategy not in ("paced_ddp", "ddp"):
            _fail("trainer.strategy", self.trainer.strategy, "paced_ddp or ddp with framework=accelerate")

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


# ---------------------------------------------------------------------------------------- the job
def _lightning_strategy(recipe: TrainRecipe) -> Any:
    from pace_strategy.integrations.lightning import PacedDDPStrategy, PacedFSDPStrategy

    name = recipe.trainer.strategy
    pacing = recipe.pacing_config()
    if name in ("paced_ddp", "paced_ddp_spawn"):
        start = "spawn" if name.endswith("spawn") else "popen"
        return PacedDDPStrategy(pacing=pacing, start_method=start)
    if name == "paced_fsdp":
        return PacedFSDPStrategy(pacing=pacing, auto_shard_min_params=recipe.fsdp.min_params)
    if pacing is not None:
        raise PacingConfigError(f"pacing: is set but trainer.strategy={name!r} does not pace; remove one")
    if name == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        world = recipe.trainer.devices * recipe.trainer.num_nodes  # its "auto" means num_nodes
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    return name


def run_lightning(
    recipe: TrainRecipe,
    *,
    stragglers: Sequence[Straggler] = (),
    data_stragglers: Sequence[Straggler] = (),
    callbacks: Sequence[Any] = (),
    quiet: bool = False,
) -> Any:
    """Train the recipe with a Lightning Trainer and return the trainer (after ``fit``).

    ``stragglers`` are injected in addition to the recipe's ``straggler:`` section, ``data_stragglers``
    slow the data loader of their ranks, ``callbacks`` are added to the Trainer's; ``quiet`` drops the
    progress lines. Process-wide settings (threads per rank) are the entry point's business.
    """
    import lightning as L
    from torch.utils.data import DataLoader

    import pace_strategy  # noqa: F401  (registers the strategies)
    from pace_strategy.apps.job import SlowCollate, make_dataset
    from pace_strategy.apps.lightning_job import (
        QUIET_TRAINER,
        ExampleModule,
        Progress,
        SaveWeights,
        ShardedExampleModule,
    )
    from pace_strategy.testing import InjectStraggler

    if recipe.framework != "lightning":
        _fail("framework", recipe.framework, "lightning for run_lightning")
    L.seed_everything(recipe.seed, verbose=False)
    injected = [s for s in (recipe.straggler.injection(),) if s is not None] + list(stragglers)
    all_callbacks: list[Any] = [Progress(recipe.trainer.max_steps, quiet=quiet)]
    if injected:
        all_callbacks.append(InjectStraggler(injected))
    if recipe.output.save_weights:
        all_callbacks.append(SaveWeights(recipe.output.save_weights))
    all_callbacks += callbacks
    world = recipe.trainer.devices * recipe.trainer.num_nodes
    trainer = L.Trainer(
        accelerator=recipe.trainer.accelerator,
        devices=recipe.trainer.devices,
        num_nodes=recipe.trainer.num_nodes,
        strategy=_lightning_strategy(recipe),
        max_steps=recipe.trainer.max_steps,
        accumulate_grad_batches=recipe.trainer.accumulate,
        logger=L.pytorch.loggers.TensorBoardLogger(recipe.output.root, name=recipe.output.name),
        callbacks=all_callbacks,
        **QUIET_TRAINER,
    )
    loader = DataLoader(
        make_dataset(recipe, world),
        batch_size=recipe.data.batch_size,
        shuffle=False,
        collate_fn=SlowCollate(data_stragglers),
        num_workers=recipe.data.workers,
    )
    if recipe.trainer.strategy == "fsdp":
        model: Any = ShardedExampleModule(recipe.model, recipe.fsdp.min_params)
    else:
        model = ExampleModule(recipe.model)
    trainer.fit(model, loader)
    return trainer


def run_accelerate(recipe: TrainRecipe) -> int:
    """Train the recipe with Accelerate (start it with ``pace launch`` or ``accelerate launch``)."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from pace_strategy.apps.job import GcLoad, ProgressLine, build_net, make_dataset
    from pace_strategy.integrations.accelerate import attach_pacing
    from pace_strategy.testing import sleep_injected
    from pace_strategy.testing.slow import arm_injection_points

    if recipe.framework != "accelerate":
        _fail("framework", recipe.framework, "accelerate for run_accelerate")
    project = Path(recipe.output.root) / recipe.output.name
    accelerator = Accelerator(
        log_with="tensorboard",
        project_dir=str(project),
        gradient_accumulation_steps=recipe.trainer.accumulate,
    )
    accelerator.init_trackers("run")
    torch.manual_seed(recipe.seed)
    net = build_net(recipe.model)
    optimizer = torch.optim.SGD(net.parameters(), lr=recipe.model.lr)
    loader = DataLoader(
        make_dataset(recipe, accelerator.num_processes),
        batch_size=recipe.data.batch_size,
        shuffle=False,
        num_workers=recipe.data.workers,
    )
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    pacing = recipe.pacing_config()
    handle = (
        attach_pacing(accelerator, model, pacing, optimizer=optimizer, dataloaders=[loader])
        if recipe.paced
        else None
    )
    injection = recipe.straggler.injection()
    stragglers = [injection] if injection is not None else []
    compute_s = recipe.model.compute_ms / 1e3
    rank, step = accelerator.process_index, 0
    gc_load = GcLoad(recipe.model.gc_heap_objects, recipe.model.gc_garbage_objects, rank, recipe.seed)
    progress = ProgressLine(recipe.trainer.max_steps, quiet=not accelerator.is_main_process)
    for x, y in loader:
        with accelerator.accumulate(model):
            sleep_injected(stragglers, rank, step)
            arm_injection_points(model, tuple(stragglers), rank, step)
            if compute_s > 0:
                time.sleep(compute_s)
            gc_load.step()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            progress.step(step)
    if handle is not None:
        handle.finish()  # collective; before end_training, which ends the trackers and the group
    accelerator.end_training()
    if accelerator.is_main_process:
        record = handle.record_path if handle is not None else None
        print(f"trained {step} steps; logs in {project}; run record {record}", flush=True)
    return 0


def one_thread_per_rank() -> None:
    """One intra-op thread per rank (a process-wide setting, so only entry points call it):
    threads x local ranks > cores makes every step several times slower."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def main_for(framework: str, argv: Sequence[str]) -> int:
    """Entry point of the recipe scripts: ``SCRIPT RECIPE.yaml [key=value ...]``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {framework}_train.py RECIPE.yaml [key.sub=value ...]")
        return 0 if argv else 2
    recipe = load_recipe(argv[0], argv[1:])
    one_thread_per_rank()
    if framework == "lightning":
        trainer = run_lightning(recipe)
        if trainer.global_rank == 0 and trainer.logger is not None:
            print(f"trained {trainer.global_step} steps; logs in {trainer.logger.log_dir}", flush=True)
        leave_without_finalization(0)
    leave_without_finalization(run_accelerate(recipe))


def leave_without_finalization(status: int) -> NoReturn:
    """End a finished training process now, skipping the interpreter's finalization.

    Call it only when everything is closed and flushed (trackers, run record, process groups). With
    gloo, a c10d worker thread that still holds the last reference to a Python-owned tensor when
    finalization starts aborts the process ("terminate called without an active exception",
    SIGABRT; see pytorch/pytorch#179291), so a complete run would report a failure. Seen about once
    in 20-40 runs here, with either DDP monitor.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
