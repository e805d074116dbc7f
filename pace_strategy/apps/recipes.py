"""Training recipes: the runners of a :mod:`~pace_strategy.apps.recipe_schema` recipe.

A recipe is the example job of :mod:`pace_strategy.apps.job` (an MLP on seeded random data) with an
optional injected straggler, run by Lightning (``paced_ddp``, ``paced_fsdp`` and their unpaced
baselines) or by Accelerate. The scripts in ``recipes/train/`` call :func:`main_for`; ``pace demo`` is
a built-in recipe plus overrides. CPU or GPU and the process count come from the recipe or an
override (``trainer.accelerator=gpu trainer.devices=8``), nothing else changes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pace_strategy.apps.recipe_schema import TrainRecipe, fail_field, load_recipe
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.shutdown import leave_without_finalization
from pace_strategy.testing import Straggler

__all__ = ["main_for", "one_thread_per_rank", "run_accelerate", "run_lightning"]


# ---------------------------------------------------------------------------------------- the job
def _lightning_strategy(recipe: TrainRecipe) -> Any:
    from pace_strategy.integrations.lightning import PacedDDPStrategy, PacedFSDPStrategy

    name = recipe.trainer.strategy
    pacing = recipe.pacing_config()
    starts = {"paced_ddp": "popen", "paced_ddp_spawn": "spawn", "paced_ddp_fork": "fork"}
    if name in starts:
        return PacedDDPStrategy(pacing=pacing, start_method=starts[name])
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
        LogLoss,
        Progress,
        SaveWeights,
        ShardedExampleModule,
    )
    from pace_strategy.testing import InjectStraggler

    if recipe.framework != "lightning":
        fail_field("framework", recipe.framework, "lightning for run_lightning")
    L.seed_everything(recipe.seed, verbose=False)
    injected = [s for s in (recipe.straggler.injection(),) if s is not None] + list(stragglers)
    all_callbacks: list[Any] = [Progress(recipe.trainer.max_steps, quiet=quiet)]
    if injected:
        all_callbacks.append(InjectStraggler(injected))
    if recipe.output.save_weights:
        all_callbacks.append(SaveWeights(recipe.output.save_weights))
    if recipe.output.log_loss:
        all_callbacks.append(LogLoss())
    all_callbacks += callbacks
    world = recipe.trainer.devices * recipe.trainer.num_nodes
    trainer = L.Trainer(
        accelerator=recipe.trainer.accelerator,
        devices=recipe.trainer.devices,
        num_nodes=recipe.trainer.num_nodes,
        strategy=_lightning_strategy(recipe),
        max_steps=recipe.trainer.max_steps,
        accumulate_grad_batches=recipe.trainer.accumulate,
        logger=_lightning_logger(recipe),
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
    # TensorBoard's version, resolved here: ranks started by spawn or fork write where this launcher
    # reads afterwards (each would otherwise pick the next free version itself)
    getattr(trainer.logger, "log_dir", None)
    trainer.fit(model, loader)
    return trainer


def _lightning_logger(recipe: TrainRecipe) -> Any:
    """The recipe's logger: TensorBoard's under ``ROOT/NAME``, or MLflow's (no ``log_dir``: the run
    record goes where pace_strategy's fallback puts it, ``$PACE_RUN_DIR`` or ``./pace_runs/...``)."""
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger

    output = recipe.output
    if output.logger == "mlflow":
        return MLFlowLogger(experiment_name=output.name, tracking_uri=output.mlflow_uri())
    return TensorBoardLogger(output.root, name=output.name)


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
        fail_field("framework", recipe.framework, "accelerate for run_accelerate")
    project = Path(recipe.output.root) / recipe.output.name
    if recipe.output.logger == "mlflow":  # accelerate's MLflow tracker reads its store from here
        os.environ["MLFLOW_TRACKING_URI"] = recipe.output.mlflow_uri()
    accelerator = Accelerator(
        log_with=recipe.output.logger,
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
            if recipe.output.log_loss:
                accelerator.log({"loss": loss.item()}, step=step)
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
            logs = getattr(trainer.logger, "log_dir", None) or recipe.output.mlflow_uri()
            print(f"trained {trainer.global_step} steps; logs in {logs}", flush=True)
        leave_without_finalization(0)
    leave_without_finalization(run_accelerate(recipe))
