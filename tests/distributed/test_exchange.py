"""Real gloo groups on thread ranks: the exchange, agreement of decisions, an injected straggler, timeouts."""

import statistics
import threading
import time

import pytest
import torch

from pace_strategy import PaceDistributedError, PaceTimeoutError, PacingConfig
from pace_strategy.core.comm import gather_json
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.summary import StepSummarizer
from pace_strategy.session import PacingSession
from tests.distributed.ranks import raise_first, run_ranks


def train_steps(pacer, group, rank, steps, compute_ms):
    """A bulk-synchronous loop with a real all-reduce as the sync point, timed by the pacer."""
    results = []
    grad = torch.ones(1024)
    for step in range(steps):
        pacer.begin_step(step)
        time.sleep(compute_ms(rank, step) / 1e3)
        pacer.enter_sync()
        fut = group.allreduce([grad]).get_future().then(pacer.sync_done_callback())
        fut.wait()
        result = pacer.end_step()
        if result is not None:
            results.append(result)
    return results + pacer.flush()


def summarize(cfg, windows):
    """One rank's per-step records: one summarizer over its windows, in order."""
    summarizer = StepSummarizer(cfg.cv_window_steps)
    return [s for w in windows for s in summarizer.summarize(w.gathered)]


@pytest.mark.timeout(60)
def test_injected_straggler_is_detected_by_every_rank_identically():
    cfg = PacingConfig(mode="monitor", exchange_every_steps=5, warmup_steps=2)

    def fn(rank, group):
        pacer = Pacer(cfg, group, rank, 4)
        return train_steps(pacer, group, rank, 24, lambda r, s: 5.0 + (30.0 if r == 2 else 0.0))

    per_rank = raise_first(run_ranks(4, fn))
    summaries = [summarize(cfg, windows) for windows in per_rank]
    assert all(len(s) == 24 for s in summaries)
    # every rank computed exactly the same summaries from the gathered data
    assert all(s == summaries[0] for s in summaries[1:])
    post = [s for s in summaries[0] if not s.warmup]
    share = sum(s.straggler_rank == 2 for s in post) / len(post)
    assert share >= 0.9, [s.straggler_rank for s in post]
    assert sum(s.compute_straggler_rank == 2 for s in post) / len(post) >= 0.9
    median_skew = statistics.median(s.skew_ms for s in post)
    assert 20.0 < median_skew < 40.0, median_skew


@pytest.mark.timeout(60)
def test_forced_pacing_decisions_agree_and_delay_only_leading_ranks():
    cfg = PacingConfig(
        mode="forced",
        exchange_every_steps=4,
        warmup_steps=1,
        max_delay_ms=10.0,
        max_delay_step_fraction=0.5,
        persist_fraction=0.5,
    )

    def fn(rank, group):
        pacer = Pacer(cfg, group, rank, 3)
        windows = train_steps(pacer, group, rank, 20, lambda r, s: 40.0 if r == 0 else 10.0)
        return [w.decision for w in windows]

    decisions = raise_first(run_ranks(3, fn))
    assert decisions[0] == decisions[1] == decisions[2]
    paced = [d for d in decisions[0] if d.pacing_active]
    assert paced, "forced mode applied no delay despite a 30 ms lead"
    for d in paced:
        assert d.delays_ms[0] == 0.0  # rank 0 is the straggler
        assert all(0.0 <= d.delays_ms[r] <= 10.0 for r in (1, 2)), d.delays_ms
    # Each leading rank is delayed in most paced windows: one window of a loaded machine can see a
    # leader's sleeps overshoot by its whole lead (CI saw rank 2 at 0 ms beside rank 1 at 1.2 ms).
    for r in (1, 2):
        assert sum(d.delays_ms[r] > 0.0 for d in paced) > len(paced) / 2, [d.delays_ms for d in paced]


def exchange_with_missing_peer(peer_behaviour, timeout_s=1.5):
    """Rank 0 runs two steps and exchanges them; rank 1 never joins (it hangs, or it dies)."""
    cfg = PacingConfig(mode="monitor", exchange_every_steps=2, warmup_steps=0, exchange_timeout_s=timeout_s)
    released, set_up = threading.Event(), threading.Event()

    def fn(rank, group):
        pacer = Pacer(cfg, group, rank, 2)
        if rank == 1:
            # not before rank 0 has its connections: a peer gone while gloo still connects the mesh
            # fails the set-up, not the exchange under test (seen once under load)
            set_up.wait(20)
            if peer_behaviour == "hang":
                released.wait(20)  # alive, connection open, but never enters the exchange
            return peer_behaviour  # "die": returning drops the group and closes its connections
        set_up.set()
        if peer_behaviour == "die":
            time.sleep(0.5)
        for step in range(2):
            pacer.begin_step(step)
            pacer.enter_sync()
            pacer.end_step()
        started = time.monotonic()
        try:
            pacer.flush()
        except PaceDistributedError as error:
            return error, time.monotonic() - started
        finally:
            released.set()
        return None

    return run_ranks(2, fn, timeout_s=30)


@pytest.mark.timeout(60)
def test_a_hung_rank_makes_the_others_fail_within_the_timeout():
    results = exchange_with_missing_peer("hang", timeout_s=1.5)
    error, elapsed = results[0]
    assert isinstance(error, PaceTimeoutError), error
    assert str(error).startswith("[rank 0/2] ")
    assert "steps 0..1" in str(error) and "exchange_timeout_s" in str(error)
    assert 1.0 < elapsed < 10.0


@pytest.mark.timeout(60)
def test_a_dead_rank_makes_the_others_fail_at_once_with_a_clear_error():
    results = exchange_with_missing_peer("die", timeout_s=30.0)
    error, elapsed = results[0]
    assert isinstance(error, PaceDistributedError) and not isinstance(error, PaceTimeoutError), error
    assert str(error).startswith("[rank 0/2] ") and "peer rank probably died" in str(error)
    assert elapsed < 10.0


@pytest.mark.timeout(30)
def test_gather_json_collects_every_rank():
    results = raise_first(
        run_ranks(3, lambda rank, g: gather_json(g, rank, 3, {"rank": rank, "h": "x" * rank}, 10))
    )
    assert results[0] == results[1] == results[2] == [{"rank": r, "h": "x" * r} for r in range(3)]


@pytest.mark.timeout(30)
def test_session_start_gathers_every_ranks_placement():
    def fn(rank, group):
        session = PacingSession.start(
            PacingConfig(run_record=False),
            rank=rank,
            world_size=3,
            device=torch.device("cpu"),
            group=group,
            framework="test",
            local_rank=rank,
        )
        session.close()
        return session.topology

    results = raise_first(run_ranks(3, fn))
    assert results[0] == results[1] == results[2]
    assert [(p["rank"], p["local_rank"]) for p in results[0]] == [(0, 0), (1, 1), (2, 2)]
