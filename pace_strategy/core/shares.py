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
import heapq
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pace_strategy.core.errors import PacingConfigError

__all__ = ["ShareSchedule", "SharesEntry", "best_split", "even_shares"]


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
    """From step ``from_step`` on (inclusive), rank ``r`` trains on ``samples[r]`` samples per step;
    ``balanced``: where cost-balanced batches are on (``balance.enabled``), the step's samples are
    split by their cost (``False``: cut in slices by ``samples``, the plain arm of balancing's A/B
    check, or balancing dropped by it); ``cost``: the cost model's ``(quadratic_tokens, per_sample)``
    fitted online (``balance.fit``) that splits them, ``None``: the configured one."""

    from_step: int
    samples: tuple[int, ...]
    reason: str = ""
    balanced: bool = True
    cost: tuple[float, float] | None = None


#: steps of noted work kept at most
_WORK_STEPS = 1024


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
        #: the ranks whose work the data pipeline notes for the online cost fit (``None``: no fit)
        self.work_ranks: tuple[int, ...] | None = None
        #: the data pipeline splits by a cost of its own (a user's function): the controller fits none
        self.fixed_cost = False
        self._work: dict[int, list[tuple[float, float, float]]] = {}

    def _check(self, samples: Sequence[int]) -> None:
        if len(samples) != self.world_size or sum(samples) != self.global_batch or min(samples) < 1:
            raise ValueError(
                f"shares {list(samples)} must be {self.world_size} positive sample counts summing to the "
                f"global batch {self.global_batch}"
            )

    def shares_for_step(self, step: int) -> tuple[int, ...]:
        """The per-rank sample counts of ``step``."""
        return self.entry_for_step(step).samples

    def entry_for_step(self, step: int) -> SharesEntry:
        """The entry ``step`` runs at (its shares, and whether its samples are cost-balanced)."""
        with self._lock:
            return self._entries[bisect.bisect_right(self._starts, step) - 1]

    def note_built(self, step: int) -> None:
        """The data pipeline has built the batch of ``step`` (its shares are now fixed)."""
        with self._lock:
            self._built = max(self._built, step)

    def note_work(self, step: int, work: Sequence[tuple[float, float, float]]) -> None:
        """The work ``(n, T, Q)`` of each of :attr:`work_ranks` in one batch of ``step`` (the batches
        of a step add up: gradient accumulation); kept until :meth:`take_work` takes the step."""
        with self._lock:
            held = self._work.get(step)
            if held is not None:  # another micro-batch of the step
                work = [(a[0] + b[0], a[1] + b[1], a[2] + b[2]) for a, b in zip(held, work, strict=True)]
            self._work[step] = list(work)
            if len(self._work) > _WORK_STEPS:  # a rank that never takes it (a node leader's follower)
                del self._work[min(self._work)]

    def take_work(self, steps: Sequence[int], up_to: int) -> dict[int, list[tuple[float, float, float]]]:
        """The noted work of ``steps``, and every step up to ``up_to`` forgotten (a window's steps
        once it is gathered: the memory stays a few windows' worth)."""
        with self._lock:
            found = {s: self._work[s] for s in steps if s in self._work}
            for s in [s for s in self._work if s <= up_to]:
                del self._work[s]
        return found

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
        """Re-add checkpointed entries (``{"from_step", "samples", "reason", "balanced", "cost"}``)
        before the pipeline has built a step; entries already held are skipped, so restoring twice is
        harmless."""
        held = {e.from_step for e in self.entries}
        for entry in entries:
            if int(entry["from_step"]) not in held:
                cost = entry.get("cost")
                self.add(
                    int(entry["from_step"]),
                    [int(s) for s in entry["samples"]],
                    str(entry.get("reason", "")),
                    balanced=bool(entry.get("balanced", True)),
                    cost=None if cost is None else (float(cost[0]), float(cost[1])),
                )

    def add(
        self,
        from_step: int,
        samples: Sequence[int],
        reason: str = "",
        *,
        balanced: bool = True,
        cost: tuple[float, float] | None = None,
    ) -> SharesEntry:
        """Append an entry. Raises ``ValueError`` if ``from_step`` is not after every built step and after
        the latest entry's start, or if the shares do not split the global batch."""
        entry = SharesEntry(from_step, tuple(int(s) for s in samples), reason, balanced, cost)
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


