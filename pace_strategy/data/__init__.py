"""Data-path pieces of the mitigations (torch only): the rebalancing batch sampler and its loss scale."""

from __future__ import annotations

from pace_strategy.data.share_sampler import (
    BuiltBatch,
    ShareBatchSampler,
    restore_schedule,
    scaled_shares,
    share_loss_scale,
)

__all__ = ["BuiltBatch", "ShareBatchSampler", "restore_schedule", "scaled_shares", "share_loss_scale"]
