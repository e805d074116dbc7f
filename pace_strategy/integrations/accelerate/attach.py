"""``attach_pacing``: monitor and pace the model an Accelerator prepared, and the handle that undoes it.

accelerate's ``DistributedDataParallelKwargs`` cannot carry a custom comm hook, so the DDP monitor
goes on the prepared model (an FSDP2 model's all-gathers and reduce-scatters go through the pacer
instead). Steps are marked from the model's forward, the prepared dataloaders and the optimizer's
step; telemetry goes to the accelerator's trackers (:mod:`.trackers`; or a given sink). Everything
registered is kept on the :class:`PacingHandle`, which removes it again
(:meth:`PacingHandle.detach`): a SIGTERM handler too, which closes the run record as ``terminated``
and passes the signal on. The handle is what ``accelerator.register_for_checkpointing`` takes to
save and restore the pacing state.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.driver import PacingDriver
from pace_strategy.integrations._model import data_rebalance, is_paceable, model_is_fsdp2, pace_model
from pace_strategy.integrations._preemption import SigtermHandler
from pace_strategy.integrations.accelerate.trackers import TrackerTags, tensorboard_writers
from pace_strategy.integrations.dashboard import custom_scalars_sink
from pace_strategy.integrations.data import forward_tokens, loader_workers, time_dataloader
from pace_strategy.integrations.env import (
    ENV_PREFIX,
    NON_CONFIG_ENV,
    PacingArg,
    as_pacing_config,
    config_from_env,
    default_run_dir,
    record_dir,
    runs_alone,
)
from pace_strategy.integrations.rebalance import DataRebalance
from pace_strategy.session import PacingSession
from pace_strategy.telemetry.sinks import DashboardSink, MetricsSink
from pace_strategy.telemetry.topology import mesh_coordinates

__all__ = ["PacingHandle", "RebalanceLoop", "attach_pacing", "is_paceable"]

log = logging.getLogger(__name__)

#: id(model) -> the handle attached to it (a handle holds its model: the id is not reused meanwhile).
_ATTACHED: weakref.WeakValueDictionary[int, PacingHandle] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class RebalanceLoop:
    """How the training loop around an attached model draws its batches and normalizes its loss: what
    ``rebalance=True`` needs to know beyond the prepared DataLoader. The defaults describe a script's
    own loop (``accelerator.accumulate`` or none); ``transformers.Trainer`` differs in all three
    (its :class:`~pace_strategy.integrations.huggingface.PacingCallback` says so).

    Args:
        micro_batches: batches per optimizer step (gradient accumulation); ``None``: the
            accelerator's ``gradient_accumulation_steps``.
        prefetch: batches the loop holds ahead of the one it trains (accelerate's DataLoaderShard
            fetches one ahead to tell the last batch).
        loss_over_global_batch: each rank's loss is already normalized by the item count of the whole
            global batch (the Trainer's ``average_tokens_across_devices``): the ranks' gradients then
            already weigh every item alike, whatever the shares, and the share factor ``n_r * W / N``
            is not applied. ``False``: each rank's loss is the mean over its own samples, and the
            factor goes on the gradient.
    """

    micro_batches: int | None = None
    prefetch: int = 1
    loss_over_global_batch: bool = False

    def __post_init__(self) -> None:
        for name in ("micro_batches", "prefetch"):
            value = getattr(self, name)
            least = 1 if name == "micro_batches" else 0
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise PacingConfigError(f"RebalanceLoop.{name}={value!r}: expected an integer >= {least}.")


class PacingHandle(PacingDriver):
    """What :func:`attach_pacing` returns: the :class:`~pace_strategy.driver.PacingDriver` of the
    attached model, whose steps its hooks drive (a step begins at its first batch, from a timed
    dataloader, or at its first forward for a script that feeds the model itself; it ends after the
    synchronizing optimizer step, so an accumulated step spans its micro-batches).

    End training with :meth:`finish` on every rank, or ``accelerator.end_training()``, or run it
    inside ``with handle:`` (normal exit: :meth:`finish`; an exception: the run record is closed as
    failed, locally). :meth:`detach` stops pacing early, on this rank. A script that does none of
    these gets its record closed at exit (``incomplete``, or ``failed`` after an uncaught exception)
    and loses the steps of the last, unexchanged window; one stopped by SIGTERM gets it closed as
    ``terminated`` (see :func:`attach_pacing`).

    Checkpoints: ``accelerator.register_for_checkpointing(handle)`` after :func:`attach_pacing`, and
    ``accelerator.save_state`` / ``load_state`` save and restore the pacing state
    (:meth:`state_dict`, :meth:`load_state_dict`: the step count continues from the saved one; the
    ``resume`` line's ``from`` is null, accelerate does not tell the object where the checkpoint is).
    """

    rebalance: DataRebalance | None  #: the rebalanced training loader (see :func:`_rebalance_data`)

    def __init__(self, model: Any, config: PacingConfig, session: PacingSession | None) -> None:
        super().__init__(config, session)
        self._model = model
        #: attached by ``pace launch`` itself (``zero_code``): the script's own attach_pacing takes it over
        self._automatic = False

    @property
    def record_path(self) -> Path | None:
        """Rank 0: the run record (``None`` on other ranks and on a single process)."""
        return None if self.session is None else self.session.record_path

    @property
    def attached(self) -> bool:
        return _ATTACHED.get(id(self._model)) is self

    # The hooks' entry points.
    def _begin(self, module: Any, args: Any, kwargs: Any) -> None:
        self.begin_forward()
        tokens = forward_tokens(args, kwargs)
        if tokens and self.session is not None:
            self.session.pacer.add_tokens(tokens)

    def _batch_ready(self, session: PacingSession) -> None:
        self.begin_step()

    def _end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.end_step()

    def detach(self) -> None:
        """Remove every hook :func:`attach_pacing` registered and, unless :meth:`finish` did, close
        the run record (status ``detached``). Local (no collective); idempotent. The model can be
        attached again, except with ``ddp_monitor: comm_hook`` (DDP takes one comm hook per model)."""
        super().detach()
        if self.attached:
            del _ATTACHED[id(self._model)]


def attach_pacing(
    accelerator: Any,
    model: Any,
    pacing: PacingArg = None,
    *,
    optimizer: Any | None = None,
    dataloaders: Iterable[Any] | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    metrics_sink: MetricsSink | None = None,
    rebalance_loop: RebalanceLoop | None = None,
    dashboard: DashboardSink | None = None,
) -> PacingHandle:
    """Monitor and pace ``model``, the DDP or FSDP2 model ``accelerator.prepare(...)`` returned.

    Call it after ``prepare`` on every rank (collective: it starts the session). End with
    ``handle.finish()`` on every rank, the handle as a context manager, or ``accelerator.end_training()``
    (it finishes the handle first). Attaching an attached model raises; ``detach()`` first. Under
    ``pace launch`` the model is attached right after ``prepare`` (zero-code pacing); this call then
    returns that handle, or, given any argument below, replaces it.

    Args:
        pacing: the pacing configuration: a :class:`~pace_strategy.PacingConfig` or a mapping of its
            fields, as the other adapters take it; without it, the ``PACE_*`` variables (``pace
            launch`` sets them from the accelerate config's ``pacing_config:`` section), else the
            defaults.
        optimizer: the prepared optimizer whose step ends a training step (default: the one
            optimizer ``prepare`` returned).
        dataloaders: the prepared dataloaders to measure input wait in and to begin steps at their
            first batch (default: every dataloader ``prepare`` returned; ``()`` for none).
        run_dir: the run record's directory (rank 0). Default: ``accelerator.logging_dir`` (the
            trackers' directory; it is ``project_dir`` unless set apart), else ``$PACE_RUN_DIR``,
            else ``./pace_runs/<date-time>``.
        metrics_sink: rank 0: receives every step's ``pace/`` tags and its step, on the telemetry
            thread (default: the accelerator's trackers, :class:`.trackers.TrackerTags`).
        rebalance_loop: with ``rebalance=True``, how the training loop draws batches and normalizes
            its loss (:class:`RebalanceLoop`; default: a script's own loop).
        dashboard: rank 0: receives the tags' TensorBoard custom-scalars layout once (default: the trackers').
    """
    taken = _attached_before(model, (pacing, optimizer, dataloaders, run_dir, metrics_sink))
    if taken is not None:
        return taken
    config = _config_of(pacing)
    # accelerate wraps no model in DDP on one process: nothing to hook, whatever run_dir says
    if runs_alone(
        accelerator.num_processes, run_dir, record_alone=False, runs_as="attach_pacing does nothing"
    ):
        handle = PacingHandle(model, config, None)
        _ATTACHED[id(model)] = handle
        return handle
    fsdp = model_is_fsdp2(model, "attach_pacing needs the model that accelerator.prepare returned")
    optimizer = _the_optimizer(accelerator) if optimizer is None else optimizer
    loaders = _prepared(accelerator, "dataloader") if dataloaders is None else list(dataloaders)
    rank, trackers = accelerator.process_index, TrackerTags(accelerator) if metrics_sink is None else None
    session = PacingSession.with_side_group(
        config,
        rank=rank,
        world_size=accelerator.num_processes,
        device=accelerator.device,
        framework="accelerate",
        log_dir=_run_dir(accelerator, run_dir) if rank == 0 else None,
        metrics_sink=metrics_sink if trackers is None else trackers.write,
        dashboard=dashboard or custom_scalars_sink(lambda: tensorboard_writers(accelerator)),
        local_rank=accelerator.local_process_index,
        coordinates=accelerator_coordinates(accelerator),
    )
    handle = PacingHandle(model, config, session)
    _ATTACHED[id(model)] = handle
    try:
        loop = rebalance_loop or RebalanceLoop()
        if config.splits_batches:
            micro_batches = loop.micro_batches or int(getattr(accelerator, "gradient_accumulation_steps", 1))
            _rebalance_data(handle, session, loaders, fsdp, micro_batches, loop.prefetch)
        pace_model(handle, model, session, fsdp, scale_gradient=not loop.loss_over_global_batch)
        _register(handle, model, session, optimizer, loaders, trackers)
    except BaseException:
        handle.detach()
        raise
    _handle_sigterm(handle, session)
    _finish_before_end_training(handle, accelerator)
    return handle


def accelerator_coordinates(accelerator: Any) -> dict[str, int] | None:
    """This rank's coordinates in the device mesh of the accelerator's ``ParallelismConfig``
    (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``), or ``None`` without one. A dimension the
    record has no name for (accelerate's ``sp``) leaves the coordinates out, said once."""
    mesh = getattr(getattr(accelerator, "state", None), "device_mesh", None)
    if mesh is None:
        return None
    try:
        return mesh_coordinates(mesh)
    except ValueError as error:
        log.warning("pace_strategy: the accelerator's device mesh is not recorded: %s", error)
        return None


def _config_of(pacing: PacingArg) -> PacingConfig:
    """The configuration ``attach_pacing`` was given, else the ``PACE_*`` variables', else the defaults."""
    if pacing is None:
        return config_from_env() or PacingConfig()
    if any(k.startswith(ENV_PREFIX) and k not in NON_CONFIG_ENV for k in os.environ):
        log.info("pace_strategy: attach_pacing(pacing=...) given; PACE_* config variables are ignored")
    return as_pacing_config(pacing)


def _finish_before_end_training(handle: PacingHandle, accelerator: Any) -> None:
    """``accelerator.end_training()`` finishes the handle first: a script that ends the way Accelerate's
    examples end (no ``with``, no ``finish()``) loses no step. ``end_training`` runs on every rank, so
    the last exchange is safe there, and it has to come first: ``end_training`` ends the trackers the
    last steps go to and the process group. Only this accelerator's method is wrapped (an instance
    attribute, removed by :meth:`PacingHandle.detach`)."""
    end_training = accelerator.end_training

    @functools.wraps(end_training)
    def paced_end_training(*args: Any, **kwargs: Any) -> Any:
        handle.finish()
        return end_training(*args, **kwargs)

    def restore() -> None:
        if vars(accelerator).get("end_training") is paced_end_training:
            del accelerator.end_training

    accelerator.end_training = paced_end_training
    handle.on_detach(restore)


def _handle_sigterm(handle: PacingHandle, session: PacingSession) -> None:
    """SIGTERM (a scheduler's preemption) closes the run record as ``terminated``, locally: no
    collective in a signal handler (the peers are being stopped too); then the signal goes on to the
    handler that was there before (by default the process ends, as it would have). Removed by
    :meth:`PacingHandle.detach`."""

    def terminate(signum: int) -> None:
        session.terminate(f"SIGTERM (signal {signum})")

    sigterm = SigtermHandler(terminate)
    if sigterm.install():
        handle.on_detach(sigterm.remove)


def _attached_before(model: Any, given: tuple[Any, ...]) -> PacingHandle | None:
    """The handle ``pace launch`` attached to ``model``, taken over by the script when it gives no
    argument (``given``: the arguments that would change it); ``None`` otherwise (that attach undone
    when there was one). A model the script itself attached already fails."""
    attached = _ATTACHED.get(id(model))
    if attached is None:
        return None
    if not attached._automatic:
        raise PacingConfigError(
            f"attach_pacing: this {type(model).__name__} is already paced (by the handle the first "
            "attach_pacing call returned); use that handle, or call its detach() before attaching "
            "again."
        )
    if all(a is None for a in given):
        # the attach pace launch made is this call's: the script takes that handle over
        attached._automatic = False
        return attached
    _take_over(attached)
    return None


def _take_over(automatic: PacingHandle) -> None:
    """Remove the handle ``pace launch`` attached, so that the script's own attach_pacing call, with
    its own arguments, attaches instead. Local; a session that saw no step leaves no run record."""
    if automatic.config.ddp_monitor == "comm_hook" and automatic.session is not None:
        raise PacingConfigError(
            "attach_pacing: pace launch already attached this model with ddp_monitor: comm_hook (from "
            "the pacing_config section), and DDP takes one comm hook per model, so it cannot be "
            "attached again with other arguments. Call attach_pacing(accelerator, model) without "
            "arguments to use that handle, or set the fields in pacing_config."
        )
    log.info("pace_strategy: attach_pacing replaces the pacing that pace launch attached to this model")
    automatic.detach()


def _register(
    handle: PacingHandle,
    model: Any,
    session: PacingSession,
    optimizer: Any,
    loaders: list[Any],
    trackers: TrackerTags | None,
) -> None:
    """The step's hooks: a forward begins it (unless a batch did), the optimizer's step ends it;
    after it the queued tags go to the non-TensorBoard ``trackers`` (on the training thread)."""
    undo = handle.on_detach  # undone in reverse order
    if trackers is not None:
        undo(trackers.flush)  # at detach: after finish published the last window
    undo(model.register_forward_pre_hook(handle._begin, with_kwargs=True).remove)
    # accelerate's optimizer wrapper steps the wrapped optimizer only where gradients synchronize.
    inner = getattr(optimizer, "optimizer", optimizer)
    end: Callable[..., None] = handle._end
    if trackers is not None:  # one hook: the step ends, then the tags go out

        def end(*args: Any) -> None:
            handle._end(*args)
            trackers.flush()

    undo(inner.register_step_post_hook(end).remove)
    if inner is not optimizer:
        undo(_end_skipped_steps(handle, optimizer))
    for loader in loaders:
        session.note_dataloader_workers(loader_workers(loader))
        hook = time_dataloader(loader, lambda: handle.live_session, on_batch=handle._batch_ready)
        if hook is not None:
            undo(hook.remove)


def _end_skipped_steps(handle: PacingHandle, optimizer: Any) -> Callable[[], None]:
    """End the steps that accelerate's optimizer wrapper skips under a ``GradScaler`` (fp16: the
    gradients overflowed, as at its first scales). The wrapped optimizer's own step does not run
    there, so its post hook does not end the step; yet the loop's optimizer step is done and the
    gradients were synchronized on every rank (an overflow reaches every rank through the
    all-reduce, so they all skip alike). Without this the next batch would join the skipped one's
    step. Wraps this wrapper's ``step`` (the instance's, no other); returns the undo."""
    original = optimizer.step
    had_own = "step" in vars(optimizer)

    def step(*args: Any, **kwargs: Any) -> Any:
        ended = handle.steps
        result = original(*args, **kwargs)
        # a micro-batch that does not synchronize steps nothing (and keeps the last step's flag)
        state = getattr(optimizer, "gradient_state", None)
        syncs = state is None or bool(getattr(state, "sync_gradients", True))
        if syncs and handle.steps == ended and getattr(optimizer, "step_was_skipped", False):
            handle.end_step()
        return result

    optimizer.step = step

    def undo() -> None:
        if vars(optimizer).get("step") is step:
            if had_own:
                optimizer.step = original
            else:
                del optimizer.step

    return undo


def _rebalance_data(
    handle: PacingHandle,
    session: PacingSession,
    loaders: list[Any],
    fsdp: bool,
    micro_batches: int,
    prefetch: int,
) -> None:
    """``rebalance=True``: the one training loader rebuilt in place around the rebalancing batch
    sampler; the loss scale goes on the gradient, in a DDP comm hook (``accelerator.backward`` has no
    hook for the loss), unless the loop's loss is normalized over the global batch already
    (:class:`RebalanceLoop`). DDP's comm hook stays registered after :meth:`PacingHandle.detach` (DDP
    cannot remove one), at factor 1.0 once no batch comes from the rebalanced loader."""
    if len(loaders) != 1 and not fsdp:
        raise PacingConfigError(
            f"rebalance=True needs the one training DataLoader, found {len(loaders)} prepared: pass "
            "attach_pacing(..., dataloaders=[train_loader])."
        )
    rebalance = data_rebalance(handle, session, fsdp, lambda: handle.steps, prefetch, micro_batches)
    rebalance.replace_prepared(loaders[0])


def _prepared(accelerator: Any, kind: Literal["optimizer", "dataloader"]) -> list[Any]:
    """The optimizers or dataloaders ``accelerator.prepare`` returned so far.

    accelerate (1.16) keeps them in the private lists ``Accelerator._optimizers`` and
    ``Accelerator._dataloaders`` and has no public accessor. This is the only place pace_strategy
    reads them (tests/unit/test_accelerate_attach.py fails when they move);
    ``attach_pacing(optimizer=..., dataloaders=...)`` needs no read at all.
    """
    attribute = f"_{kind}s"
    found = getattr(accelerator, attribute, None)
    if not isinstance(found, list):
        try:
            version = importlib.metadata.version("accelerate")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        argument = "optimizer=" if kind == "optimizer" else "dataloaders=[...]"
        raise PacingConfigError(
            f"attach_pacing cannot find the prepared {kind}s: this accelerate ({version}) has no list "
            f"Accelerator.{attribute} (it had in 1.16). Pass {argument} to attach_pacing."
        )
    return list(found)


def _the_optimizer(accelerator: Any) -> Any:
    optimizers = _prepared(accelerator, "optimizer")
    if len(optimizers) != 1:
        raise PacingConfigError(
            f"attach_pacing found {len(optimizers)} prepared optimizers: "
            + (
                "call it after accelerator.prepare(model, optimizer, ...)"
                if not optimizers
                else "pass optimizer= the one whose step ends a training step"
            )
        )
    return optimizers[0]


def _run_dir(accelerator: Any, run_dir: str | os.PathLike[str] | None) -> Path:
    """Explicit ``run_dir`` > the accelerator's logging (else project) dir > ``$PACE_RUN_DIR`` > a new
    ``./pace_runs/<date-time>``: explicit arguments beat environment variables."""
    logged = getattr(accelerator, "logging_dir", None) or getattr(accelerator, "project_dir", None)
    found = record_dir(run_dir, logged, fallback=default_run_dir())
    assert found is not None, "a fallback is given"
    return found
