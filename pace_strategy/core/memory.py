"""The device's memory headroom, as rebalancing needs it: a fast rank's share must not outgrow it."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["device_memory_probe"]


def device_memory_probe(device: torch.device) -> Callable[[], float] | None:
    """A function that returns the peak memory allocated on ``device`` so far as a fraction of its
    total (``torch.cuda.max_memory_allocated``: the caching allocator's own count, read without a
    device sync), or ``None`` where there is no device memory to run out of (CPU).

    The peak is the run's so far, never reset: resetting it would change what a user's own
    ``max_memory_allocated`` reports. Scaled by a rank's share it over-estimates the memory a larger
    share needs (the parameters and optimizer state do not grow with it), which errs on the safe side.
    """
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = float(torch.cuda.get_device_properties(index).total_memory)

    def peak_fraction() -> float:
        return torch.cuda.max_memory_allocated(index) / total

    return peak_fraction
