"""pace_strategy: barrier-arrival skew monitoring and adaptive pacing for synchronous data-parallel training.

``import pace_strategy`` registers the ``paced_ddp``, ``paced_ddp_spawn`` and ``paced_fsdp`` Lightning
strategies (in ``lightning.pytorch`` and, when installed, ``pytorch_lightning``) as soon as Lightning is
imported, before or after this package. Nothing heavy is imported here: every public name below is
loaded on first use, so the ``pace`` CLI, ``pace diagnose`` and ``pace simulate`` start without
Lightning or Accelerate.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from pace_strategy._imports import lazy_attributes, when_imported
from pace_strategy._version import __version__

if TYPE_CHECKING:
    from pace_strategy.core import (
        GcSyncConfig,
        HangConfig,
        PaceDistributedError,
        PaceHangError,
        PaceTimeoutError,
        PacingConfig,
        PacingConfigError,
        RebalanceConfig,
    )
    from pace_strategy.data import ShareBatchSampler, share_loss_scale
    from pace_strategy.hooks import attach_paced_ddp
    from pace_strategy.hooks.fsdp import auto_shard, register_paced_collectives
    from pace_strategy.integrations.accelerate import PacingHandle, attach_pacing
    from pace_strategy.integrations.huggingface import PacingCallback
    from pace_strategy.integrations.lightning import PacedDDPStrategy, PacedFSDPStrategy
    from pace_strategy.integrations.pytorch import Pace, PaceSummary, attach
    from pace_strategy.telemetry import RunRecord, read_run_record, summarize

#: public name -> the module that defines it (imported on first access)
_WHERE = {
    **dict.fromkeys(
        (
            "GcSyncConfig",
            "HangConfig",
            "PaceDistributedError",
            "PaceHangError",
            "PaceTimeoutError",
            "PacingConfig",
            "PacingConfigError",
            "RebalanceConfig",
        ),
        "pace_strategy.core",
    ),
    "attach_paced_ddp": "pace_strategy.hooks",
    "auto_shard": "pace_strategy.hooks.fsdp",
    "register_paced_collectives": "pace_strategy.hooks.fsdp",
    "PacingHandle": "pace_strategy.integrations.accelerate",
    "attach_pacing": "pace_strategy.integrations.accelerate",
    "PacingCallback": "pace_strategy.integrations.huggingface",
    "Pace": "pace_strategy.integrations.pytorch",
    "PaceSummary": "pace_strategy.integrations.pytorch",
    "attach": "pace_strategy.integrations.pytorch",
    "PacedDDPStrategy": "pace_strategy.integrations.lightning",
    "PacedFSDPStrategy": "pace_strategy.integrations.lightning",
    "ShareBatchSampler": "pace_strategy.data",
    "share_loss_scale": "pace_strategy.data",
    "RunRecord": "pace_strategy.telemetry",
    "read_run_record": "pace_strategy.telemetry",
    "summarize": "pace_strategy.telemetry",
}

__all__ = [
    "GcSyncConfig",
    "HangConfig",
    "Pace",
    "PaceDistributedError",
    "PaceHangError",
    "PaceSummary",
    "PaceTimeoutError",
    "PacedDDPStrategy",
    "PacedFSDPStrategy",
    "PacingCallback",
    "PacingConfig",
    "PacingConfigError",
    "PacingHandle",
    "RebalanceConfig",
    "RunRecord",
    "ShareBatchSampler",
    "__version__",
    "attach",
    "attach_paced_ddp",
    "attach_pacing",
    "auto_shard",
    "read_run_record",
    "register_paced_collectives",
    "share_loss_scale",
    "summarize",
]

__getattr__ = lazy_attributes(__name__, _WHERE)


def __dir__() -> list[str]:
    return __all__


def _load_adapter(module: str) -> Callable[[], None]:
    # The adapter modules register their strategies when imported, so a hook only imports. When it
    # is the adapter itself that imports Lightning, the hook finds it half-initialized (import
    # returns it as it is) and the adapter registers at its own end.

    def load() -> None:
        importlib.import_module(module)

    return load


when_imported("lightning.pytorch", _load_adapter("pace_strategy.integrations.lightning"))
when_imported("lightning.fabric", _load_adapter("pace_strategy.integrations.fabric"))
when_imported("pytorch_lightning", _load_adapter("pace_strategy.integrations.pytorch_lightning"))
