"""Per-rank shares of a constant global batch, by step: the contract between the rebalancing decision
and the data pipeline.

The decision (taken identically on every rank from the exchanged windows) *adds* an entry "from step
``t`` on, rank ``r`` trains on ``samples[r]`` samples"; the batch sampler *reads* the shares of each
step when it builds that step's batch. A data pipeline builds batches ahead of training (DataLoader
workers, Lightning's one-batch prefetch), so an entry may only start at a step no rank has built yet:
the sampler reports the last step it built (:meth:`ShareSchedule.note_built`) and :meth:`add` refuses
an entry that starts at or before it, which would give ranks different splits of the same step.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pace_strategy.core.errors import PacingConfigError

__all__ = ["ShareSchedule", "SharesEntry", "even_shares"]


def even_shares(global_batch: int, world_size: int) -> tuple[int, ...]:
    """The even split of ``global_batch`` samples over ``world_size`` ranks (the remainder goes to the
    lowest ranks, one sample each)."""
    if world_size < 1 or global_batch < world_size:
        raise PacingConfigError(
            f"global batch {global_batch} cannot be split over {world_size} ranks: every rank needs at "
            "least one sample. Raise the batch size or use fewer ranks."
        )
    base, extra = divmod(global_batch, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


@dataclass(frozen=True)
class SharesEntry:
    """From step ``from_step`` on (inclusive), rank ``r`` trains on ``samples[r]`` samples per step."""

    from_step: int
    samples: tuple[int, ...]
    reason: str = ""


class ShareSchedule:
    """An append-only, thread-safe schedule of per-rank shares of a constant global batch.

    Args:
        global_batch: N, samples per step summed over ranks (constant for the whole run).
        world_size: W, number of ranks.
        initial: the shares from step 0 (default: the even split).
    """

    def __init__(self, global_batch: int, world_size: int, initial: Sequence[int] | None = None) -> None:
        self.global_batch = global_batch
        self.world_size = world_size
        first = tuple(initial) if initial is not None else even_shares(global_batch, world_size)
        self._check(first)
        self._entries: list[SharesEntry] = [SharesEntry(0, first, "start")]
        self._starts: list[int] = [0]
        self._built = -1
        self._lock = threading.Lock()

    def _check(self, samples: Sequence[int]) -> None:
        if len(samples) != self.world_size or sum(samples) != self.global_batch or min(samples) < 1:
            raise ValueError(
                f"shares {list(samples)} must be {self.world_size} positive sample counts summing to the "
                f"global batch {self.global_batch}"
            )

    def shares_for_step(self, step: int) -> tuple[int, ...]:
        """The per-rank sample counts of ``step``."""
        with self._lock:
            return self._entries[bisect.bisect_right(self._starts, step) - 1].samples

    def note_built(self, step: int) -> None:
        """The data pipeline has built the batch of ``step`` (its shares are now fixed)."""
        with self._lock:
            self._built = max(self._built, step)

    @property
    def last_built(self) -> int:
        """The last step whose batch the data pipeline has built (-1: none yet)."""
        with self._lock:
            return self._built

    @property
    def current(self) -> SharesEntry:
        """The latest entry (it may start in the future)."""
        with self._lock:
            return self._entries[-1]

    @property
    def entries(self) -> tuple[SharesEntry, ...]:
        with self._lock:
            return tuple(self._entries)

    def restore(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """Re-add checkpointed entries (``{"from_step", "samples", "reason"}``) before the pipeline has
        built a step; entries already held are skipped, so restoring twice is harmless."""
        held = {(e.from_step, e.samples) for e in self.entries}
        for entry in entries:
            key = (int(entry["from_step"]), tuple(int(s) for s in entry["samples"]))
            if key not in held:
                self.add(key[0], key[1], str(entry.get("reason", "")))

    def add(self, from_step: int, samples: Sequence[int], reason: str = "") -> SharesEntry:
        """Append an entry. Raises ``ValueError`` if ``from_step`` is not after every built step and after
        the latest entry's start, or if the shares do not split the global batch."""
        entry = SharesEntry(from_step, tuple(int(s) for s in samples), reason)
        self._check(entry.samples)
        with self._lock:
            if from_step <= self._built or from_step <= self._starts[-1]:
                raise ValueError(
                    f"shares from step {from_step} come too late: the data pipeline has built up to step "
                    f"{self._built} and the latest entry starts at step {self._starts[-1]}"
                )
            self._entries.append(entry)
            self._starts.append(from_step)
        return entry
