"""Hooks that feed framework collectives into the Pacer: the DDP monitors and FSDP2 collectives."""

from pace_strategy.hooks.ddp import (
    GradReadyMonitor,
    PacedHookState,
    attach_paced_ddp,
    paced_comm_hook,
    register_paced_hook,
)

__all__ = ["GradReadyMonitor", "PacedHookState", "attach_paced_ddp", "paced_comm_hook", "register_paced_hook"]
