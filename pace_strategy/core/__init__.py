"""Framework-agnostic core of pace_strategy: torch and the standard library only."""

from pace_strategy.core.clock import Clock, CudaEventClock, HostClock, ManualClock, clock_for_device
from pace_strategy.core.comm import WindowExchange, gather_json
from pace_strategy.core.config import DDPMonitor, PacingConfig, PacingMode
from pace_strategy.core.errors import PaceDistributedError, PaceTimeoutError, PacingConfigError
from pace_strategy.core.pacer import Pacer, WindowResult
from pace_strategy.core.policy import PacingPolicy
from pace_strategy.core.records import Decision, Field, PolicyState, StepSummary
from pace_strategy.core.skew import (
    WindowStats,
    coefficient_of_variation,
    lead,
    pacable_lead,
    skew,
    window_stats,
)

__all__ = [
    "Clock",
    "CudaEventClock",
    "DDPMonitor",
    "Decision",
    "Field",
    "HostClock",
    "ManualClock",
    "PaceDistributedError",
    "PaceTimeoutError",
    "Pacer",
    "PacingConfig",
    "PacingConfigError",
    "PacingMode",
    "PacingPolicy",
    "PolicyState",
    "StepSummary",
    "WindowExchange",
    "WindowResult",
    "WindowStats",
    "clock_for_device",
    "coefficient_of_variation",
    "gather_json",
    "lead",
    "pacable_lead",
    "skew",
    "window_stats",
]
