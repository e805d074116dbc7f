"""pace_strategy: barrier-arrival skew monitoring and adaptive pacing for synchronous data-parallel training.

``import pace_strategy`` registers the ``paced_ddp``, ``paced_ddp_spawn`` and ``paced_fsdp`` Lightning
strategies (in ``lightning.pytorch`` and, when installed, ``pytorch_lightning``).
"""

from __future__ import annotations

import contextlib

from pace_strategy._version import __version__
from pace_strategy.core import (
    Decision,
    PaceDistributedError,
    Pacer,
    PaceTimeoutError,
    PacingConfig,
    PacingConfigError,
    PacingPolicy,
    PolicyState,
    StepSummary,
    WindowResult,
)
from pace_strategy.hooks import (
    GradReadyMonitor,
    PacedHookState,
    attach_paced_ddp,
    paced_comm_hook,
    register_paced_hook,
)
from pace_strategy.inject import Straggler
from pace_strategy.integrations.accelerate import PacingHandle, attach_pacing
from pace_strategy.session import PacingSession
from pace_strategy.telemetry import RunRecord, read_run_record, summarize

# A torch without FSDP2 custom collectives: everything but paced FSDP works.
with contextlib.suppress(ImportError):
    from pace_strategy.hooks.fsdp import auto_shard, register_paced_collectives

__all__ = [
    "Decision",
    "GradReadyMonitor",
    "InjectStraggler",
    "PaceDistributedError",
    "PaceTimeoutError",
    "PacedDDPStrategy",
    "PacedFSDPStrategy",
    "PacedHookState",
    "Pacer",
    "PacingConfig",
    "PacingConfigError",
    "PacingHandle",
    "PacingPolicy",
    "PacingSession",
    "PolicyState",
    "RunRecord",
    "StepSummary",
    "Straggler",
    "WindowResult",
    "__version__",
    "attach_paced_ddp",
    "attach_pacing",
    "auto_shard",
    "paced_comm_hook",
    "read_run_record",
    "register_paced_collectives",
    "register_paced_hook",
    "summarize",
]

try:
    from pace_strategy.integrations.lightning import (
        InjectStraggler,
        PacedDDPStrategy,
        PacedFSDPStrategy,
        register_lightning_strategies,
    )
except ImportError:  # Lightning is optional for the core; the strategies need it
    pass
else:
    register_lightning_strategies()
