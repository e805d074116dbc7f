"""One rank's pacing session: the Pacer plus its telemetry sinks, shared by every framework adapter.

An adapter starts a session once the process group exists (``PacingSession.with_side_group`` or
``PacingSession.start``, collective: they gather the topology), forwards the framework's step events to
``session.pacer`` / ``session.end_step``, and calls ``finish`` (all ranks, normal end) or ``fail``
(local, on an exception; no collective). Only rank 0 writes telemetry. The run record is created at
its first write: a session that saw no training step leaves no file and no directory.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from pace_strategy._version import __version__
from pace_strategy.core.clock import Clock, CudaEventClock, clock_for_device
from pace_strategy.core.comm import gather_json
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PaceDistributedError, PaceHangError
from pace_strategy.core.evidence import (
    EVIDENCE_DIR,
    flight_recorder_dump,
    kill_frozen_local_ranks,
    python_stacks,
    rank_marks,
    write_evidence,
)
from pace_strategy.core.gc_monitor import GcMonitor
from pace_strategy.core.hierarchy import HierarchicalExchange, NodeLayout, check_layout
from pace_strategy.core.memory import device_memory_probe
from pace_strategy.core.netif import GLOO_IFNAME_VARIABLE, gloo_interface
from pace_strategy.core.pacer import Pacer, WindowResult
from pace_strategy.core.state import STATE_VERSION, PacingStateError, StatefulComponent, check_state
from pace_strategy.core.summary import StepSummarizer, node_transfer
from pace_strategy.core.watchdog import HANG_EXIT_CODE, HangReport, HangWatchdog, job_store
from pace_strategy.telemetry.columnar import SHARD_BATCH_ROWS, RankColumnsWriter, rank_columns_filename
from pace_strategy.telemetry.record_lines import HangLine, ResumeLine
from pace_strategy.telemetry.run_record import RunRecordWriter, record_filename
from pace_strategy.telemetry.schema import dashboard_layout, step_metrics
from pace_strategy.telemetry.topology import elastic_restart_count, local_placement

if TYPE_CHECKING:
    from pace_strategy.telemetry.prometheus import MetricsEndpoint

__all__ = ["DashboardSink", "MetricsSink", "PacingSession", "side_group"]

log = logging.getLogger(__name__)

#: numbers this process's sessions in order: every rank builds the same sessions, so the n-th is the
#: n-th everywhere (the hang watchdog's store namespace)
_SESSION_NUMBERS = itertools.count()

#: Receives one step's tags and the step's true global step (e.g. a framework logger's log_metrics).
MetricsSink = Callable[[Mapping[str, float], int], None]
#: Receives the dashboard layout once (e.g. a TensorBoard ``SummaryWriter.add_custom_scalars``).
DashboardSink = Callable[[Mapping[str, Any]], None]
#: torch's switch for gloo groups that connect each pair of ranks at its first message
LAZY_GLOO_VARIABLE = "TORCH_GLOO_LAZY_INIT"


def side_group(config: PacingConfig) -> dist.ProcessGroup | None:
    """A gloo group over all ranks for the window exchange (``None`` when not distributed).

    Collective on every rank. gloo keeps the few floats per step on the CPU, off the NCCL streams, and
    gets its own timeout so that a dead or hung peer is reported by pace_strategy instead of hanging.
    Its interface is the one the job's own traffic takes (:func:`~pace_strategy.core.netif.gloo_interface`):
    ``GLOO_SOCKET_IFNAME`` when set, else the one that routes to ``MASTER_ADDR``, which is then set
    for this process (gloo reads the variable when a group is built). A side group that cannot connect
    fails here, naming the interface and the variable to set.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    interface, why = gloo_interface()
    if interface is not None and not os.environ.get(GLOO_IFNAME_VARIABLE):
        os.environ[GLOO_IFNAME_VARIABLE] = interface  # what gloo reads when it builds the group
        log.debug("pace_strategy: gloo side group over %s (%s)", interface, why)
    try:
        with _lazy_gloo_connections():
            return dist.new_group(backend="gloo", timeout=timedelta(seconds=config.exchange_timeout_s))
    except Exception as error:
        where = (
            f"interface {interface} ({why})"
            if interface is not None
            else f"the host name's interface ({why})"
        )
        raise PaceDistributedError(
            dist.get_rank(),
            dist.get_world_size(),
            f"the gloo side group of pace_strategy could not connect over {where}: {error}. Set "
            f"{GLOO_IFNAME_VARIABLE} to the network interface the ranks reach each other through (the "
            "one NCCL_SOCKET_IFNAME or MASTER_ADDR uses), on every rank.",
        ) from error


