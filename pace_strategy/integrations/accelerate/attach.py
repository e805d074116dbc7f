"""Accelerate adapter: ``attach_pacing(accelerator, model)`` and the ``PACE_*`` environment contract.

Accelerate's config file rejects unknown top-level keys and its ``kwargs_handlers`` reject
third-party classes, so the pacing configuration travels as environment variables: ``pace launch``
reads the ``pacing_config:`` section of the accelerate config and exports them; plain
``accelerate launch`` with ``PACE_*`` set by hand works the same. ``attach_pacing`` registers the
comm hook on the prepared DDP model (accelerate's ``DistributedDataParallelKwargs`` cannot carry a
custom hook) or routes an FSDP2 model's all-gathers and reduce-scatters through the pacer, marks
steps from the model's forward and the optimizer's step, and logs through ``accelerator.log``.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

from torch.nn.parallel import DistributedDataParallel

from pace_strategy.core.config import PacingConfig, check_known_keys
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.hooks.ddp import attach_paced_ddp
from pace_strategy.integrations.data import time_dataloader
from pace_strategy.session import PacingSession

__all__ = ["ENV_PREFIX", "PacingHandle", "attach_pacing", "config_from_env", "config_to_env"]

log = logging.getLogger(__name__)

ENV_PREFIX = "PACE_"
#: ``PACE_*`` variables that are not config fields.
OTHER_ENV = ("PACE_HOSTNAME", "PACE_LOG_LEVEL", "PACE_RUN_DIR", "PACE_CONFIG_SOURCE")


def config_to_env(values: Mapping[str, Any]) -> dict[str, str]:
    """``{"max_delay_ms": 20}`` -> ``{"PACE_MAX_DELAY_MS": "20"}`` (validated first)."""
    PacingConfig.from_dict(values)
    return {
        f"{ENV_PREFIX}{k.upper()}": json.dumps(v) if not isinstance(v, str) else v for k, v in values.items()
    }


def _parse(name: str, text: str, annotation: Any) -> Any:
    kind = str(annotation)
    try:
        if "bool" in kind:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if "int" in kind:
            return int(text)
        if "float" in kind:
            return float(text)
    except ValueError:
        raise PacingConfigError(
            f"environment variable {ENV_PREFIX}{name.upper()}={text!r} is invalid: expected {kind}"
        ) from None
    if get_args(annotation) or "Literal" in kind or "PacingMode" in kind:
        return text.strip('"')
    return text


def config_from_env(environ: Mapping[str, str] | None = None) -> PacingConfig | None:
    """The PacingConfig described by ``PACE_*`` variables, or ``None`` when none is set."""
    environ = os.environ if environ is None else environ
    names = {f.name: f for f in dataclasses.fields(PacingConfig)}
    hints = {f.name: f.type for f in dataclasses.fields(PacingConfig)}
    variables = [k for k in environ if k.startswith(ENV_PREFIX) and k not in OTHER_ENV]
    if not variables:
        return None
    check_known_keys(variables, [f"{ENV_PREFIX}{n.upper()}" for n in names], "pacing environment variable")
    keys = [k[len(ENV_PREFIX) :].lower() for k in variables]
    values = {k: _parse(k, environ[f"{ENV_PREFIX}{k.upper()}"], hints[k]) for k in keys}
    return PacingConfig.from_dict(values)


class PacingHandle:
    """What ``attach_pacing`` returns: the session (``None`` on a single process) and ``finish()``."""

    def __init__(self, session: PacingSession | None) -> None:
        self.session = session
        self.steps = 0  #: synchronized optimizer steps seen

    def finish(self) -> None:
        """End of training on every rank (collective): exchange the rest and close the run record.

        Called for you by ``accelerator.end_training()``.
        """
        if self.session is not None:
            self.session.finish()

    @property
    def record_path(self) -> Path | None:
        return None if self.session is None else self.session.record_path


def _run_dir(accelerator: Any) -> Path:
    explicit = os.environ.get("PACE_RUN_DIR")
    if explicit:
        return Path(explicit)
    for attr in ("logging_dir", "project_dir"):
        value = getattr(accelerator, attr, None)
        if value:
            return Path(value)
    return Path.cwd() / "pace_runs" / time.strftime("%Y%m%d-%H%M%S")


def _is_fsdp2(model: Any) -> bool:
    try:
        from pace_strategy.hooks.fsdp import fsdp_modules
    except ImportError:
        return False
    return bool(fsdp_modules(model))


def attach_pacing(accelerator: Any, model: Any, config: PacingConfig | None = None) -> PacingHandle:
    """Monitor and pace ``model``, the DDP or FSDP2 model returned by ``accelerator.prepare(...)``.

    Call it after ``prepare`` on every rank. The config comes from ``config``, else from ``PACE_*``
    variables (set by ``pace launch`` from the accelerate config's ``pacing_config:`` section), else
    the defaults. Only steps where gradients synchronize are measured and paced, so gradient
    accumulation works. Telemetry goes through ``accelerator.log`` at the synchronized-step index;
    the run record goes in ``accelerator.logging_dir`` (or ``project_dir``, or ``$PACE_RUN_DIR``).
    """
    cfg = config or config_from_env() or PacingConfig()
    if accelerator.num_processes < 2:
        log.warning("pace_strategy: a single process has no skew to monitor; attach_pacing does nothing")
        return PacingHandle(None)
    fsdp = _is_fsdp2(model)
    if not fsdp and not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"attach_pacing needs the model that accelerator.prepare returned, wrapped in "
            f"DistributedDataParallel or sharded with FSDP2 (fsdp_version: 2), got {type(model).__name__}."
        )
    rank = accelerator.process_index
    session = PacingSession.with_side_group(
        cfg,
        rank=rank,
        world_size=accelerator.num_processes,
        device=accelerator.device,
        framework="accelerate",
        log_dir=_run_dir(accelerator) if rank == 0 else None,
        metrics_sink=lambda metrics, step: accelerator.log(dict(metrics), step=step),
        local_rank=accelerator.local_process_index,
    )
    handle = PacingHandle(session)
    if fsdp:
        from pace_strategy.hooks.fsdp import register_paced_collectives

        register_paced_collectives(model, session.pacer)
    else:
        attach_paced_ddp(model, session.pacer)

    # A step begins when its first batch is ready (the timed dataloader), or, for a script that feeds
    # the model itself, at its first forward; it ends after the synchronizing optimizer step. So an
    # accumulated step spans all its micro-batches, and only synchronizing steps are recorded.
    def begin(module: Any, args: Any) -> None:
        session.pacer.begin_step(handle.steps)

    def batch_ready(s: PacingSession) -> None:
        s.pacer.begin_step(handle.steps)

    def end(optimizer: Any, args: Any, kwargs: Any) -> None:
        handle.steps += 1
        session.end_step()

    model.register_forward_pre_hook(begin)
    optimizers = list(getattr(accelerator, "_optimizers", []))
    if not optimizers:
        raise PacingConfigError(
            "attach_pacing found no prepared optimizer: call it after "
            "accelerator.prepare(model, optimizer, ...)"
        )
    for opt in optimizers:
        getattr(opt, "optimizer", opt).register_step_post_hook(end)
    for dataloader in getattr(accelerator, "_dataloaders", []):
        time_dataloader(dataloader, lambda: session, on_batch=batch_ready)

    original_end_training = accelerator.end_training

    def end_training() -> None:
        handle.finish()
        original_end_training()

    accelerator.end_training = end_training
    # A script that never calls end_training still gets its record closed (locally, no collective).
    atexit.register(lambda: session.close(status="incomplete"))
    return handle
