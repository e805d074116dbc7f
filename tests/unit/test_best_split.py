"""The split's fast path gives exactly the split of the one-quantum-at-a-time greedy it replaces
(kept here as the reference), on random speeds, batches, quanta, caps and share limits."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from pace_strategy.core.shares import best_split


def reference_split(
    per_sample_ms: Sequence[float],
    global_batch: int,
    quantum: int,
    max_share: float | None = None,
    caps: Sequence[int | None] | None = None,
) -> tuple[tuple[int, ...], float]:
    """The greedy as written before the fast path (pace_strategy 0.x): a heap pop per quantum."""
    world = len(per_sample_ms)
    units, rest = divmod(global_batch, quantum)
    t = [float(v) for v in per_sample_ms]
    speed = [1.0 / v for v in t]
    total_speed = sum(speed)
    ideal = [units * v / total_speed for v in speed]
    even_units = -(-units // world)
    cap = units if max_share is None else max(even_units, int(max_share * global_batch / world) // quantum)
    most = [c if c is not None else global_batch for c in (caps or [None] * world)]
    limit = [max(1, min(cap, c // quantum)) for c in most]

    def key(r: int, count: int) -> tuple[float, float, int]:
        return (t[r] * (count + 1) * quantum, count - ideal[r], r)

    count = [1] * world
    heap = [key(r, 1) for r in range(world) if limit[r] > 1]
    heapq.heapify(heap)
    for _ in range(units - world):
        r = heapq.heappop(heap)[2]
        count[r] += 1
        if count[r] < limit[r]:
            heapq.heappush(heap, key(r, count[r]))
    shares = [c * quantum for c in count]
    if rest:
        room = [i for i in range(world) if shares[i] + rest <= most[i]]
        r = min(room or range(world), key=lambda i: (t[i] * (shares[i] + rest), i))
        shares[r] += rest
    return tuple(shares), max(t[r] * shares[r] for r in range(world))


@st.composite
def splits(draw):
    world = draw(st.integers(1, 40))
    quantum = draw(st.integers(1, 8))
    units = draw(st.integers(world, world * 12))
    global_batch = units * quantum + draw(st.integers(0, quantum - 1))
    # speeds with ties (a few distinct values) and without
    levels = draw(st.lists(st.floats(0.05, 5.0, allow_nan=False), min_size=1, max_size=4))
    per_sample = [draw(st.sampled_from(levels)) if draw(st.booleans()) else draw(st.floats(0.05, 5.0))
                  for _ in range(world)]  # fmt: skip
    max_share = draw(st.none() | st.floats(1.0, 3.0))
    caps = draw(
        st.none() | st.lists(st.none() | st.integers(quantum, global_batch), min_size=world, max_size=world)
    )
    return per_sample, global_batch, quantum, max_share, caps


@settings(max_examples=400, deadline=None)
@given(splits())
def test_the_fast_split_is_the_greedys(case):
    per_sample, global_batch, quantum, max_share, caps = case
    try:
        want = reference_split(per_sample, global_batch, quantum, max_share, caps)
    except IndexError:  # caps that cannot hold the batch: best_split refuses them first
        return
    most = [c if c is not None else global_batch for c in (caps or [None] * len(per_sample))]
    if sum(max(1, c // quantum) for c in most) * quantum < global_batch - global_batch % quantum:
        return
    try:
        got = best_split(per_sample, global_batch, quantum, max_share, caps)
    except ValueError:
        return  # refused, as the reference would have been (its heap runs dry)
    assert got == want


def test_the_fast_split_at_thousands_of_ranks_with_ties():
    per_sample = [1.0, 1.0, 2.0, 0.5] * 512  # 2,048 ranks, four speeds: wide ties at every level
    assert best_split(per_sample, 32 * 2048, 8) == reference_split(per_sample, 32 * 2048, 8)
    assert best_split(per_sample, 32 * 2048, 8, max_share=1.5) == reference_split(
        per_sample, 32 * 2048, 8, max_share=1.5
    )
