"""The Pacer: measure each step on this rank, exchange a window, decide identically everywhere, apply.

The adapters (DDP monitors, Lightning, Accelerate) call four methods in this order each step:
``begin_step`` (batch ready), ``enter_sync`` (the step's first gradient is ready, or its first bucket
reaches the comm hook; applies the delay), ``sync_done`` (after DDP has waited for every bucket) or
``sync_done_callback`` (chained onto the last bucket's future) and ``end_step`` (after the optimizer
step). FSDP, whose all-gathers and reduce-scatters are each a sync point, brackets every
collective with ``enter_collective`` / ``exit_collective`` instead (the first applies the delay).
The hot path is a clock mark and an append; everything else happens once per window.

The Pacer decides; it does not summarize. Whoever needs per-step :class:`StepSummary` records (the
session's telemetry thread on rank 0, tests, benchmarks) feeds each ``WindowResult.gathered`` to one
:class:`StepSummarizer` of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pace_strategy.core.clock import Clock, HostClock
from pace_strategy.core.comm import PendingGather, WindowExchange
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PaceDistributedError
from pace_strategy.core.policy import PacingPolicy
from pace_strategy.core.records import NUM_FIELDS, Decision, Field
from pace_strategy.core.skew import WindowStats, window_stats

__all__ = ["Pacer", "WindowResult"]

log = logging.getLogger(__name__)


@dataclass
class _OpenStep:
    """Raw clock marks of the step in progress on this rank (resolved to durations per window)."""

    step: int
    warmup: bool
    start: Any
    begin: Any
    prev_done: Any | None
    ready: Any | None = None
    arrival: Any | None = None
    done: Any | None = None
    end: Any | None = None
    delay_ms: float = 0.0
    data_ms: float = 0.0
    gc_ms: float = 0.0
    gc_collections: int = 0
    samples: int = 0
    #: whether bucket hand-offs are seen (the comm-hook monitor); False: the buckets are not timed
    bucketed: bool = True
    handoffs: list[Any] = field(default_factory=list)
    #: (hand-off, completion) marks of each collective timed on its own (FSDP); empty for DDP buckets
    collectives: list[tuple[Any, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class WindowResult:
    """What one exchanged window produced: the gathered window, its statistics and the new decision.

    Per-step records for telemetry: ``StepSummarizer.summarize(result.gathered)``.
    """

    window: int
    gathered: torch.Tensor  #: the raw window, ``[world_size, steps, NUM_FIELDS]`` float64
    stats: WindowStats
    decision: Decision
    warnings: tuple[str, ...] = ()  #: straggler warnings to log (rate-limited)


class Pacer:
    """Skew monitor and adaptive pacer for one rank of a data-parallel job.

    Args:
        config: the validated pacing configuration.
        group: the process group the window exchange runs on (``None`` for a single process). A
            gloo group works with any training backend and keeps the exchange off the accelerator.
        rank: this rank's index in ``group``.
        world_size: number of ranks in ``group``.
        clock: how durations are measured (:func:`~pace_strategy.core.clock.clock_for_device`).
    """

    def __init__(
        self,
        config: PacingConfig,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        clock: Clock | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.clock: Clock = clock if clock is not None else HostClock()
        self.exchange = WindowExchange(group, rank, world_size, config.exchange_timeout_s)
        self.policy = PacingPolicy(config, world_size)
        self._open: _OpenStep | None = None
        self._unresolved: list[_OpenStep] = []
        self._pending: PendingGather | None = None
        self._prev_end: Any | None = None
        self._prev_done: Any | None = None
        self._pending_data_ms = 0.0
        self._steps_seen = 0
        self._window = 0
        self._delay_ms = 0.0
        self._watch = _StragglerWatch(config, self.clock)
        self.window_work_ns = 0  #: host time end_step spent resolving, exchanging and deciding windows
        self.exchange_wait_ns = 0  #: part of window_work_ns spent blocked waiting for the all-gather
        self.flush_ns = 0  #: host time spent in flush() (end of training; includes waiting for peers)

    # ------------------------------------------------------------------ hot path (every step)
    @property
    def delay_ms(self) -> float:
        """Delay this rank currently applies before its first gradient collective, milliseconds."""
        return self._delay_ms

    @property
    def steps_seen(self) -> int:
        """Steps completed on this rank."""
        return self._steps_seen

    @property
    def decision(self) -> Decision:
        return self.policy.last_decision

    def begin_step(self, step: int) -> None:
        """The step's input is ready. Ignored while a step is already open (gradient accumulation)."""
        if self._open is not None:
            return
        now = self.clock.mark()
        self._open = _OpenStep(
            step=step,
            warmup=self._steps_seen < self.config.warmup_steps,
            start=self._prev_end if self._prev_end is not None else now,
            begin=now,
            prev_done=self._prev_done,
            data_ms=self._pending_data_ms,
        )
        self._pending_data_ms = 0.0

    def add_data_wait(self, ms: float) -> None:
        """The training loop was blocked this long fetching input (host time, milliseconds).

        Counted towards the open step, or, before ``begin_step``, towards the next one."""
        if self._open is not None:
            self._open.data_ms += ms
        else:
            self._pending_data_ms += ms

    def add_gc(self, ms: float, collections: int = 1) -> None:
        """The garbage collector ran this long (milliseconds) during the open step; outside a step
        (validation, checkpointing, between steps) nothing is counted."""
        if self._open is not None:
            self._open.gc_ms += ms
            self._open.gc_collections += collections

    def set_samples(self, samples: int) -> None:
        """The open step trains on ``samples`` samples on this rank (the last call in a step wins;
        with gradient accumulation, the caller passes the step's total)."""
        if self._open is not None:
            self._open.samples = samples

    def interrupt(self) -> None:
        """Something other than training ran since the last step (validation, checkpointing): the next
        step's start is not contiguous with the previous step's end."""
        self._prev_end = None
        self._prev_done = None

    def enter_sync(self, bucketed: bool = True) -> None:
        """The step reaches its sync point: apply the delay, mark arrival.

        Called by the comm hook for the step's first gradient bucket (``bucketed``: later buckets
        follow through :meth:`note_bucket`), or by the grad-ready monitor for the step's first
        gradient (``bucketed=False``: buckets are not timed; the run record's ``buckets`` is 0).
        """
        step = self._open
        if step is None:  # hook fired outside begin/end (a bare DDP loop): open a step implicitly
            self.begin_step(self._steps_seen)
            step = self._open
            assert step is not None
        if step.ready is not None:  # a second backward in the same step: just another hand-off
            step.handoffs.append(self.clock.mark())
            return
        step.ready = self.clock.mark()
        step.bucketed = bucketed
        delay = 0.0 if step.warmup else self._delay_ms
        if delay > 0.0:
            self.clock.delay(delay)
            step.arrival = self.clock.mark()
        else:
            step.arrival = step.ready
        step.delay_ms = delay

    def note_bucket(self) -> None:
        """Called by the comm hook for every later bucket: one mark and one append."""
        if self._open is not None:
            self._open.handoffs.append(self.clock.mark())

    def enter_collective(self) -> Any | None:
        """A collective of the open step is about to be issued (FSDP all-gather or reduce-scatter).

        The step's first collective is its sync point: the delay is applied there, as in
        :meth:`enter_sync`. Returns the hand-off mark for :meth:`exit_collective`, or ``None`` outside
        a training step (validation, checkpointing), where nothing is measured or delayed.
        """
        step = self._open
        if step is None:
            return None
        if step.ready is None:
            self.enter_sync()
            return step.arrival
        start = self.clock.mark()
        step.handoffs.append(start)
        return start

    def exit_collective(self, start: Any | None) -> None:
        """The collective handed off at ``start`` has completed (on CUDA: the mark is enqueued after it
        on the stream that waits for it)."""
        step = self._open
        if step is None or start is None:
            return
        end = self.clock.mark()
        step.collectives.append((start, end))
        step.done = end

    def sync_done(self) -> None:
        """Every gradient collective of the open step has completed (on CUDA: the mark is enqueued on a
        stream that has waited for them). A later call in the same step moves the mark."""
        if self._open is not None:
            self._open.done = self.clock.mark()

    def sync_done_callback(self) -> Callable[[torch.futures.Future[Any]], Any]:
        """A callback for the last bucket's future that marks completion and passes the value through."""
        step = self._open
        clock = self.clock

        def _done(fut: torch.futures.Future[Any]) -> Any:
            value = fut.value()  # re-raises a failed collective before anything is marked
            if step is not None:
                step.done = clock.mark()
            return value

        return _done

    def end_step(self) -> WindowResult | None:
        """The optimizer step is done. Returns a result when a window's exchange has completed."""
        step = self._open
        if step is None:
            return None
        self._open = None
        step.end = self.clock.mark()
        self._prev_end = step.end
        self._prev_done = step.done
        self._steps_seen += 1
        self._unresolved.append(step)
        k = self.config.exchange_every_steps
        due = len(self._unresolved) >= k + self.clock.resolve_lag_steps
        if self._pending is None and not due:
            return None
        # Window work happens here only, once per window; its cost is what monitoring adds to a step.
        started = time.perf_counter_ns()
        result = None
        if self._pending is not None:
            # Launched one step ago: by now it has almost always completed, so this wait is free.
            gathered = self.exchange.wait(self._pending)
            self.exchange_wait_ns += time.perf_counter_ns() - started
            self._pending = None
            result = self._decide(gathered)
        if due:
            self._pending = self._launch(k)
        elapsed_ns = time.perf_counter_ns() - started
        self.window_work_ns += elapsed_ns
        log.debug("step %d: window work %.3f ms", step.step, elapsed_ns / 1e6)
        return result

    # ------------------------------------------------------------------ per window
    def flush(self) -> list[WindowResult]:
        """Exchange everything not yet exchanged (end of training). Every rank must call it.

        Timed apart (``flush_ns``): waiting here for the slowest rank to finish training is not a
        per-step cost."""
        started = time.perf_counter_ns()
        results = []
        if self._pending is not None:
            results.append(self._decide(self.exchange.wait(self._pending)))
            self._pending = None
        if self._unresolved:
            pending = self._launch(len(self._unresolved))
            results.append(self._decide(self.exchange.wait(pending)))
        self.flush_ns += time.perf_counter_ns() - started
        return results

    def _launch(self, count: int) -> PendingGather:
        steps, self._unresolved = self._unresolved[:count], self._unresolved[count:]
        rows = torch.tensor([self._resolve(s) for s in steps], dtype=torch.float64)
        return self.exchange.start(rows, steps[0].step, steps[-1].step)

    def _resolve(self, s: _OpenStep) -> list[float]:
        el = self.clock.elapsed_ms
        row = [0.0] * NUM_FIELDS
        row[Field.STEP] = float(s.step)
        seen = s.ready is not None and s.arrival is not None and s.done is not None
        row[Field.VALID] = 1.0 if seen else 0.0
        row[Field.WARMUP] = 1.0 if s.warmup else 0.0
        if seen and s.collectives:
            blocked = sum(el(a, b) for a, b in s.collectives)
            row[Field.WAIT_MS] = blocked
            row[Field.COMPUTE_MS] = max(el(s.begin, s.done) - blocked - s.delay_ms, 0.0)
        elif seen:
            row[Field.COMPUTE_MS] = el(s.begin, s.ready)
            row[Field.WAIT_MS] = el(s.arrival, s.done)
        row[Field.DELAY_MS] = s.delay_ms
        row[Field.STEP_MS] = el(s.start, s.end)
        row[Field.DATA_MS] = s.data_ms
        row[Field.GAP_MS] = el(s.prev_done, s.begin) if s.prev_done is not None else el(s.start, s.begin)
        if s.bucketed:
            row[Field.BUCKETS] = float(len(s.handoffs) + (1 if s.ready is not None else 0))
        row[Field.GC_MS] = s.gc_ms
        row[Field.GC_COLLECTIONS] = float(s.gc_collections)
        row[Field.SAMPLES] = float(s.samples)
        return row

    def _decide(self, gathered: torch.Tensor) -> WindowResult:
        """Check and decide one gathered window (identically on every rank)."""
        labels = gathered[:, :, Field.STEP]
        if not bool((labels == labels[0:1]).all()):
            raise PaceDistributedError(
                self.rank,
                self.world_size,
                f"ranks disagree on the steps of window {self._window} (first step labels "
                f"{labels[:, 0].tolist()}): every rank must call begin_step/end_step once per "
                "synchronized step.",
            )
        stats = window_stats(self._window, gathered)
        decision = self.policy.update(stats)
        self._delay_ms = decision.delays_ms[self.rank]
        warnings = self._watch.check(stats)
        self._window += 1
        return WindowResult(
            window=stats.window,
            gathered=gathered,
            stats=stats,
            decision=decision,
            warnings=warnings,
        )


class _StragglerWatch:
    """Warns (rate-limited) when the same rank arrives last in most steps for several windows."""

    def __init__(self, config: PacingConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self._rank: int | None = None
        self._streak = 0
        self._last_warned_s: float | None = None

    def check(self, stats: WindowStats) -> tuple[str, ...]:
        if stats.steps == 0 or stats.world_size < 2:
            return ()
        counts = stats.straggler_counts
        rank = max(range(len(counts)), key=counts.__getitem__)
        share = counts[rank] / stats.steps
        if share < self.config.straggler_warn_fraction:
            self._rank, self._streak = None, 0
            return ()
        self._streak = self._streak + 1 if rank == self._rank else 1
        self._rank = rank
        now = self.clock.now_s()
        due = (
            self._last_warned_s is None or now - self._last_warned_s >= self.config.straggler_warn_interval_s
        )
        if self._streak >= self.config.activate_windows and due:
            self._last_warned_s = now
            return (
                f"pace_strategy: rank {rank} is a persistent straggler: it arrived last at the gradient sync "
                f"in {share:.0%} of window {stats.window}'s {stats.steps} steps ({self._streak} windows in a "
                "row); its per-rank lead is in the pace/lead_ms tags.",
            )
        return ()