def node_leader_exchange(
    config: PacingConfig, topology: Sequence[Mapping[str, Any]], rank: int, world_size: int
) -> HierarchicalExchange | None:
    """``exchange_topology: node_leaders``: this rank's node group and, on a node leader, the leaders'
    group (gloo, lazily connected, each built by its members only), or ``None`` where the placements
    give one node, or one rank per node (then the exchange runs flat). Collective over each group."""
    layout = NodeLayout.from_topology(topology)
    check_layout(layout, rank, world_size)
    if len(layout.nodes) in (1, world_size):
        if rank == 0:
            log.info(
                "pace_strategy: exchange_topology node_leaders, %d node(s) of %d ranks: the exchange is flat",
                len(layout.nodes),
                world_size,
            )
        return None
    timeout = timedelta(seconds=config.exchange_timeout_s)
    members = layout.nodes[layout.node_of(rank)]
    with _lazy_gloo_connections():
        # each group is built by its members only: no rank takes part in the other nodes' groups
        node_group = dist.new_group(
            list(members), backend="gloo", timeout=timeout, use_local_synchronization=True
        )
        leader_group = None
        if rank == members[0]:
            leader_group = dist.new_group(
                list(layout.leaders), backend="gloo", timeout=timeout, use_local_synchronization=True
            )
    assert node_group is not None
    return HierarchicalExchange(layout, rank, node_group, leader_group, config.exchange_timeout_s)


def _hold_uncaught_errors(seconds: float) -> None:
    """The watchdog is ending the process with the hang's exit code: an exception that reaches the top
    of the training thread meanwhile (a peer that already left closed the connection of the collective
    it was blocked in) waits up to ``seconds`` for that exit instead of ending the process first with
    its own code, which would tell the launcher a rank failed rather than hung. Seen once in a
    3-process test: rank 0 aborted, and rank 2's DDP all-reduce failed before its watchdog's exit."""
    previous = sys.excepthook

    def hold(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        log.error("pace_strategy: the training thread failed while the hang abort runs: %s", error)
        time.sleep(seconds)  # the watchdog's os._exit ends the process first
        previous(kind, error, tb)

    sys.excepthook = hold


@contextlib.contextmanager
def _lazy_gloo_connections() -> Iterator[None]:
    """Build gloo groups that connect a pair of ranks at its first message, not all pairs up front.

    An eager gloo group opens a connection to each of the W - 1 other ranks when it is built: 8,191
    sockets per rank at 8,192 ranks, before the first step. The side group's collectives (the ring
    all-gather of each window, a few gathers at start and end) reach a handful of peers, so with
    ``TORCH_GLOO_LAZY_INIT`` a rank opens those only (measured with 8 processes: 1 socket at
    creation instead of 8, 2 more at the first all-gather). Set only while the side group is built,
    so the job's own gloo groups are left as they are; a value the user set is kept."""
    if LAZY_GLOO_VARIABLE in os.environ:
        yield
        return
    os.environ[LAZY_GLOO_VARIABLE] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_GLOO_VARIABLE, None)