def best_split(
    per_sample_ms: Sequence[float],
    global_batch: int,
    quantum: int,
    max_share: float | None = None,
    caps: Sequence[int | None] | None = None,
) -> tuple[tuple[int, ...], float]:
    """The split of ``global_batch`` in whole ``quantum``-sample units (each rank at least one) that
    minimizes the slowest predicted compute ``per_sample_ms[r] * shares[r]``, and that compute (ms).
    ``max_share``: no rank takes more quanta than fit in that multiple of the even share (the even
    split always fits: the cap is at least the even share rounded up to a quantum). ``caps``: per
    rank, the most samples it may take (``None``: no cap; :func:`memory_caps`), at least one quantum;
    ``ValueError`` when together they cannot hold the global batch.

    Greedy: each unit goes to the rank whose compute after taking it is smallest (optimal for a
    min-max of linear loads); among equal loads, to the rank furthest below its share proportional
    to speed, then the lowest rank, so every rank computes the same split. The remainder of the
    global batch that no whole quantum holds goes where it adds least compute (the fastest rank).
    """
    world = len(per_sample_ms)
    units, rest = divmod(global_batch, quantum)
    if units < world:
        raise PacingConfigError(
            f"PacingConfig.rebalance.quantum={quantum} x {world} ranks is more than the global batch of "
            f"{global_batch} samples: every rank needs at least one quantum. Lower rebalance.quantum "
            f"to at most {global_batch // world}."
        )
    times = np.asarray(per_sample_ms, dtype=np.float64)
    t = times.tolist()
    # the speeds added in rank order, one after another (as Python's sum adds them: the tie-break's
    # exact numbers; ``accumulate`` adds sequentially, where numpy's ``sum`` adds pairwise)
    total_speed = float(np.add.accumulate(1.0 / times)[-1])
    even_units = -(-units // world)  # the even share, rounded up to whole quanta
    cap = units if max_share is None else max(even_units, int(max_share * global_batch / world) // quantum)
    most = [c if c is not None else global_batch for c in caps] if caps else None  # samples
    limit = (
        np.full(world, max(1, min(cap, global_batch // quantum)), dtype=np.int64)
        if most is None
        else np.asarray([max(1, min(cap, c // quantum)) for c in most], dtype=np.int64)
    )
    if int(limit.sum()) < units:
        raise ValueError(
            f"the caps {list(caps or [])} do not hold {global_batch} samples in quanta of {quantum}"
        )

    def key(r: int, count: int) -> tuple[float, float, int]:
        # units proportional to speed: how far below that share the rank is breaks ties
        return (t[r] * (count + 1) * quantum, count - units * (1.0 / t[r]) / total_speed, r)

    # The greedy pops the units - W smallest keys of all ranks (each rank's keys grow with its
    # count). Every key whose compute is below a bound T precedes every other key, so the ranks'
    # counts below a T that leaves at most units - W keys under it are taken at once (vectorized,
    # with the keys' own arithmetic), and the heap hands out only the rest (0.1 s per window at
    # 8,192 ranks as one pop per quantum). Only ranks whose next key is among the ``left`` smallest
    # can be popped in ``left`` pops (until then one of those keys is still waiting, and it is
    # smaller), so only they enter the heap. The same split.
    count = _counts_below(times, limit, quantum, units - world)
    left = units - int(count.sum())
    if left:
        open_ = np.flatnonzero(count < limit)  # a rank at its cap takes no more
        nxt = times[open_] * (count[open_] + 1) * quantum
        if len(open_) > left:
            open_ = open_[nxt <= np.partition(nxt, left - 1)[left - 1]]
        heap = [key(int(r), int(count[r])) for r in open_]
        heapq.heapify(heap)
        for _ in range(left):
            r = heapq.heappop(heap)[2]
            count[r] += 1
            if count[r] < limit[r]:
                heapq.heappush(heap, key(r, int(count[r])))
    shares = count * quantum
    if rest:
        room = [i for i in range(world) if most is None or shares[i] + rest <= most[i]]
        r = min(room or range(world), key=lambda i: (t[i] * int(shares[i] + rest), i))
        shares[r] += rest
    return tuple(shares.tolist()), float((times * shares).max())


#: the bisection stops once at most this many keys are left to the heap
_HEAP_KEYS = 16


def _counts_below(times: np.ndarray, limit: np.ndarray, quantum: int, extra: int) -> np.ndarray:
    """Each rank's count (at least 1, at most its limit) once every key ``t[r] * (count + 1) *
    quantum`` below a bound that leaves at most ``extra`` such keys has been taken: the bound a
    short bisection reaches from the keys' continuous estimate (any such bound gives the same
    split; the closer it comes to the largest, the fewer keys the heap hands out after it)."""
    most = limit - 1  # keys a rank has: counts 1 .. limit - 1

    def taken(bound: float) -> np.ndarray:
        # keys c = 1 .. most with t * (c + 1) * quantum < bound, counted with the key's own rounding
        guess = np.clip(np.floor(bound / (times * quantum)) - 1, 0, most).astype(np.int64)
        for _ in range(2):  # the division's rounding: move the guess to the exact boundary
            over = (guess > 0) & ~(times * (guess + 1) * quantum < bound)
            guess = np.where(over, guess - 1, guess)
            under = (guess < most) & (times * (guess + 2) * quantum < bound)
            guess = np.where(under, guess + 1, guess)
        return guess

    lo, hi = 0.0, float(np.max(times * (most + 1) * quantum)) + 1.0
    # Without caps, a rank has about bound / (t * quantum) - 1 keys below a bound: start the bracket
    # at the bound where those add up to ``extra`` (within a key per rank), widened until it holds
    # the answer; caps only make the bracket's first guesses wrong, not the result.
    rate = float(np.sum(1.0 / (times * quantum)))
    width = 2.0 * len(times) / rate
    start = (extra + len(times)) / rate - width
    below = 0
    if start > 0.0 and (n := int(taken(start).sum())) <= extra:
        lo, below = start, n
        while lo + width < hi and (n := int(taken(lo + width).sum())) <= extra:
            lo, below, width = lo + width, n, 2.0 * width
        hi = min(hi, lo + width)
    for _ in range(64):  # bisect towards the largest bound with at most ``extra`` keys below it
        mid = (lo + hi) / 2
        if extra - below <= _HEAP_KEYS or not lo < mid < hi:
            break
        if (n := int(taken(mid).sum())) <= extra:
            lo, below = mid, n
        else:
            hi = mid
    return 1 + taken(lo)
