"""The Pacer: measure each step on this rank, exchange a window, decide identically everywhere, apply.

The adapters (DDP monitors, Lightning, Accelerate) call five methods in this order each step:
``begin_step`` (batch ready), ``enter_sync`` (the step's first gradient is ready, or its first bucket
reaches the comm hook: the last moment that can still hold the rank before its first collective, so
the delay is applied there), ``arrive`` (the end of the rank's local backward: its last gradient is
ready for the collective; this is the rank's **arrival**), ``sync_done`` (after DDP has waited for
every bucket) or ``sync_done_callback`` (chained onto the last bucket's future) and ``end_step``
(after the optimizer step). FSDP, whose all-gathers and reduce-scatters are each a sync point, brackets every
collective with ``enter_collective`` / ``exit_collective`` instead (the first applies the delay) and,
on a device clock, every place the compute stream waits for one with ``enter_wait`` / ``exit_wait``.
The hot path is a few clock marks and a counter; everything else happens once per window.

Once per window the Pacer resolves its rows, exchanges them (one all-gather, or through the node
leaders: :mod:`pace_strategy.core.exchange`) and hands the gathered window to its controllers
(:mod:`pace_strategy.core.controllers`), whose arbitrated decision it applies; a rank that is not a
node leader applies the decision its leader sent. A rank that decides waits for each window and
analyses it on a side thread while the next step runs (:mod:`pace_strategy.core.inflight`); the
controllers decide on the training thread, at the same step as ever. The Pacer does not summarize.
Whoever needs per-step :class:`StepSummary` records (the session's telemetry thread on rank 0,
tests, benchmarks) feeds each ``WindowResult.gathered`` to one :class:`StepSummarizer` of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pace_strategy.core.clock import Clock, HostClock
from pace_strategy.core.comm import WindowExchange
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.controllers import Controllers, WindowInput
from pace_strategy.core.errors import PaceDistributedError
from pace_strategy.core.exchange import Exchange, FlatExchange, WindowResult
from pace_strategy.core.inflight import WindowInFlight
from pace_strategy.core.rebalance import WindowMeasure
from pace_strategy.core.records import NUM_FIELDS, Decision, Field
from pace_strategy.core.shares import ShareSchedule
from pace_strategy.core.skew import WindowStats, window_stats
from pace_strategy.core.state import STATE_VERSION, check_state

if TYPE_CHECKING:
    from pace_strategy.core.gc_sync import GcSync
    from pace_strategy.core.hierarchy import HierarchicalExchange

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
    #: the step's first gradient (or first bucket, or first FSDP collective): where the delay is applied
    ready: Any | None = None
    #: ``ready`` plus the delay: the moment the rank was released into its first collective
    entered: Any | None = None
    #: the end of the rank's local backward (``arrive``); ``None``: not reported, ``entered`` stands in
    arrival: Any | None = None
    done: Any | None = None
    end: Any | None = None
    delay_ms: float = 0.0
    data_ms: float = 0.0
    gc_ms: float = 0.0
    gc_collections: int = 0
    gc_due: float = 0.0
    samples: int = 0
    tokens: int = 0
    #: the device had reached the arrival when the host ended the step (``Field.HOST_BOUND``)
    host_bound: bool = True
    #: whether bucket hand-offs are seen (the comm-hook monitor); False: the buckets are not timed
    bucketed: bool = True
    #: hand-offs after the first (buckets, or FSDP collectives): a count, never read as times (a mark
    #: each would be a CUDA event per bucket per step on GPU)
    handoffs: int = 0
    #: (start, end) marks of each time the rank was held by a collective of its own (FSDP): on a host
    #: clock the collective call itself, on a device clock a wait of the compute stream for one (see
    #: :meth:`Pacer.enter_wait`); empty for DDP buckets
    collectives: list[tuple[Any, Any]] = field(default_factory=list)
    #: (entry, exit, where) of each blocking collective the framework ran outside the gradient sync
    #: (:meth:`Pacer.enter_framework_sync`); ``where`` is the field its time is taken from
    #: (``GAP_MS``: before the step began, ``COMPUTE_MS``: before the first gradient, ``OPT_MS``:
    #: after the gradient sync)
    framework_syncs: list[tuple[Any, Any, Field]] = field(default_factory=list)


@dataclass(frozen=True)
class WindowAnalysis:
    """What a window gives before any controller decides: the window, its statistics (with the
    pacing policy's lead spread taken) and rebalancing's measure. No state goes into it, so a side
    thread takes it (:class:`~pace_strategy.core.inflight.WindowInFlight`)."""

    gathered: torch.Tensor  #: ``[world_size, steps, NUM_FIELDS]`` float64
    stats: WindowStats
    measure: WindowMeasure | str | None  #: ``None``: not rebalancing
    #: a node leader's: every node's :func:`~pace_strategy.core.summary.node_steps`; else ``None``
    node_steps: torch.Tensor | None = None


#: a launched window and its side thread (:mod:`pace_strategy.core.inflight`)
_InFlight = WindowInFlight[tuple[torch.Tensor, torch.Tensor | None] | None, WindowAnalysis]


class Pacer:
    """Skew monitor and adaptive pacer for one rank of a data-parallel job.

    Args:
        config: the validated pacing configuration.
        group: the process group the window exchange runs on (``None`` for a single process). A
            gloo group works with any training backend and keeps the exchange off the accelerator.
        rank: this rank's index in ``group``.
        world_size: number of ranks in ``group``.
        clock: how durations are measured (:func:`~pace_strategy.core.clock.clock_for_device`).
        memory_probe: the device's peak allocated memory as a fraction of its total
            (:func:`~pace_strategy.core.memory.device_memory_probe`; ``None``: not measured, CPU).
        hierarchy: the node-leader exchange (``exchange_topology: node_leaders``): windows go
            through it instead of ``group``, and only node leaders decide
            (:mod:`pace_strategy.core.hierarchy`); ``group`` still serves the session's gathers.
    """

    @classmethod
    def for_device(
        cls,
        config: PacingConfig,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        device: torch.device,
        topology: Sequence[Mapping[str, Any]],
        clock: Clock | None = None,
        hierarchy: HierarchicalExchange | None = None,
    ) -> Pacer:
        """A session's Pacer on ``device``: its clock (calibrated now, outside the first paced step,
        unless only monitoring), its memory probe where rebalancing reads one, and the node-leader
        exchange built from every rank's placement in ``topology`` when ``exchange_topology`` asks."""
        from pace_strategy.core.clock import CudaEventClock, clock_for_device
        from pace_strategy.core.groups import node_leader_exchange
        from pace_strategy.core.memory import device_memory_probe

        if clock is None:
            clock = clock_for_device(device)
            if isinstance(clock, CudaEventClock) and config.mode != "monitor":
                clock.calibrate()
        memory = device_memory_probe(device) if config.rebalance.enabled else None
        if hierarchy is None and config.exchange_topology == "node_leaders" and group is not None:
            hierarchy = node_leader_exchange(config, topology, rank, world_size)
        return cls(config, group, rank, world_size, clock, memory_probe=memory, hierarchy=hierarchy)

    def __init__(
        self,
        config: PacingConfig,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        clock: Clock | None = None,
        memory_probe: Callable[[], float] | None = None,
        hierarchy: HierarchicalExchange | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.clock: Clock = clock if clock is not None else HostClock()
        # a clock of our contract written before ``host_time`` existed is a host clock
        self._host_time = bool(getattr(self.clock, "host_time", True))
        self._memory_probe = memory_probe
        #: the flat all-gather on ``group``: the session's own gathers (and the windows', when flat)
        self.exchange = WindowExchange(group, rank, world_size, config.exchange_timeout_s)
        #: the node-leader exchange, where the windows go through it
        self.hierarchy = hierarchy
        #: how the windows are exchanged and decided (:mod:`pace_strategy.core.exchange`)
        self.windows: Exchange = hierarchy if hierarchy is not None else FlatExchange(self.exchange)
        #: pacing, rebalancing and GC sync: what each window decides (:mod:`pace_strategy.core.controllers`)
        self.controllers = Controllers(config, rank, world_size, self.clock)
        self._open: _OpenStep | None = None
        self._unresolved: list[_OpenStep] = []
        self._pending: _InFlight | None = None
        self._pending_rows: torch.Tensor | None = None  # this rank's rows in the last gather launched
        self._prev_end: Any | None = None
        self._prev_done: Any | None = None
        self._pending_data_ms = 0.0
        self._pending_syncs: list[tuple[Any, Any, Field]] = []  # framework syncs before begin_step
        self._steps_seen = 0
        #: where this rank is, for the hang watchdog's thread (one int store per event, no lock):
        #: ``3 * steps ended + phase``, phase 0 between steps, 1 step begun, 2 arrived at its sync point
        self.progress = 0
        self.progress_step = -1  #: label (global step) of the last step begun
        self._window = 0
        self._delay_ms = 0.0
        self._last_label = -1
        self._decision: Decision | None = None  #: the last decision applied (None: none yet)
        self.window_work_ns = 0  #: host time end_step spent resolving, exchanging and deciding windows
        self.exchange_wait_ns = 0  #: part of window_work_ns spent blocked waiting for the all-gather
        self.flush_ns = 0  #: host time spent in flush() (end of training; includes waiting for peers)

    # ------------------------------------------------------------------ hot path (every step)
    @property
    def delay_ms(self) -> float:
        """Delay this rank currently applies before its first gradient collective, milliseconds."""
        return self._delay_ms

    @property
    def clock_is_host_time(self) -> bool:
        """Whether the clock's marks are host times (see ``Clock.host_time``)."""
        return self._host_time

    @property
    def steps_seen(self) -> int:
        """Steps completed on this rank."""
        return self._steps_seen

    @property
    def decision(self) -> Decision:
        """The last window's decision this rank applies (taken here, or by its node leader)."""
        return self._decision if self._decision is not None else self.controllers.pacing.decision

    @property
    def gc_sync(self) -> GcSync | None:
        """``gc_sync.enabled``: this rank's synchronized collector (``None``: left alone)."""
        return self.controllers.gc_sync

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
            framework_syncs=self._pending_syncs,
        )
        self._pending_data_ms = 0.0
        self._pending_syncs = []
        if self.gc_sync is not None:  # inside the open step: its pause is counted in this step's gc_ms
            self.gc_sync.begin_step(self._steps_seen, step)
        self.progress_step = step
        self.progress = 3 * self._steps_seen + 1

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

    def add_tokens(self, tokens: int) -> None:
        """The open step's forwards take ``tokens`` more tokens on this rank (summed over the step's
        micro-batches)."""
        if self._open is not None:
            self._open.tokens += tokens

    def set_tokens(self, tokens: int) -> None:
        """The open step trains on ``tokens`` tokens on this rank (what the loop counted itself)."""
        if self._open is not None:
            self._open.tokens = tokens

    def attach_shares(self, schedule: ShareSchedule, lookahead_steps: int) -> None:
        """Attach the share schedule the data pipeline reads; the integration calls it once, before the
        first step.

        With ``config.rebalance.enabled``, every rank takes the same rebalancing decision from each gathered
        window and adds a new split to ``schedule`` from the first window boundary at least
        ``lookahead_steps + 2`` steps after the step at which it is decided. Schedule steps are the
        step labels given to :meth:`begin_step` (the global optimizer step).

        Args:
            schedule: this rank's schedule (every rank has its own, built alike).
            lookahead_steps: how many batches beyond the step in training the data pipeline may have
                built (DataLoader workers x prefetch factor, plus the framework's own prefetch).
        """
        self.controllers.rebalance.attach(schedule, lookahead_steps)

    @property
    def shares(self) -> ShareSchedule | None:
        """The attached share schedule (``None``: none attached)."""
        return self.controllers.rebalance.schedule

    def interrupt(self) -> None:
        """Something other than training ran since the last step (validation, checkpointing): the next
        step's start is not contiguous with the previous step's end, and the framework collectives
        since that end (evaluation's gathers) belong to no step."""
        self._prev_end = None
        self._prev_done = None
        self._pending_syncs = []

    def enter_sync(self, bucketed: bool = True) -> None:
        """The step's first gradient is ready (or its first bucket, or its first FSDP collective, is
        about to be handed off): apply the delay. Nothing has been communicated yet, so holding the rank
        here holds it before its first collective.

        Called by the comm hook for the step's first gradient bucket (``bucketed``: later buckets
        follow through :meth:`note_bucket`), or by the grad-ready monitor for the step's first
        gradient (``bucketed=False``: buckets are not timed; the run record's ``buckets`` is 0). The
        rank's arrival is marked later, by :meth:`arrive`, at the end of its local backward; a caller
        that never calls :meth:`arrive` (FSDP) has its arrival here, after the delay.
        """
        step = self._open
        if step is None:  # hook fired outside begin/end (a bare DDP loop): open a step implicitly
            self.begin_step(self._steps_seen)
            step = self._open
            assert step is not None
        if step.ready is not None:  # a second backward in the same step: just another hand-off
            step.handoffs += 1
            return
        step.ready = self.clock.mark()
        step.bucketed = bucketed
        delay = 0.0 if step.warmup else self._delay_ms
        if delay > 0.0:
            self.clock.delay(delay)
            step.entered = self.clock.mark()
        else:
            step.entered = step.ready
        step.delay_ms = delay

    def arrive(self) -> None:
        """The rank's local backward has ended: its last gradient is ready for the collective, and from
        here it can only wait. This is the rank's **arrival** (the end of ``compute_ms``, the start of
        ``wait_ms``). The grad-ready monitor calls it from an autograd-engine callback that runs before
        DDP's own end-of-backward wait; the comm hook at the last bucket's hand-off. A later call in the
        same step (another backward) moves the mark."""
        step = self._open
        if step is None or step.ready is None:
            return  # no synchronized backward began in this step (a no_sync micro-batch)
        step.arrival = self.clock.mark()
        self.progress = 3 * self._steps_seen + 2

    def note_bucket(self) -> None:
        """Called by the comm hook for every later bucket: one count (the buckets are counted, not timed)."""
        if self._open is not None:
            self._open.handoffs += 1

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
            self.progress = 3 * self._steps_seen + 2  # FSDP: its first collective is where it arrives
            return step.entered
        start = self.clock.mark()
        step.handoffs += 1
        return start

    def exit_collective(self, start: Any | None) -> None:
        """The collective handed off at ``start`` has returned. On a host clock the call blocked until
        it completed, so ``start`` to now is time the rank was held by it. On a device clock FSDP2
        issues it on a side stream (all-gather, reduce-scatter), where it overlaps compute and the
        other collectives: its marks would time the side stream, not what the step waited for, so it
        is only counted here and the compute stream's waits are timed by :meth:`enter_wait`."""
        step = self._open
        if step is None or start is None or not self._host_time:
            return
        end = self.clock.mark()
        step.collectives.append((start, end))
        step.done = end

    def enter_wait(self) -> Any | None:
        """On a device clock: the compute stream is about to wait for a collective (FSDP2's wait for an
        all-gather before a forward or backward, for the reduce-scatters at the end of backward).
        Returns the mark for :meth:`exit_wait`; ``None`` on a host clock (the collective call itself
        was the wait, timed by :meth:`exit_collective`) or outside a training step."""
        if self._open is None or self._host_time:
            return None
        return self.clock.mark()

    def exit_wait(self, start: Any | None) -> None:
        """The compute stream has resumed after the wait entered at ``start``: ``start`` to now on the
        compute stream is time the step waited for a collective (the first one's includes the pacing
        delay, which was spun on the stream that issued it). The last one is the step's completion."""
        step = self._open
        if step is None or start is None:
            return
        end = self.clock.mark()
        step.collectives.append((start, end))
        step.done = end

    def enter_framework_sync(self) -> Any:
        """The framework is about to run a blocking collective of its own outside the gradient sync
        (the HF Trainer's pre-step gather of the label count; a broadcast of a stop flag). Returns the
        mark for :meth:`exit_framework_sync`.

        Such a collective is a sync point too: a rank that reaches it late makes the others wait
        there, and then they all enter the gradient sync together, so the lateness would be invisible
        at the gradient sync. Its time counts as **wait** (``WAIT_MS``) of the step it belongs to,
        and is taken out of where it was spent (``GAP_MS`` when before the step began, the next
        step's; ``COMPUTE_MS`` before the first gradient; ``OPT_MS`` after the gradient sync), so
        that each rank's wait is the sum of its waits at every sync point of the step and the rank
        that waited least is the one the others waited for, wherever the framework put the barrier.
        """
        return self.clock.mark()

    def exit_framework_sync(self, start: Any) -> None:
        """The framework collective entered at ``start`` has completed (on CUDA: the mark is enqueued on
        the stream that waits for it)."""
        end = self.clock.mark()
        step = self._open
        if step is None:
            self._pending_syncs.append((start, end, Field.GAP_MS))
        elif step.ready is None:
            step.framework_syncs.append((start, end, Field.COMPUTE_MS))
        else:
            step.framework_syncs.append((start, end, Field.OPT_MS))

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
        arrival = step.arrival if step.arrival is not None else step.entered
        # never waits: an event query on CUDA, always true on a host clock
        step.host_bound = arrival is None or self.clock.ready(arrival)
        if self.gc_sync is not None:
            step.gc_due = self.gc_sync.due()
        self._last_label = step.step
        self._prev_end = step.end
        self._prev_done = step.done
        self._steps_seen += 1
        self.progress = 3 * self._steps_seen
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
            pending, self._pending = self._pending, None
            result = self._complete(pending, timed=True)
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
            pending, self._pending = self._pending, None
            results.append(self._complete(pending))
        if self._unresolved:
            results.append(self._complete(self._launch(len(self._unresolved))))
        self.flush_ns += time.perf_counter_ns() - started
        return results

    def drain_local(self) -> tuple[list[WindowResult], torch.Tensor, int]:
        """End without any collective and without waiting (preemption, a hang; the peers may be gone
        or stopping): what this rank can still account for of the steps it completed.

        Returns the window in flight if its all-gather has already completed (checked, never waited
        for: every rank's rows, decided as usual), this rank's own rows (``[steps, NUM_FIELDS]``) of
        every completed step that was not exchanged (the window whose gather had not completed and
        the steps not yet launched), and how many completed steps were dropped because one of their
        marks had not happened yet (``Clock.ready``; on CUDA an event queued behind a collective that
        a dead peer never joins would block a resolve until the NCCL timeout). The step in progress,
        if any, is not counted. The Pacer exchanges nothing afterwards.
        """
        results: list[WindowResult] = []
        local: list[torch.Tensor] = []
        pending, self._pending = self._pending, None
        if pending is not None:
            done = self.windows.completed(pending.gather, pending.gathered)
            try:
                if done:  # a completed gather's wait returns at once (or raises: it failed); the rest
                    # of the side thread's work is local
                    analysis = pending.result(self._join_timeout_s, self.rank, self.world_size)
                    results.append(self._apply(analysis))
            except PaceDistributedError:
                done = False
            if not done and self._pending_rows is not None:
                local.append(self._pending_rows)
        steps, self._unresolved = self._unresolved, []
        ready = [s for s in steps if self._marks_ready(s)]
        if ready:
            local.append(torch.tensor([self._resolve(s) for s in ready], dtype=torch.float64))
        rows = torch.cat(local) if local else torch.empty(0, NUM_FIELDS, dtype=torch.float64)
        return results, rows, len(steps) - len(ready)

    def _measured_delay_ms(self, s: _OpenStep) -> float:
        """The delay as it happened (first gradient to release), not as requested: a device spin runs
        as long as the SM clocks make it, a host sleep oversleeps, and the lead adds the delay back.
        A clock that can correct itself (``observe_delay``, the CUDA spin) learns from it."""
        if s.delay_ms <= 0.0 or s.ready is None or s.entered is None:
            return 0.0
        measured = self.clock.elapsed_ms(s.ready, s.entered)
        observe = getattr(self.clock, "observe_delay", None)
        if observe is not None:
            observe(s.delay_ms, measured)
        return measured

    def _marks_ready(self, s: _OpenStep) -> bool:
        """Whether every mark of step ``s`` has happened (never blocks)."""
        marks = [s.start, s.begin, s.prev_done, s.ready, s.entered, s.arrival, s.done, s.end]
        marks += [m for pair in s.collectives for m in pair]
        marks += [m for start, end, _ in s.framework_syncs for m in (start, end)]
        return all(self.clock.ready(m) for m in marks if m is not None)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The decision state as plain JSON-able data: windows decided so far and the controller's
        state (:meth:`PacingPolicy.state_dict`). Identical on every rank after the same windows.

        Per-step measurements are not part of it (a resumed run measures afresh, warm-up included:
        DDP rebuilds its buckets in the new process).
        """
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "window": self._window,
            "policy": self.controllers.pacing.state_dict(),
        }
        rebalance = self.controllers.rebalance.state_dict()
        if rebalance is not None:
            state["rebalance"] = rebalance
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (before the first window of this run): the
        controllers' state and delays, and the window numbering continues. Raises
        :class:`~pace_strategy.core.state.PacingStateError` and changes nothing when it cannot."""
        s = check_state(state, "the pacer's state", {"window": int, "policy": dict})
        rebalance = s.get("rebalance")
        if rebalance is not None:
            self.controllers.rebalance.check_state(rebalance)  # before anything changes
        self.controllers.pacing.load_state_dict(s["policy"])
        self._window = s["window"]
        self._delay_ms = self.controllers.pacing.decision.delays_ms[self.rank]
        self._decision = None
        if rebalance is not None:
            self.controllers.rebalance.load_state_dict(rebalance)

    def _launch(self, count: int) -> _InFlight:
        """Launch the exchange of the next ``count`` unresolved steps. A rank that decides waits for
        the window and analyses it on a side thread (:meth:`analyze`); windows are decided in order
        and this one is launched after the last one was decided, so its index is ``_window``."""
        steps, self._unresolved = self._unresolved[:count], self._unresolved[count:]
        rows = torch.tensor([self._resolve(s) for s in steps], dtype=torch.float64)
        self._pending_rows = rows
        windows, index = self.windows, self._window
        gather = windows.start(rows, steps[0].step, steps[-1].step)

        def analyze_window(window: tuple[torch.Tensor, torch.Tensor | None] | None) -> WindowAnalysis:
            assert window is not None  # a rank that decides holds the whole window
            return self.analyze(window[0], index, nodes=window[1])

        # a rank that does not decide receives the decision: nothing to analyse
        return WindowInFlight(
            gather, lambda: windows.wait_window(gather), analyze_window if windows.decides else None
        )

    @property
    def _join_timeout_s(self) -> float:
        """How long the training thread waits for a window's side thread, beyond the exchange's two
        bounded waits (a node leader's: its node's and the leaders')."""
        return 2.0 * self.config.exchange_timeout_s + 60.0

    def _complete(self, pending: _InFlight, timed: bool = False) -> WindowResult:
        """Take the window launched as ``pending`` as its side thread analysed it and decide it (flat
        exchange, or a node leader), or take the decision a node leader sent (any other rank).
        ``timed``: the wait counts in ``exchange_wait_ns``."""
        started = time.perf_counter_ns()
        if pending.threaded:
            analysis = pending.result(self._join_timeout_s, self.rank, self.world_size)
            if timed:
                self.exchange_wait_ns += time.perf_counter_ns() - started
            result = self._apply(analysis)
            self.windows.publish(result)
            return result
        pending.wait()  # a rank that does not decide: its part of the exchange, then the decision
        result = self.windows.receive()
        if timed:
            self.exchange_wait_ns += time.perf_counter_ns() - started
        return self._follow(result)

    def _follow(self, result: WindowResult) -> WindowResult:
        """Apply a window's decision taken for this rank (by its node leader: the same as
        :meth:`_decide` would have taken, the leaders decide on the whole window with the same code)."""
        if result.window != self._window:
            raise PaceDistributedError(
                self.rank,
                self.world_size,
                f"the node leader sent the decision of window {result.window}, this rank expected window "
                f"{self._window}: every rank must call begin_step/end_step once per synchronized step.",
            )
        self._delay_ms = result.decision.delays_ms[self.rank]
        self._decision = result.decision
        self.controllers.follow(result.decision, result.rebalance)
        self._window += 1
        return result

    def _resolve(self, s: _OpenStep) -> list[float]:
        el = self.clock.elapsed_ms
        row = [0.0] * NUM_FIELDS
        row[Field.STEP] = float(s.step)
        seen = s.ready is not None and s.entered is not None and s.done is not None
        delay = self._measured_delay_ms(s)
        row[Field.VALID] = 1.0 if seen else 0.0
        row[Field.WARMUP] = 1.0 if s.warmup else 0.0
        if seen and s.collectives and not self._host_time:
            # Device model (docs/telemetry.md, "FSDP on a device"): the waits are the compute stream's
            # for the collectives, and the first of them also waited out the delay spun ahead of the
            # first collective on its own stream: it is the delay's time, not waiting for the others.
            blocked = sum(el(a, b) for a, b in s.collectives)
            row[Field.WAIT_MS] = max(blocked - delay, 0.0)
            row[Field.COMPUTE_MS] = max(el(s.begin, s.done) - blocked, 0.0)
        elif seen and s.collectives:
            blocked = sum(el(a, b) for a, b in s.collectives)
            row[Field.WAIT_MS] = blocked
            row[Field.COMPUTE_MS] = max(el(s.begin, s.done) - blocked - delay, 0.0)
        elif seen:
            # The delay was applied at the first gradient, before the arrival: it is not compute.
            arrival = s.arrival if s.arrival is not None else s.entered
            row[Field.COMPUTE_MS] = max(el(s.begin, arrival) - delay, 0.0)
            row[Field.WAIT_MS] = max(el(arrival, s.done), 0.0)
        row[Field.DELAY_MS] = delay
        row[Field.STEP_MS] = el(s.start, s.end)
        row[Field.DATA_MS] = s.data_ms
        row[Field.GAP_MS] = el(s.prev_done, s.begin) if s.prev_done is not None else el(s.start, s.begin)
        if s.bucketed:
            row[Field.BUCKETS] = float(s.handoffs + (1 if s.ready is not None else 0))
        row[Field.GC_MS] = s.gc_ms
        row[Field.GC_COLLECTIONS] = float(s.gc_collections)
        row[Field.SAMPLES] = float(s.samples)
        row[Field.TOKENS] = float(s.tokens)
        row[Field.GC_DUE] = s.gc_due
        row[Field.OPT_MS] = el(s.done, s.end) if seen else 0.0
        row[Field.HOST_BOUND] = 1.0 if s.host_bound else 0.0
        row[Field.MEM_PEAK] = self._memory_probe() if self._memory_probe is not None else 0.0
        if seen:
            for start, end, where in s.framework_syncs:
                blocked = el(start, end)
                row[Field.WAIT_MS] += blocked
                row[where] = max(row[where] - blocked, 0.0)
        return row

    def _decide(self, gathered: torch.Tensor) -> WindowResult:
        """Check one gathered window and let the controllers decide (identically on every rank), all
        on the calling thread."""
        return self._apply(self.analyze(gathered, self._window))

    def analyze(
        self, gathered: torch.Tensor, index: int, nodes: torch.Tensor | None = None
    ) -> WindowAnalysis:
        """Check window ``index`` and take what it gives before any decision (:class:`WindowAnalysis`):
        no state is read but the configuration and rebalancing's state, which only the decision of
        the window before this one changes. ``nodes``: a node leader's node summaries, passed on.
        Raises :class:`PaceDistributedError` when the ranks disagree on its steps."""
        labels = gathered[:, :, Field.STEP]
        # every rank's labels equal rank 0's: by their extremes over the ranks (a NaN fails both)
        if not (torch.equal(labels.amin(dim=0), labels[0]) and torch.equal(labels.amax(dim=0), labels[0])):
            raise PaceDistributedError(
                self.rank,
                self.world_size,
                f"ranks disagree on the steps of window {index} (first step labels "
                f"{labels[:, 0].tolist()}): every rank must call begin_step/end_step once per "
                "synchronized step.",
            )
        stats = window_stats(index, gathered)
        if stats.steps:
            stats.lead_spread  # noqa: B018 - taken here, off the training thread: every policy reads it
        return WindowAnalysis(gathered, stats, self.controllers.rebalance.prepare(gathered, stats), nodes)

    def _apply(self, analysis: WindowAnalysis) -> WindowResult:
        """Let the controllers decide on an analysed window and apply the decision (training thread)."""
        gathered, stats = analysis.gathered, analysis.stats
        if stats.window != self._window:
            raise PaceDistributedError(
                self.rank, self.world_size, f"window {stats.window} analysed, window {self._window} due"
            )
        labels = gathered[:, :, Field.STEP]
        last = int(labels[0, -1]) if labels.shape[1] else self._last_label
        window = WindowInput(gathered, stats, last, self._last_label, analysis.measure)
        verdict = self.controllers.decide(window, self._window)
        self._delay_ms = verdict.decision.delays_ms[self.rank]
        self._decision = verdict.decision
        self._window += 1
        return WindowResult(
            window=stats.window,
            gathered=gathered,
            stats=stats,
            decision=verdict.decision,
            warnings=verdict.warnings,
            rebalance=verdict.rebalance,
            node_steps=analysis.node_steps,
        )