class PacingSession:
    """The Pacer of one rank and, on rank 0, its metrics sink and run-record writer.

    Which calls are collective (every rank of ``group`` makes them, in the same order):

    - :meth:`with_side_group` and :meth:`start`: build the session; they gather the topology
      (``with_side_group`` also creates the gloo side group);
    - :meth:`end_step`: every rank, once per step; it launches the batched window exchange;
    - :meth:`finish`: the final exchange, at the normal end of training.

    The constructor, :meth:`publish`, :meth:`close` and :meth:`fail` are local. Building a session
    directly takes the already gathered ``topology`` (one placement per rank, as
    :func:`~pace_strategy.telemetry.topology.local_placement` gives them).

    Args:
        config: the validated pacing configuration.
        rank: this rank's index in ``group``.
        world_size: number of ranks in ``group``.
        device: the training device (chooses the clock unless ``clock`` is given).
        group: the process group of the window exchange (``None`` for a single process).
        framework: recorded in the run record's header (``"lightning"``, ``"accelerate"``, ...).
        topology: every rank's placement, indexed by rank (written to the run record's header).
        log_dir: rank 0: the directory of the run record (none is written without it). Nothing is
            created there before the first window is written, or the session closes after at
            least one step.
        metrics_sink: rank 0: receives every step's ``pace/`` tags.
        dashboard: rank 0: receives the TensorBoard custom-scalars layout of those tags
            (:func:`~pace_strategy.telemetry.schema.dashboard_layout`) once, before the first step's
            tags (an adapter passes its writer's ``add_custom_scalars``).
        clock: how durations are measured (default: ``clock_for_device(device)``).
        owns_group: release ``group`` at :meth:`finish`.
        hierarchy: the node-leader exchange to use (default: built from the placements when
            ``exchange_topology`` is ``node_leaders``; given by tests on thread ranks).
    """

    def __init__(
        self,
        config: PacingConfig,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
        framework: str,
        topology: Sequence[Mapping[str, Any]],
        log_dir: str | os.PathLike[str] | None = None,
        metrics_sink: MetricsSink | None = None,
        dashboard: DashboardSink | None = None,
        clock: Clock | None = None,
        owns_group: bool = False,
        hierarchy: HierarchicalExchange | None = None,
    ) -> None:
        if len(topology) != world_size:
            raise ValueError(
                f"topology has {len(topology)} placements but world_size is {world_size}: pass one per "
                "rank (PacingSession.start gathers them)"
            )
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._owns_group = owns_group and group is not None
        if clock is None:
            clock = clock_for_device(device)
            if isinstance(clock, CudaEventClock) and config.mode != "monitor":
                clock.calibrate()  # now, on the session's device: not inside the first paced step
        memory = device_memory_probe(device) if config.rebalance.enabled else None
        if hierarchy is None and config.exchange_topology == "node_leaders" and group is not None:
            hierarchy = node_leader_exchange(config, topology, rank, world_size)
        self.pacer = Pacer(config, group, rank, world_size, clock, memory_probe=memory, hierarchy=hierarchy)
        self.metrics_sink = metrics_sink if rank == 0 else None
        self._dashboard = dashboard if rank == 0 else None
        #: rank 0, ``config.metrics_port``: the live Prometheus endpoint (started here: a port that
        #: cannot be bound fails at start)
        self.endpoint: MetricsEndpoint | None = None
        if rank == 0 and config.metrics_port:
            from pace_strategy.telemetry.prometheus import MetricsEndpoint

            self.endpoint = MetricsEndpoint(config.metrics_port, world_size, config.per_rank_tag_limit)
        self.topology = [dict(placement) for placement in topology]
        self.record: RunRecordWriter | None = None
        self.record_path: Path | None = None
        #: torchrun's restarts of this job so far: the record says so, and a restarted attempt's
        #: record gets its own file beside the earlier ones (``record_filename``)
        self.restart_count = elastic_restart_count()
        #: node leaders write their nodes' per-rank columns (``record_format: arrow`` with
        #: ``exchange_topology: node_leaders``): rank 0's record holds the global stream only
        sharded = config.run_record and config.record_format == "arrow" and hierarchy is not None
        #: a node leader's shard of the record (its node's ranks), when sharded
        self.shard: RankColumnsWriter | None = None
        if rank == 0 and config.run_record and log_dir is not None:
            self.record_path = Path(log_dir) / record_filename(self.restart_count)
            columns = None
            shards = None
            if sharded:
                assert hierarchy is not None
                name = self.record_path.name
                shards = [
                    {"file": rank_columns_filename(name, node), "ranks": list(ranks)}
                    for node, ranks in enumerate(hierarchy.layout.nodes)
                ]
            elif config.record_format == "arrow":  # fails here, at start, without pyarrow
                columns_path = self.record_path.with_name(rank_columns_filename(self.record_path.name))
                columns = RankColumnsWriter(columns_path, world_size)
            self.record = RunRecordWriter(
                self.record_path,
                world_size=world_size,
                config=config.to_dict(),
                topology=self.topology,
                framework=framework,
                extra={
                    "versions": {"pace_strategy": __version__, "torch": torch.__version__},
                    "restart_count": self.restart_count,
                },
                rank_columns=columns,
                shards=shards,
            )
        if sharded:
            assert hierarchy is not None
            # every rank learns where rank 0's record goes (collective over the side group)
            where = gather_json(
                group, rank, world_size, None if self.record_path is None else str(self.record_path),
                config.exchange_timeout_s,
            )[0]  # fmt: skip
            if where is not None and hierarchy.is_leader:
                members = hierarchy.layout.nodes[hierarchy.node]
                shard = Path(where).with_name(rank_columns_filename(Path(where).name, hierarchy.node))
                # a batch of many windows: a window of a node's ranks is a few hundred rows, and a
                # reader pays per batch (a crash loses the windows held, at most 30 s of them)
                self.shard = RankColumnsWriter(
                    shard, len(members), ranks=members, min_batch_rows=SHARD_BATCH_ROWS
                )
        self._finished = False
        # Every rank times its own collections (a callback per collection, nothing per step); with
        # gc_sync the Pacer also collects at agreed steps. Both are undone in _close, whatever ends the run.
        self.gc_monitor = GcMonitor(self.pacer.add_gc)
        self.gc_monitor.install()
        self._gc_ranks: list[dict[str, Any]] | None = None  #: every rank's GC report, gathered at finish
        self.watchdog = self._start_watchdog()
        self.publish_ns = 0  #: rank 0: telemetry-thread time spent writing tags and the run record
        #: rank 0: windows whose tags were dropped because the tag writer fell behind (their rows
        #: are in the run record; the ``end`` line says how many)
        self.tag_windows_dropped = 0
        self._publisher: _Publisher | None = None
        # Summaries are built on the telemetry thread: only rank 0 needs them, decisions do not.
        self._summarizer = StepSummarizer(config.cv_window_steps)
        #: whether anything reads the summaries' per-rank tuples: the JSON record's step lines, or tags
        #: per rank (up to ``per_rank_tag_limit``); a wide world with the columnar record has none
        self._summaries_per_rank = world_size <= config.per_rank_tag_limit or (
            self.record is not None and self.record.rank_columns is None and self.record.shards is None
        )
        #: what state_dict() saves, by name (the extension point: see register_state)
        self._state_components: dict[str, StatefulComponent] = {"pacer": self.pacer}
        self._unclaimed_state: dict[str, Any] = {}  # restored states whose component is not registered yet
        self._resume_line: ResumeLine | None = None  #: the record's ``resume`` line, once restored
        self._dataloader_workers: int | None = None
        self._workers_shared = False
        _OPEN.add(self)
        _close_open_sessions_at_exit()

    @classmethod
    def start(
        cls,
        config: PacingConfig,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
        framework: str,
        node_rank: int | None = None,
        local_rank: int | None = None,
        **kwargs: Any,
    ) -> PacingSession:
        """Gather every rank's placement on ``group`` and build the session. Collective on every rank.

        ``node_rank`` / ``local_rank`` override what the environment says about this rank's place;
        ``kwargs`` are the constructor's other arguments (``log_dir``, ``metrics_sink``, ``clock``,
        ``owns_group``).
        """
        placement = local_placement(rank, device, node_rank=node_rank, local_rank=local_rank)
        topology = gather_json(group, rank, world_size, placement.to_dict(), config.exchange_timeout_s)
        return cls(
            config,
            rank=rank,
            world_size=world_size,
            device=device,
            group=group,
            framework=framework,
            topology=topology,
            **kwargs,
        )

    @classmethod
    def with_side_group(cls, config: PacingConfig, **kwargs: Any) -> PacingSession:
        """A session on its own gloo group (see :func:`side_group`), which it releases at ``finish``.

        Collective on every rank (creates the group, then :meth:`start`); ``kwargs`` are the other
        arguments of :meth:`start`.
        """
        return cls.start(config, group=side_group(config), owns_group=True, **kwargs)

    def note_dataloader_workers(self, workers: int | None) -> None:
        """Local: a training DataLoader of this rank runs ``workers`` worker processes. The largest
        count noted before the first step ends is recorded in this rank's placement (the run record's
        header), where ``pace diagnose`` counts busy threads per host."""
        if workers is not None and not self._workers_shared:
            self._dataloader_workers = max(self._dataloader_workers or 0, workers)

    def end_step(self) -> WindowResult | None:
        """Forward the end of a step to the pacer and publish any window that completed.

        Collective on every rank (once per step). The first call also gathers every rank's noted
        DataLoader workers (adapters learn of their loaders after the session starts). Nothing
        once the session is closed (a preempted run may still finish the step in progress)."""
        if self._finished:
            return None
        if not self._workers_shared:
            self._share_dataloader_workers()
        result = self.pacer.end_step()
        if result is not None:
            self.publish(result)
        return result

    def _share_dataloader_workers(self) -> None:
        self._workers_shared = True
        # One float per rank on the exchange's own path (-1: no DataLoader noted on that rank).
        local = torch.tensor([[float(-1 if self._dataloader_workers is None else self._dataloader_workers)]])
        step = self.pacer.steps_seen
        counts = self.pacer.exchange.gather(local.double(), step, step)[:, 0, 0].tolist()
        for placement, workers in zip(self.topology, counts, strict=True):
            placement["dataloader_workers"] = None if workers < 0 else int(workers)
        if self.record is not None:
            self.record.update_topology(self.topology)

    def publish(self, result: WindowResult) -> None:
        """Rank 0: hand the window to the telemetry thread, which logs every step at its own global
        step and appends it to the run record (off the training thread: a TensorBoard writer blocks
        ~65 us per scalar on its bounded queue, ~1 ms per step for the pace/ tags). A node leader
        with a shard of the record appends its node's rows to it first (a few ranks' rows)."""
        if self.shard is not None and result.gathered.numel():
            # the leads' reference, each step's smallest wait, from the nodes' (a node leader's)
            nodes = result.node_steps
            self.shard.write_gathered(result.gathered, None if nodes is None else node_transfer(nodes))
        if self.rank != 0:
            return
        if self.metrics_sink is None and self.record is None and self.endpoint is None:
            self._log_warnings(result)  # nothing to write: no thread, no summaries
            return
        if self._publisher is None:
            self._publisher = _Publisher(self._publish)
        self._publisher.submit(result)

    def _publish(self, result: WindowResult, tags: bool = True) -> None:
        started = time.perf_counter_ns()
        try:
            self._publish_now(result, tags)
        finally:
            self.publish_ns += time.perf_counter_ns() - started

    def _log_warnings(self, result: WindowResult) -> None:
        for message in result.warnings:
            if self.record_path is not None:
                message += f" For the full picture: pace diagnose {self.record_path.parent}"
            log.warning(message)

    def _publish_now(self, result: WindowResult, tags: bool = True) -> None:
        """One window to every sink (telemetry thread); ``tags=False``: the writer fell behind, this
        window's tags are dropped (its run-record rows are written all the same)."""
        self._log_warnings(result)
        summaries = self._summarizer.summarize(
            result.gathered, per_rank=self._summaries_per_rank, nodes=result.node_steps
        )
        if self._dashboard is not None:
            dashboard, self._dashboard = self._dashboard, None  # once, whatever happens
            try:
                dashboard(
                    dashboard_layout(
                        self.world_size,
                        self.config.per_rank_tag_limit,
                        batch_shares=self.config.rebalance.enabled,
                    )
                )
            except Exception:  # a dashboard is a convenience: the tags still go out
                log.warning("pace_strategy: could not write the TensorBoard dashboard layout", exc_info=True)
        if self.metrics_sink is not None and tags:
            for summary in summaries:
                metrics = step_metrics(
                    summary, self.config.per_rank_tag_limit, batch_shares=self.config.rebalance.enabled
                )
                self.metrics_sink(metrics, summary.step)
        if self.record is not None:
            self.record.write_window(summaries, result.decision, result.rebalance, gathered=result.gathered)
        if self.endpoint is not None:
            self.endpoint.update(summaries, result.decision)

    def finish(self) -> list[WindowResult]:
        """Normal end of training (collective: every rank calls it): exchange and publish what is left.
        Returns the windows that exchange decided (none when already finished or closed)."""
        if self._finished:
            return []
        self._finished = True
        try:
            results = self.pacer.flush()
            for result in results:
                self.publish(result)
            if self.shard is not None:
                # A node leader's shard is whole on disk before the collective below: rank 0 (and a
                # reader it starts, as the demo's report) may read every shard as soon as it is past
                # it, and a leader holds its node's last windows until it closes the shard.
                self.shard.close()
            # Every rank's GC totals for the end line (collective, like the flush before it).
            self._gc_ranks = gather_json(
                self._group, self.rank, self.world_size, self.gc_report(), self.config.exchange_timeout_s
            )
        except BaseException as error:
            self._close("failed", error)
            raise
        self._close("completed", None)
        if self._owns_group and dist.is_initialized():
            # The flush was the group's last collective on every rank: release it now, while the
            # peers are alive, rather than in an interpreter-exit destructor.
            dist.destroy_process_group(self._group)
        self._group = None
        return results

    # ------------------------------------------------------------------ checkpoint state
    def register_state(self, name: str, component: StatefulComponent) -> None:
        """Checkpoint ``component`` under ``name`` too (the extension point for later components, e.g.
        rebalancing shares and the sampler position). Its ``state_dict()`` must be plain JSON-able data,
        identical on every rank. A state restored before the component was registered is loaded now."""
        if name in self._state_components:
            raise ValueError(f"a state component named {name!r} is already registered")
        self._state_components[name] = component
        if name in self._unclaimed_state:
            self._load_component(name, self._unclaimed_state.pop(name))

    def state_dict(self, step: int) -> dict[str, Any]:
        """The checkpointable pacing state after ``step`` global steps: plain JSON-able data, the
        same on every rank (local: no collective). Layout: :mod:`pace_strategy.core.state`."""
        return {
            "version": STATE_VERSION,
            "step": step,
            "world_size": self.world_size,
            "components": {name: c.state_dict() for name, c in self._state_components.items()},
        }

    def load_state_dict(
        self, state: Mapping[str, Any] | None, *, source: str | None = None, step: int | None = None
    ) -> list[str]:
        """Resume: restore what :meth:`state_dict` saved (local: every rank loads the same checkpoint).

        Never fails a resume: a state that cannot be restored (newer version, other world size,
        damaged) is skipped with a warning and the controller starts fresh; ``None`` (a checkpoint
        written without pace_strategy) restores nothing. Either way the run record gets a ``resume``
        line right after its header: ``step`` (the state's, else ``step``), the components
        ``restored`` and ``from`` (``source``, the checkpoint's path where the adapter knows it).
        Returns the names restored.
        """
        restored: list[str] = []
        skipped: dict[str, str] = {}
        saved_step = state.get("step") if isinstance(state, Mapping) else None
        # One resume line per record: a second restore before the first write replaces the first.
        first = self._resume_line is None or (self.record is not None and self.record.created)
        line = self._resume_line or ResumeLine(step=-1, restored=[], from_=None)
        line.step = saved_step if type(saved_step) is int else (-1 if step is None else step)
        line.restored, line.from_, line.skipped = restored, source, skipped
        self._resume_line = line
        try:
            s = check_state(state, "the checkpoint's pace_strategy state", {"step": int, "components": dict})
        except PacingStateError as error:
            if state is not None:
                skipped["*"] = str(error)
                log.warning("pace_strategy: nothing restored from %s: %s", source or "the checkpoint", error)
        else:
            for name, component_state in s["components"].items():
                if name in self._state_components:
                    self._load_component(name, component_state)
                else:
                    self._unclaimed_state[name] = component_state
        if self.record is not None and first:
            self.record.add_after_header(line)
        if self.rank == 0:
            log.info(
                "pace_strategy: resumed at step %d from %s; restored: %s",
                line.step,
                source or "a checkpoint",
                ", ".join(restored) or "nothing (no pace_strategy state in it)",
            )
        return restored

    def _load_component(self, name: str, state: Any) -> None:
        line = self._resume_line
        assert line is not None, "components load from a restored state"
        try:
            self._state_components[name].load_state_dict(state)
        except PacingStateError as error:
            line.skipped[name] = str(error)
            log.warning("pace_strategy: %s not restored: %s", name, error)
        else:
            line.restored.append(name)

    # ------------------------------------------------------------------ ending a run
    def terminate(self, reason: str = "SIGTERM") -> None:
        """The job is being stopped (SIGTERM, a scheduler's preemption): close the run record with
        status ``terminated``, without any collective (the peers are stopping too, or gone); idempotent.

        Rank 0 keeps every step it can account for alone: the windows already handed to the telemetry
        thread, the window in flight if its exchange has completed, and, as ``local_step`` lines, its
        own measurements of the steps that were never exchanged (the other ranks' are lost).
        """
        if self._finished:
            return
        self._finished = True
        local = None
        dropped = 0
        if self.record is not None:
            try:
                results, local, dropped = self.pacer.drain_local()
                for result in results:
                    self.publish(result)
            except Exception:  # a signal may land anywhere in the pacer: never block the exit on it
                log.exception("pace_strategy: could not account for the last steps at termination")
        self._close("terminated", None, reason=reason, local_rows=local, unresolved=dropped)
        log.warning(
            "[rank %d/%d] pace_strategy: %s after %d steps: pacing stopped%s",
            self.rank,
            self.world_size,
            reason,
            self.pacer.steps_seen,
            f"; run record closed as terminated at {self.record_path}" if self.record_created else "",
        )

    def close(self, status: str = "completed") -> None:
        """Close locally without the final exchange (the run ended without ``finish``); idempotent."""
        if self._finished:
            return
        self._finished = True
        self._close(status, None)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def record_created(self) -> bool:
        """Whether the run record exists on disk (``record_path`` is only where it goes)."""
        return self.record is not None and self.record.created

    def fail(self, error: BaseException) -> None:
        """Training failed on this rank: close the run record without any collective (peers may be gone)."""
        if self._finished:
            return
        self._finished = True
        self._close("failed", error)
        log.error(
            "[rank %d/%d] pace_strategy: training failed after %d steps (%s: %s)%s",
            self.rank,
            self.world_size,
            self.pacer.steps_seen,
            type(error).__name__,
            error,
            f"; run record kept at {self.record_path}" if self.record_created else "",
        )

    def _start_watchdog(self) -> HangWatchdog | None:
        """The hang watchdog on the job's store (none for one rank, ``hang_timeout_s=0`` or no store).

        Its keys live under a namespace that every rank computes alike and that no earlier session
        or attempt of the job used: the restart count and this process's session number."""
        store = job_store() if self.world_size > 1 and self.config.hang.timeout_s > 0 else None
        if store is None:
            return None
        watchdog = HangWatchdog(
            store,
            f"pace_strategy/watchdog/{self.restart_count}/{next(_SESSION_NUMBERS)}",
            rank=self.rank,
            world_size=self.world_size,
            hosts=[str(p.get("host", "?")) for p in self.topology],
            hang_timeout_s=self.config.hang.timeout_s,
            progress=lambda: (self.pacer.progress, self.pacer.progress_step),
            on_hang=self._on_hang,
        )
        watchdog.start()
        return watchdog

    def _hang_line(self, report: HangReport) -> dict[str, Any]:
        """The run record's ``hang`` line: the report, plus each named rank's process and GPU."""
        named = [self.topology[r] if 0 <= r < len(self.topology) else {} for r in report.ranks]
        gpus = [p.get("gpu_uuid") or (p.get("device") if p.get("device") != "cpu" else None) for p in named]
        return HangLine(
            ranks=list(report.ranks),
            step=report.step,
            waited_s=round(report.waited_s, 3),
            hosts=list(report.hosts),
            behind=list(report.behind),
            stale=list(report.stale),
            action=self.config.hang.action,
            extra={"pids": [p.get("pid") for p in named], "gpus": gpus},
        ).to_json()

    def _hang_evidence(
        self, watchdog: HangWatchdog, report: HangReport, line: Mapping[str, Any]
    ) -> Path | None:
        """Every rank publishes its Python stacks; rank 0 collects the live ranks' (a bounded wait),
        writes ``RUN_DIR/hang/`` (:func:`~pace_strategy.core.evidence.write_evidence`) and announces it
        on the store. Returns the directory on rank 0. Best effort: a failure is logged, never raised."""
        try:
            stacks = python_stacks()
            watchdog.publish_stacks(stacks)
            if self.record_path is None:
                return None
            live = [r for r in range(self.world_size) if r not in report.stale and r != self.rank]
            collected = watchdog.collect_stacks(live, timeout_s=self._evidence_wait_s())
            collected[self.rank] = stacks
            entries = watchdog.read() or {}
            marks = {
                r: None if e is None else rank_marks(e.progress, e.step, e.alive_s)
                for r, e in entries.items()
            }
            directory = self.record_path.parent / EVIDENCE_DIR
            return write_evidence(directory, line, marks, collected, flight_recorder_dump())
        except Exception:
            log.exception("pace_strategy: could not write the hang evidence")
            return None
        finally:
            if self.record_path is not None:
                watchdog.announce_evidence()  # written or not: nobody waits longer for it

    def _evidence_wait_s(self) -> float:
        """How long rank 0 waits for the live ranks' stacks (they publish them at their verdict, within
        a heartbeat or two of each other)."""
        return min(10.0, self.config.hang.timeout_s)

    def _on_hang(self, report: HangReport) -> None:
        """Watchdog thread, once ranks are named: rank 0 records the hang and its evidence
        (``RUN_DIR/hang/``: every live rank's stacks, where each rank stood, the Flight Recorder).
        With ``hang.action="abort"``: rank 0 closes the record (status ``hung``) first, the ranks on
        this host whose heartbeat stopped are ended (SIGKILL: a stopped process holds its launcher's
        pipes), every rank stays until rank 0 has the evidence (a rank that left first would break
        rank 0's collective) and the process exits, since a thread cannot raise into a training thread
        blocked in a C++ collective."""
        watchdog = self.watchdog
        if self.endpoint is not None:
            self.endpoint.hang()
        line = self._hang_line(report)
        try:
            if self.record is not None:
                self.record.write_line(line)
        except Exception:  # the disk: the verdict is logged anyway, and the abort must still happen
            log.exception("pace_strategy: could not write the hang line to %s", self.record_path)
        abort = self.config.hang.action == "abort"
        if abort:
            _hold_uncaught_errors(self._evidence_wait_s() + 60.0)
        try:
            if abort and not self._finished:  # the end line first: nothing after may be in time
                self._finished = True
                self._close("hung", self._hang_error(report, line))
            evidence = None if watchdog is None else self._hang_evidence(watchdog, report, line)
            if evidence is not None:
                log.error(
                    "[rank %d/%d] pace_strategy: hang evidence in %s", self.rank, self.world_size, evidence
                )
            if not abort:
                return
            host = str(self.topology[self.rank].get("host")) if self.rank < len(self.topology) else ""
            killed = kill_frozen_local_ranks(report.stale, self.topology, host, self.rank)
            if killed:
                log.error(
                    "[rank %d/%d] pace_strategy: ended frozen rank(s) %s on this host (SIGKILL)",
                    self.rank,
                    self.world_size,
                    ", ".join(map(str, killed)),
                )
            if watchdog is not None:
                watchdog.wait_for_verdicts(report)  # leave together: see HangWatchdog.wait_for_verdicts
                if self.rank != 0 and 0 not in report.ranks:
                    watchdog.wait_for_evidence(self._evidence_wait_s() + 2 * watchdog.interval_s)
            log.error(
                "[rank %d/%d] pace_strategy: aborting the process (exit code %d) so that the launcher "
                "can restart the job%s",
                self.rank,
                self.world_size,
                HANG_EXIT_CODE,
                f"; run record kept at {self.record_path}" if self.record_created else "",
            )
        finally:
            if abort:
                logging.shutdown()  # flush every handler: nothing runs after os._exit
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(HANG_EXIT_CODE)

    def _hang_error(self, report: HangReport, line: Mapping[str, Any]) -> PaceHangError:
        """The typed error of an abort: the verdict, and each hung rank's host, pid and GPU."""
        who = ", ".join(
            f"rank {r} (host {h}, pid {p}{f', GPU {g}' if g else ''})"
            for r, h, p, g in zip(report.ranks, line["hosts"], line["pids"], line["gpus"], strict=True)
        )
        text = "; ".join(report.sentences())
        return PaceHangError(
            self.rank,
            self.world_size,
            f"{text}; hung: {who}; aborted (hang.action='abort')",
            ranks=tuple(report.ranks),
            hosts=tuple(line["hosts"]),
            pids=tuple(line["pids"]),
        )

    def gc_report(self) -> dict[str, Any]:
        """This rank's garbage-collector totals since the session started (and what gc_sync did)."""
        sync = self.pacer.gc_sync
        return {
            "rank": self.rank,
            **self.gc_monitor.summary(),
            "gc_sync": sync.summary() if sync is not None else None,
        }

    def _release_collector(self) -> None:
        """Remove the GC callbacks and give the collector its settings back (every way a run ends)."""
        self.gc_monitor.remove()
        if self.pacer.gc_sync is not None:
            self.pacer.gc_sync.restore()

    def _close(
        self,
        status: str,
        error: BaseException | None,
        *,
        reason: str | None = None,
        local_rows: torch.Tensor | None = None,
        unresolved: int = 0,
    ) -> None:
        _OPEN.discard(self)
        self._release_collector()
        if self.shard is not None:
            self.shard.close()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self._publisher is not None:
            # Drain what was already handed over (bounded: a wedged sink must not hang shutdown).
            normal = error is None and reason is None
            self._publisher.close(timeout_s=self.config.exchange_timeout_s if normal else 10.0)
            self.tag_windows_dropped = self._publisher.tag_windows_dropped
            self._publisher = None
        if self.endpoint is not None:  # after the last window reached it: a last scrape sees it all
            self.endpoint.close()
            self.endpoint = None
        if self.record is not None:
            steps = max(self.pacer.steps_seen, 1)
            cost = {
                "window_work_ms_total": self.pacer.window_work_ns / 1e6,
                "window_work_us_per_step": self.pacer.window_work_ns / 1e3 / steps,
                "exchange_wait_us_per_step": self.pacer.exchange_wait_ns / 1e3 / steps,
                "flush_ms": self.pacer.flush_ns / 1e6,
                "telemetry_thread_us_per_step": self.publish_ns / 1e3 / steps,
            }
            message = reason if error is None else f"{type(error).__name__}: {error}"
            if local_rows is not None and len(local_rows) > 0:
                self.record.write_local_steps(self.rank, local_rows.tolist())
            # A run that never stepped (set up, then stopped or failed) leaves no record behind.
            # "gc": one report per rank after a normal finish, else rank 0's alone
            gc_ranks = self._gc_ranks if self._gc_ranks is not None else [self.gc_report()]
            extra: dict[str, Any] = {"rank0_pacer_cost": cost, "gc": gc_ranks}
            if unresolved:  # completed steps whose device marks had not happened: not waited for
                extra["unresolved_steps_dropped"] = unresolved
            if self.tag_windows_dropped:  # the tag writer fell behind: its windows' tags, not their rows
                extra["tag_windows_dropped"] = self.tag_windows_dropped
            if self.pacer.hierarchy is not None:  # how the windows were exchanged, where not flat
                extra["exchange"] = {
                    "topology": "node_leaders",
                    "nodes": [list(n) for n in self.pacer.hierarchy.layout.nodes],
                }
            self.record.close(status, message, extra=extra, create=self.pacer.steps_seen > 0)


