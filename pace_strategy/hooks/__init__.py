"""Hooks that feed framework collectives into the Pacer: the DDP comm hook and FSDP2 collectives."""

from pace_strategy.hooks.ddp import PacedHookState, paced_comm_hook, register_paced_hook

__all__ = ["PacedHookState", "paced_comm_hook", "register_paced_hook"]
