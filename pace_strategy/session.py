"""One rank's pacing session: the Pacer plus its telemetry sinks, shared by every framework adapter.

An adapter starts a session once the process group exists (``PacingSession.with_side_group`` or
``PacingSession.start``, collective: they gather the topology), forwards the framework's step events to
``session.pacer`` / ``session.end_step``, and calls ``finish`` (all ranks, normal end) or ``fail``
(local, on an exception; no collective). Only rank 0 writes telemetry, through its sinks
(:mod:`pace_strategy.telemetry.sinks`); the process groups are built in :mod:`pace_strategy.core.groups`,
the response to a hang in :mod:`pace_strategy.core.hang_response`, the checkpoint state is kept by
:class:`~pace_strategy.core.state.StateRegistry`. The run record is created at its first write: a
session that saw no training step leaves no file and no directory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pace_strategy.core.clock import Clock
from pace_strategy.core.comm import gather_json
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PaceHangError
from pace_strategy.core.exchange import WindowResult
from pace_strategy.core.gc_monitor import GcMonitor
from pace_strategy.core.groups import side_group
from pace_strategy.core.hang_response import start_watchdog
from pace_strategy.core.hierarchy import HierarchicalExchange
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.state import StateRegistry
from pace_strategy.core.summary import node_transfer
from pace_strategy.shutdown import close_at_exit, no_longer_open
from pace_strategy.telemetry.record_lines import hang_line
from pace_strategy.telemetry.run_record import RunRecordWriter
from pace_strategy.telemetry.sinks import DashboardSink, MetricsSink, Publisher, RecordSink, Sink, node_shard
from pace_strategy.telemetry.topology import (
    LoaderWorkers,
    elastic_restart_count,
    local_placement,
    mesh_caveats,
)

__all__ = ["PacingSession"]

log = logging.getLogger(__name__)


class PacingSession:
    """The Pacer of one rank and, on rank 0, its telemetry sinks and run-record writer.

    Which calls are collective (every rank of ``group`` makes them, in the same order):

    - :meth:`with_side_group` and :meth:`start`: build the session; they gather the topology
      (``with_side_group`` also creates the gloo side group);
    - :meth:`end_step`: every rank, once per step; it launches the batched window exchange;
    - :meth:`finish`: the final exchange, at the normal end of training.

    The constructor, :meth:`publish`, :meth:`close`, :meth:`terminate` and :meth:`fail` are local.
    Building a session directly takes the already gathered ``topology`` (one placement per rank, as
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
        sinks: rank 0: more telemetry sinks (:class:`~pace_strategy.telemetry.sinks.Sink`), after
            pace_strategy's own.
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
        sinks: Sequence[Sink] = (),
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
        self.pacer = Pacer.for_device(config, group, rank, world_size, device, topology, clock, hierarchy)
        hierarchy = self.pacer.hierarchy
        self.topology = [dict(placement) for placement in topology]
        #: torchrun's restarts of this job so far: the record says so, and a restarted attempt's
        #: record gets its own file beside the earlier ones (``record_filename``)
        self.restart_count = elastic_restart_count()
        nodes = None if hierarchy is None else hierarchy.layout.nodes
        #: rank 0 with ``log_dir`` and ``run_record``: the run record
        self.record_sink = RecordSink.for_rank(
            rank, config, log_dir, self.topology, framework, self.restart_count, nodes
        )
        self.publisher = Publisher.for_rank(
            rank, config, world_size, self.record_sink, metrics_sink, dashboard, sinks, self.topology
        )
        #: a node leader's shard of the record (its node's ranks), when the record is sharded
        self.shard = node_shard(config, group, rank, world_size, self.record_path, hierarchy)
        self._finished = False
        # Every rank times its own collections (a callback per collection, nothing per step); with
        # gc_sync the Pacer also collects at agreed steps. Both are undone in _close, whatever ends the run.
        self.gc_monitor = GcMonitor(self.pacer.add_gc)
        self.gc_monitor.install()
        self._gc_ranks: list[dict[str, Any]] | None = None  #: every rank's GC report, gathered at finish
        #: what a checkpoint holds: ``session.state.register``, ``.state_dict(step)``, ``.load(state)``
        self.state = StateRegistry(
            world_size,
            {"pacer": self.pacer},
            on_load=None if self.record_sink is None else self.record_sink.resume,
            announce=rank == 0,
        )
        self._loader_workers = LoaderWorkers()
        self.watchdog = start_watchdog(
            dataclasses.replace(config.hang, action=config.hang_action),
            rank=rank,
            world_size=world_size,
            topology=self.topology,
            restart_count=self.restart_count,
            record_path=self.record_path,
            line_of=hang_line,
            report=self.publisher.hang,
            close_hung=self._close_hung,
            record_note=self._record_note,
            progress=lambda: (self.pacer.progress, self.pacer.progress_step),
        )
        close_at_exit(self)
        for caveat in mesh_caveats(self.topology) if rank == 0 else ():
            log.warning("pace_strategy: %s", caveat)

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
        coordinates: Mapping[str, int] | None = None,
        **kwargs: Any,
    ) -> PacingSession:
        """Gather every rank's placement on ``group`` and build the session. Collective on every rank.

        ``node_rank`` / ``local_rank`` override what the environment says about this rank's place;
        ``coordinates``: its device-mesh coordinates (``telemetry.topology.mesh_coordinates``);
        ``kwargs`` are the constructor's other arguments (``log_dir``, ``metrics_sink``, ``clock``,
        ``owns_group``).
        """
        placement = local_placement(
            rank, device, node_rank=node_rank, local_rank=local_rank, coordinates=coordinates
        )
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
        """A session on its own gloo group (see :func:`~pace_strategy.core.groups.side_group`), which it
        releases at ``finish``. Collective on every rank (creates the group, then :meth:`start`);
        ``kwargs`` are the other arguments of :meth:`start`."""
        return cls.start(config, group=side_group(config), owns_group=True, **kwargs)

    def note_dataloader_workers(self, workers: int | None) -> None:
        """Local: a training DataLoader of this rank runs ``workers`` worker processes. The largest
        count noted before the first step ends is recorded in this rank's placement (the run record's
        header), where ``pace diagnose`` counts busy threads per host."""
        self._loader_workers.note(workers)

    def end_step(self) -> WindowResult | None:
        """Forward the end of a step to the pacer and publish any window that completed.

        Collective on every rank (once per step). The first call also gathers every rank's noted
        DataLoader workers (adapters learn of their loaders after the session starts). Nothing
        once the session is closed (a preempted run may still finish the step in progress)."""
        if self._finished:
            return None
        if not self._loader_workers.shared:
            step = self.pacer.steps_seen
            self._loader_workers.share(lambda t: self.pacer.exchange.gather(t, step, step), self.topology)
            if self.record is not None:
                self.record.update_topology(self.topology)
        result = self.pacer.end_step()
        if result is not None:
            self.publish(result)
        return result

    def publish(self, result: WindowResult) -> None:
        """Rank 0: hand the window to the telemetry thread, which logs every step at its own global
        step and appends it to the run record (off the training thread: a TensorBoard writer blocks
        ~65 us per scalar on its bounded queue, ~1 ms per step for the pace/ tags). A node leader
        with a shard of the record appends its node's rows to it first (a few ranks' rows)."""
        if self.shard is not None and result.gathered.numel():
            # the leads' reference, each step's smallest wait, from the nodes' (a node leader's)
            nodes = result.node_steps
            self.shard.write_gathered(result.gathered, None if nodes is None else node_transfer(nodes))
        if self.rank == 0:
            self.publisher.submit(result)

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
                self._group, self.rank, self.world_size, self._gc_report(), self.config.exchange_timeout_s
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
            self._record_note("closed as terminated"),
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
    def record(self) -> RunRecordWriter | None:
        """Rank 0's run-record writer (``None`` without one)."""
        return None if self.record_sink is None else self.record_sink.record

    @property
    def record_path(self) -> Path | None:
        """Where rank 0's run record goes (``None`` without one; it exists once written)."""
        return None if self.record_sink is None else self.record_sink.record.path

    @property
    def record_created(self) -> bool:
        """Whether the run record exists on disk (``record_path`` is only where it goes)."""
        return self.record is not None and self.record.created

    def _record_note(self, how: str = "kept") -> str:
        """Where the run record is, for a log line (empty without one on disk)."""
        return "" if self.record_sink is None else self.record_sink.note(how)

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
            self._record_note(),
        )

    def _close_hung(self, error: PaceHangError) -> bool:
        if self._finished:
            return False
        self._finished = True
        self._close("hung", error)
        return True

    def _gc_report(self) -> dict[str, Any]:
        return self.gc_monitor.report(self.rank, self.pacer.gc_sync)

    def _close(
        self,
        status: str,
        error: BaseException | None,
        *,
        reason: str | None = None,
        local_rows: torch.Tensor | None = None,
        unresolved: int = 0,
    ) -> None:
        no_longer_open(self)
        self.gc_monitor.remove()  # the collector gets its settings back, however the run ends
        if self.pacer.gc_sync is not None:
            self.pacer.gc_sync.restore()
        if self.shard is not None:
            self.shard.close()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        # Drain what was already handed over (bounded: a wedged sink must not hang shutdown), then
        # close the sinks (the endpoint after the last window reached it: a last scrape sees it all).
        normal = error is None and reason is None
        self.publisher.close(timeout_s=self.config.exchange_timeout_s if normal else 10.0)
        if self.record_sink is None:
            return
        if local_rows is not None and len(local_rows) > 0:
            self.record_sink.record.write_local_steps(self.rank, local_rows.tolist())
        self.record_sink.end(
            status,
            reason if error is None else f"{type(error).__name__}: {error}",
            pacer=self.pacer,
            publisher=self.publisher,
            # one report per rank after a normal finish, else rank 0's alone
            gc_ranks=self._gc_ranks if self._gc_ranks is not None else [self._gc_report()],
            unresolved=unresolved,
        )
