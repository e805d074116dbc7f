"""Framework-agnostic core of pace_strategy: torch and the standard library only.

Names load on first use: the stdlib-only parts (config, errors, records, glossary) serve
``pace diagnose`` and the run-record reader without importing torch. (A public name never equals a
submodule's: once imported, the submodule would shadow it.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pace_strategy._imports import lazy_attributes

if TYPE_CHECKING:
    from pace_strategy.core.clock import Clock, CudaEventClock, HostClock, ManualClock, clock_for_device
    from pace_strategy.core.comm import WindowExchange, gather_json
    from pace_strategy.core.config import (
        DDPMonitor,
        GcSyncConfig,
        HangConfig,
        PacingConfig,
        PacingMode,
        RebalanceConfig,
    )
    from pace_strategy.core.errors import (
        PaceDistributedError,
        PaceHangError,
        PaceTimeoutError,
        PacingConfigError,
    )
    from pace_strategy.core.exchange import WindowResult
    from pace_strategy.core.gc_monitor import GcMonitor
    from pace_strategy.core.gc_sync import GcSync
    from pace_strategy.core.glossary import (
        coefficient_of_variation,
        lead_ms,
        skew_ms,
        straggler_rank,
        transfer_ms,
    )
    from pace_strategy.core.pacer import Pacer
    from pace_strategy.core.policy import PacingPolicy
    from pace_strategy.core.rebalance import RebalanceDecision, RebalancePolicy, RebalanceState
    from pace_strategy.core.records import Decision, Field, GcCollect, PolicyState, StepSummary
    from pace_strategy.core.skew import WindowStats, pacable_lead, window_stats
    from pace_strategy.core.summary import StepSummarizer

_MODULES: dict[str, tuple[str, ...]] = {
    "clock": ("Clock", "CudaEventClock", "HostClock", "ManualClock", "clock_for_device"),
    "comm": ("WindowExchange", "gather_json"),
    "config": ("DDPMonitor", "GcSyncConfig", "HangConfig", "PacingConfig", "PacingMode", "RebalanceConfig"),
    "errors": ("PaceDistributedError", "PaceHangError", "PaceTimeoutError", "PacingConfigError"),
    "gc_monitor": ("GcMonitor",),
    "gc_sync": ("GcSync",),
    "glossary": ("coefficient_of_variation", "lead_ms", "skew_ms", "straggler_rank", "transfer_ms"),
    "pacer": ("Pacer",),
    "exchange": ("WindowResult",),
    "policy": ("PacingPolicy",),
    "rebalance": ("RebalanceDecision", "RebalancePolicy", "RebalanceState"),
    "records": ("Decision", "Field", "GcCollect", "PolicyState", "StepSummary"),
    "skew": ("WindowStats", "pacable_lead", "window_stats"),
    "summary": ("StepSummarizer",),
}
_WHERE = {name: f"{__name__}.{module}" for module, names in _MODULES.items() for name in names}

__all__ = [
    "Clock",
    "CudaEventClock",
    "DDPMonitor",
    "Decision",
    "Field",
    "GcCollect",
    "GcMonitor",
    "GcSync",
    "GcSyncConfig",
    "HangConfig",
    "HostClock",
    "ManualClock",
    "PaceDistributedError",
    "PaceHangError",
    "PaceTimeoutError",
    "Pacer",
    "PacingConfig",
    "PacingConfigError",
    "PacingMode",
    "PacingPolicy",
    "PolicyState",
    "RebalanceConfig",
    "RebalanceDecision",
    "RebalancePolicy",
    "RebalanceState",
    "StepSummarizer",
    "StepSummary",
    "WindowExchange",
    "WindowResult",
    "WindowStats",
    "clock_for_device",
    "coefficient_of_variation",
    "gather_json",
    "lead_ms",
    "pacable_lead",
    "skew_ms",
    "straggler_rank",
    "transfer_ms",
    "window_stats",
]

__getattr__ = lazy_attributes(__name__, _WHERE)


def __dir__() -> list[str]:
    return __all__
