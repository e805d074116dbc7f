"""Rank 0's telemetry sinks and the one thread that runs them.

A sink is one class of the protocol :class:`~pace_strategy.telemetry.sink.Sink`: the framework's tags
(:class:`TagSink`), the run record (:class:`RecordSink`) and the Prometheus endpoint
(:class:`~pace_strategy.telemetry.prometheus.MetricsEndpoint`) are the ones pace_strategy builds.
:class:`Publisher` runs them off the training thread, in order, one window at a time; a hang verdict
goes to each of them from the watchdog's thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from pace_strategy._version import __version__
from pace_strategy.core.comm import gather_json
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.exchange import WindowResult
from pace_strategy.core.hierarchy import HierarchicalExchange
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.state import Resumed
from pace_strategy.core.summary import StepSummarizer
from pace_strategy.telemetry.columnar import SHARD_BATCH_ROWS, RankColumnsWriter, rank_columns_filename
from pace_strategy.telemetry.record_lines import ResumeLine
from pace_strategy.telemetry.run_record import RunRecordWriter, record_filename
from pace_strategy.telemetry.schema import dashboard_layout, step_metrics
from pace_strategy.telemetry.sink import Published, Sink
from pace_strategy.telemetry.tag_groups import TagGroups, tag_groups

__all__ = [
    "MAX_TAG_BACKLOG_WINDOWS",
    "DashboardSink",
    "MetricsSink",
    "Published",
    "Publisher",
    "RecordSink",
    "Sink",
    "TagSink",
    "node_shard",
]

log = logging.getLogger(__name__)

#: Receives one step's tags and the step's true global step (e.g. a framework logger's log_metrics).
MetricsSink = Callable[[Mapping[str, float], int], None]
#: Receives the dashboard layout once (e.g. a TensorBoard ``SummaryWriter.add_custom_scalars``).
DashboardSink = Callable[[Mapping[str, Any]], None]

#: windows of tags the telemetry thread may have in hand before the next window's tags are dropped
#: (its run-record rows never are): a writer that falls behind must not let rank 0's memory grow
MAX_TAG_BACKLOG_WINDOWS = 4


class TagSink:
    """The ``pace/`` tags of every ``every_steps``-th step through the framework's logger and, once
    before them, the TensorBoard dashboard layout (``dashboard``: e.g. a writer's
    ``add_custom_scalars``)."""

    def __init__(
        self,
        metrics: MetricsSink | None,
        dashboard: DashboardSink | None,
        *,
        world_size: int,
        per_rank_tag_limit: int,
        batch_shares: bool,
        every_steps: int = 1,
        groups: TagGroups | None = None,
    ) -> None:
        self._metrics = metrics
        self._every = every_steps
        self._dashboard = dashboard
        self._world_size = world_size
        self._limit = per_rank_tag_limit
        self._batch_shares = batch_shares
        self._groups = groups

    def write(self, window: Published) -> None:
        if self._dashboard is not None:
            dashboard, self._dashboard = self._dashboard, None  # once, whatever happens
            try:
                layout = dashboard_layout(
                    self._world_size, self._limit, batch_shares=self._batch_shares, groups=self._groups
                )
                dashboard(layout)
            except Exception:  # a dashboard is a convenience: the tags still go out
                log.warning("pace_strategy: could not write the TensorBoard dashboard layout", exc_info=True)
        if self._metrics is not None and window.tags:
            for summary in window.summaries:
                if summary.step % self._every:
                    continue
                self._metrics(
                    step_metrics(summary, self._limit, batch_shares=self._batch_shares, groups=self._groups),
                    summary.step,
                )

    def hang(self, line: Mapping[str, Any]) -> None:
        pass  # the run record and the endpoint say it; a tag has no step to stand at

    def close(self) -> None:
        pass


class RecordSink:
    """The run record: every step line, decision and shares line, and the hang line; its ``end`` line
    (:meth:`end`) comes from the session that owns the record, which knows how the run ended."""

    def __init__(self, record: RunRecordWriter) -> None:
        self.record = record
        self._resume_line: ResumeLine | None = None

    @classmethod
    def for_rank(
        cls,
        rank: int,
        config: PacingConfig,
        log_dir: str | os.PathLike[str] | None,
        topology: Sequence[Mapping[str, Any]],
        framework: str,
        restart_count: int,
        nodes: Sequence[Sequence[int]] | None,
    ) -> RecordSink | None:
        """Rank 0's record in ``log_dir`` (created at its first write; none on other ranks, without a
        directory or with ``run_record`` off). ``nodes``: the node leaders' layout where they
        exchange; with ``record_format: arrow`` each leader then writes its node's per-rank columns
        (a shard), else rank 0 writes them beside the record."""
        if rank != 0 or not config.run_record or log_dir is None:
            return None
        path = Path(log_dir) / record_filename(restart_count)
        columns = None
        shards = None
        if config.record_format == "arrow" and nodes is not None:
            shards = [
                {"file": rank_columns_filename(path.name, node), "ranks": list(ranks)}
                for node, ranks in enumerate(nodes)
            ]
        elif config.record_format == "arrow":  # fails here, at start, without pyarrow
            columns = RankColumnsWriter(path.with_name(rank_columns_filename(path.name)), len(topology))
        record = RunRecordWriter(
            path,
            world_size=len(topology),
            config=config.to_dict(),
            topology=topology,
            framework=framework,
            extra={
                "versions": {"pace_strategy": __version__, "torch": torch.__version__},
                "restart_count": restart_count,
            },
            rank_columns=columns,
            shards=shards,
        )
        return cls(record)

    def note(self, how: str = "kept") -> str:
        """Where the record is, for a log line (empty while it is not on disk)."""
        return f"; run record {how} at {self.record.path}" if self.record.created else ""

    def resume(self, resumed: Resumed) -> None:
        """A restore happened: the record's ``resume`` line, right after its header (the step resumed
        at, the components restored and skipped, the checkpoint). One per record: a second restore
        before the first write replaces the first."""
        first = self._resume_line is None or self.record.created
        line = self._resume_line or ResumeLine(step=-1, restored=[], from_=None)
        # the line shares the restore's lists: a component registered later shows in it
        line.step, line.restored, line.from_, line.skipped = (
            resumed.step, resumed.restored, resumed.source, resumed.skipped
        )  # fmt: skip
        self._resume_line = line
        if first:
            self.record.add_after_header(line)

    def end(
        self,
        status: str,
        message: str | None,
        *,
        pacer: Pacer,
        publisher: Publisher,
        gc_ranks: list[dict[str, Any]],
        unresolved: int = 0,
    ) -> None:
        """The record's ``end`` line: how the run ended, what rank 0's pacing cost, every rank's GC
        totals (rank 0's alone when the run did not finish), what was dropped. A run that never
        stepped (set up, then stopped or failed) leaves no record behind."""
        steps = max(pacer.steps_seen, 1)
        cost = {
            "window_work_ms_total": pacer.window_work_ns / 1e6,
            "window_work_us_per_step": pacer.window_work_ns / 1e3 / steps,
            "exchange_wait_us_per_step": pacer.exchange_wait_ns / 1e3 / steps,
            "flush_ms": pacer.flush_ns / 1e6,
            "telemetry_thread_us_per_step": publisher.publish_ns / 1e3 / steps,
        }
        extra: dict[str, Any] = {"rank0_pacer_cost": cost, "gc": gc_ranks}
        if unresolved:  # completed steps whose device marks had not happened: not waited for
            extra["unresolved_steps_dropped"] = unresolved
        if publisher.tag_windows_dropped:  # the tag writer fell behind: its windows' tags, not their rows
            extra["tag_windows_dropped"] = publisher.tag_windows_dropped
        if pacer.hierarchy is not None:  # how the windows were exchanged, where not flat
            extra["exchange"] = {
                "topology": "node_leaders",
                "nodes": [list(n) for n in pacer.hierarchy.layout.nodes],
            }
        self.record.close(status, message, extra=extra, create=pacer.steps_seen > 0)

    def write(self, window: Published) -> None:
        r = window.result
        self.record.write_window(window.summaries, r.decision, r.rebalance, gathered=r.gathered)

    def hang(self, line: Mapping[str, Any]) -> None:
        self.record.write_line(line)

    def close(self) -> None:
        pass


def node_shard(
    config: PacingConfig,
    group: Any,
    rank: int,
    world_size: int,
    record_path: Path | None,
    hierarchy: HierarchicalExchange | None,
) -> RankColumnsWriter | None:
    """A node leader's writer of its node's per-rank columns (``record_format: arrow`` with
    ``exchange_topology: node_leaders``: rank 0's record holds the global stream only). Collective
    over ``group`` when the record is sharded: every rank learns where rank 0's record goes."""
    if not (config.run_record and config.record_format == "arrow" and hierarchy is not None):
        return None
    path = None if record_path is None else str(record_path)
    where = gather_json(group, rank, world_size, path, config.exchange_timeout_s)[0]
    if where is None or not hierarchy.is_leader:
        return None
    members = hierarchy.layout.nodes[hierarchy.node]
    shard = Path(where).with_name(rank_columns_filename(Path(where).name, hierarchy.node))
    # a batch of many windows: a window of a node's ranks is a few hundred rows, and a reader pays
    # per batch (a crash loses the windows held, at most 30 s of them)
    return RankColumnsWriter(shard, len(members), ranks=members, min_batch_rows=SHARD_BATCH_ROWS)


class Publisher:
    """The sinks of rank 0 and the single background thread that feeds them, one window at a time.

    A sink that raises is reported once and then the thread stops publishing: telemetry must never
    take training down. When :data:`MAX_TAG_BACKLOG_WINDOWS` windows are already waiting, a new
    window goes with ``tags=False`` (its run-record rows are still written; its tags, the slow part,
    are dropped and counted in :attr:`tag_windows_dropped`). The thread starts at the first window.

    Args:
        sinks: in the order they are written to.
        summarizer: makes a window's per-step summaries (on the telemetry thread).
        per_rank: whether the summaries keep their per-rank tuples (something reads them).
        groups: the ranks' groups whose leads the summaries carry (above ``per_rank_tag_limit``).
        warning_suffix: appended to every straggler warning (where to look for the full picture).
    """

    _STOP = object()

    def __init__(
        self,
        sinks: Sequence[Sink],
        summarizer: StepSummarizer,
        *,
        per_rank: bool,
        warning_suffix: str = "",
        groups: TagGroups | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self.summarizer = summarizer
        self._per_rank = per_rank
        self._groups = groups
        self._suffix = warning_suffix
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._failed = False
        self._lock = threading.Lock()
        self._backlog = 0  # windows submitted and not yet published
        self._thread: threading.Thread | None = None
        self.tag_windows_dropped = 0  #: windows whose tags were dropped because the writer fell behind
        self.publish_ns = 0  #: telemetry-thread time spent in the sinks (and summarizing), ns

    @classmethod
    def for_rank(
        cls,
        rank: int,
        config: PacingConfig,
        world_size: int,
        record: RecordSink | None = None,
        metrics: MetricsSink | None = None,
        dashboard: DashboardSink | None = None,
        more: Sequence[Sink] = (),
        topology: Sequence[Mapping[str, Any]] = (),
    ) -> Publisher:
        """Rank 0's sinks in the order they are written (tags, run record, the Prometheus endpoint of
        ``config.metrics_port``, ``more``) and their thread; on other ranks none. The endpoint is
        started here: a port that cannot be bound fails at start. ``topology`` (every rank's
        placement) groups the ranks of the tags and the endpoint above ``per_rank_tag_limit``."""
        if rank != 0:
            return cls([], StepSummarizer(config.cv_window_steps), per_rank=False)
        groups = tag_groups(topology, world_size, config.per_rank_tag_limit)
        sinks: list[Sink] = []
        if metrics is not None or dashboard is not None:
            limit, shares = config.per_rank_tag_limit, config.rebalance.enabled
            sinks.append(
                TagSink(
                    metrics,
                    dashboard,
                    world_size=world_size,
                    per_rank_tag_limit=limit,
                    batch_shares=shares,
                    every_steps=config.tag_every_steps or 1,
                    groups=groups,
                )
            )
        if record is not None:
            sinks.append(record)
        if config.metrics_port:
            from pace_strategy.telemetry.prometheus import MetricsEndpoint

            sinks.append(
                MetricsEndpoint(
                    config.metrics_port,
                    world_size,
                    config.per_rank_tag_limit,
                    addr=config.metrics_host,
                    groups=groups,
                )
            )
        sinks.extend(more)
        # whether anything reads the summaries' per-rank tuples: the JSON record's step lines, or tags
        # per rank (up to ``per_rank_tag_limit``); a wide world with the columnar record has none
        writer = None if record is None else record.record
        per_rank = world_size <= config.per_rank_tag_limit or (
            writer is not None and writer.rank_columns is None and writer.shards is None
        )
        suffix = "" if writer is None else f" For the full picture: pace diagnose {writer.path.parent}"
        summarizer = StepSummarizer(config.cv_window_steps)
        return cls(sinks, summarizer, per_rank=per_rank, warning_suffix=suffix, groups=groups)

    @property
    def started(self) -> bool:
        """Whether the telemetry thread runs (it starts at the first window that has a sink)."""
        return self._thread is not None

    def submit(self, result: WindowResult) -> None:
        """Hand a window over (training thread; returns at once). Without sinks its warnings are
        logged here and nothing else is built."""
        if not self.sinks:
            self.log_warnings(result)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pace-telemetry", daemon=True)
            self._thread.start()
        with self._lock:
            tags = self._backlog < MAX_TAG_BACKLOG_WINDOWS
            self._backlog += 1
            self.tag_windows_dropped += not tags
        self._queue.put((result, tags))

    def hang(self, line: Mapping[str, Any]) -> None:
        """Tell every sink about a hang verdict now (the watchdog's thread: the telemetry thread may be
        stuck behind the hang). A failing sink is logged; the others are still told."""
        for sink in self.sinks:
            try:
                sink.hang(line)
            except Exception:  # the disk: the verdict is logged anyway, and the abort must still happen
                log.exception("pace_strategy: could not report the hang to %s", type(sink).__name__)

    def close(self, timeout_s: float) -> None:
        """Publish what was handed over (bounded: a wedged sink must not hang shutdown), then close
        every sink."""
        if self._thread is not None:
            self._queue.put(self._STOP)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning(
                    "pace_strategy: telemetry thread did not finish within %.0f s; giving up on it", timeout_s
                )
            self._thread = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:
                log.exception("pace_strategy: could not close %s", type(sink).__name__)

    def log_warnings(self, result: WindowResult) -> None:
        for message in result.warnings:
            log.warning(message + self._suffix)

    def publish(self, result: WindowResult, tags: bool = True) -> None:
        """One window to every sink, on the calling thread."""
        started = time.perf_counter_ns()
        try:
            self.log_warnings(result)
            summaries = self.summarizer.summarize(
                result.gathered,
                per_rank=self._per_rank,
                nodes=result.node_steps,
                groups=None if self._groups is None else self._groups.index,
            )
            window = Published(result, summaries, tags)
            for sink in self.sinks:
                sink.write(window)
        finally:
            self.publish_ns += time.perf_counter_ns() - started

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            try:
                if not self._failed:
                    result, tags = cast(tuple[WindowResult, bool], item)
                    self.publish(result, tags)
            except Exception:
                self._failed = True
                log.exception(
                    "pace_strategy: a telemetry sink failed; telemetry is off for the rest of the run"
                )
            finally:
                with self._lock:
                    self._backlog -= 1
