"""``InjectionPoint``: where a straggler's time is spent inside the model's forward and backward.

A real slow rank is slow where its compute is, and most of a training step's compute is backward. An
:class:`InjectionPoint` is an identity module without parameters (so it changes neither the weights
nor the state dict) that the model calls between two layers. When armed for the coming step it
spends the forward share there on the forward pass and the backward share when autograd reaches it
on the way back: after the gradients of every layer above it are ready (DDP may have launched their
buckets), before those of the layers below. Placed after the first layer, a backward delay lands at
the very end of the rank's local backward, which the first gradient does not see.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pace_strategy.testing.inject import Straggler, spend_ms

__all__ = ["InjectionPoint", "arm_injection_points"]


class _SpendInBackward(torch.autograd.Function):
    """Identity whose backward first spends ``ms`` (a sleep, or CPU work with ``spin``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ms: float, spin: bool) -> torch.Tensor:
        ctx.ms, ctx.spin = ms, spin
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        spend_ms(ctx.ms, ctx.spin)
        return grad, None, None


class InjectionPoint(nn.Module):
    """Identity in value; spends the time it was armed with in the forward and the backward of the
    next call (once: a later call, such as validation, runs at full speed)."""

    def __init__(self) -> None:
        super().__init__()
        self._forward_ms = 0.0
        self._backward_ms = 0.0
        self._spin = False
        self.spent_ms = 0.0  #: milliseconds spent here so far (forward and backward)

    def arm(self, forward_ms: float, backward_ms: float, spin: bool = False) -> None:
        """Spend ``forward_ms`` in the next forward pass through this point and ``backward_ms`` in its
        backward."""
        self._forward_ms, self._backward_ms, self._spin = forward_ms, backward_ms, spin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        forward_ms, backward_ms, spin = self._forward_ms, self._backward_ms, self._spin
        self._forward_ms = self._backward_ms = 0.0
        if forward_ms > 0:
            spend_ms(forward_ms, spin)
            self.spent_ms += forward_ms
        if backward_ms > 0 and torch.is_grad_enabled() and x.requires_grad:
            self.spent_ms += backward_ms
            return _SpendInBackward.apply(x, backward_ms, spin)
        return x


def arm_injection_points(
    model: nn.Module, stragglers: tuple[Straggler, ...], rank: int, step: int, samples: int = 0
) -> float:
    """Arm ``model``'s injection points with this rank's ``"backward"`` and ``"forward_backward"``
    stragglers at ``step``; returns the milliseconds armed. Raises when such a straggler applies and
    the model has no :class:`InjectionPoint`."""
    forward_ms = backward_ms = 0.0
    spin = False
    for s in stragglers:
        if s.phase == "step":
            continue
        ms = s.delay_at(rank, step, samples)
        spin = spin or s.spin
        if s.phase == "backward":
            backward_ms += ms
        else:  # forward_backward: half each way
            forward_ms += ms / 2
            backward_ms += ms / 2
    if forward_ms == backward_ms == 0.0:
        return 0.0
    points = [m for m in model.modules() if isinstance(m, InjectionPoint)]
    if not points:
        raise ValueError(
            f"a straggler in the backward pass needs an InjectionPoint in the model; "
            f"{type(model).__name__} has none: call one between two layers in forward "
            "(pace_strategy.testing.slow.InjectionPoint)."
        )
    points[0].arm(forward_ms, backward_ms, spin)
    return forward_ms + backward_ms