#: Sessions not yet finished or closed, whatever adapter started them: closed at interpreter exit.
_OPEN: weakref.WeakSet[PacingSession] = weakref.WeakSet()


@functools.cache
def _close_open_sessions_at_exit() -> None:
    """Register, once per process, the one exit path for runs that end without ``finish``."""
    atexit.register(_close_open_sessions)


def _close_open_sessions() -> None:
    """At exit, close every open session locally (no collective: the peers may be gone): ``failed``
    when the script died of an uncaught exception (Python sets ``sys.last_value`` before the exit
    handlers run), else ``incomplete``. What was exchanged is written; the steps of the last,
    unexchanged window are lost (a normal end calls ``finish``, which exchanges them)."""
    error = getattr(sys, "last_value", None)
    for session in list(_OPEN):
        if isinstance(error, BaseException):
            session.fail(error)
        else:
            session.close(status="incomplete")


#: windows of tags the telemetry thread may have in hand before the next window's tags are dropped
#: (its run-record rows never are): a writer that falls behind must not let rank 0's memory grow
MAX_TAG_BACKLOG_WINDOWS = 4


class _Publisher:
    """A single background thread that runs the telemetry sinks in order, one window at a time.

    A sink that raises is reported once and then skipped for the rest of the run: telemetry must
    never take training down. When :data:`MAX_TAG_BACKLOG_WINDOWS` windows are already waiting, a new
    window goes with ``tags=False`` (its run-record rows are still written; its tags, the slow part,
    are dropped and counted in :attr:`tag_windows_dropped`).
    """

    _STOP = object()

    def __init__(self, publish: Callable[[WindowResult, bool], None]) -> None:
        self._publish = publish
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._failed = False
        self._lock = threading.Lock()
        self._backlog = 0  # windows submitted and not yet published
        self.tag_windows_dropped = 0  #: windows whose tags were dropped because the writer fell behind
        self._thread = threading.Thread(target=self._run, name="pace-telemetry", daemon=True)
        self._thread.start()

    def submit(self, result: WindowResult) -> None:
        with self._lock:
            tags = self._backlog < MAX_TAG_BACKLOG_WINDOWS
            self._backlog += 1
            self.tag_windows_dropped += not tags
        self._queue.put((result, tags))

    def close(self, timeout_s: float) -> None:
        self._queue.put(self._STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "pace_strategy: telemetry thread did not finish within %.0f s; giving up on it", timeout_s
            )

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            try:
                if not self._failed:
                    result, tags = cast(tuple[WindowResult, bool], item)
                    self._publish(result, tags)
            except Exception:
                self._failed = True
                log.exception(
                    "pace_strategy: a telemetry sink failed; telemetry is off for the rest of the run"
                )
            finally:
                with self._lock:
                    self._backlog -= 1
