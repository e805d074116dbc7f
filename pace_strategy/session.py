"""One rank's pacing session: the Pacer plus its telemetry sinks, shared by every framework adapter.

An adapter starts a session once the process group exists (``PacingSession.with_side_group`` or
``PacingSession.start``, collective: they gather the topology), forwards the framework's step events to
``session.pacer`` / ``session.end_step``, and calls ``finish`` (all ranks, normal end) or ``fail``
(local, on an exception; no collective). Only rank 0 writes telemetry. The run record is created at
its first write: a session that saw no training step leaves no file and no directory.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pace_strategy._version import __version__
from pace_strategy.core.clock import Clock, clock_for_device
from pace_strategy.core.comm import gather_json
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.pacer import Pacer, WindowResult
from pace_strategy.core.summary import StepSummarizer
from pace_strategy.telemetry.run_record import RECORD_FILENAME, RunRecordWriter
from pace_strategy.telemetry.schema import step_metrics
from pace_strategy.telemetry.topology import local_placement

__all__ = ["MetricsSink", "PacingSession", "side_group"]

log = logging.getLogger(__name__)

#: Receives one step's tags and the step's true global step (e.g. a framework logger's log_metrics).
MetricsSink = Callable[[Mapping[str, float], int], None]


def side_group(config: PacingConfig) -> dist.ProcessGroup | None:
    """A gloo group over all ranks for the window exchange (``None`` when not distributed).

    Collective on every rank. gloo keeps the few floats per step on the CPU, off the NCCL streams, and
    gets its own timeout so that a dead or hung peer is reported by pace_strategy instead of hanging.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=config.exchange_timeout_s))


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
        clock: how durations are measured (default: ``clock_for_device(device)``).
        owns_group: release ``group`` at :meth:`finish`.
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
        clock: Clock | None = None,
        owns_group: bool = False,
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
        self.pacer = Pacer(config, group, rank, world_size, clock or clock_for_device(device))
        self.metrics_sink = metrics_sink if rank == 0 else None
        self.topology = [dict(placement) for placement in topology]
        self.record: RunRecordWriter | None = None
        self.record_path: Path | None = None
        if rank == 0 and config.run_record and log_dir is not None:
            self.record_path = Path(log_dir) / RECORD_FILENAME
            self.record = RunRecordWriter(
                self.record_path,
                world_size=world_size,
                config=config.to_dict(),
                topology=self.topology,
                framework=framework,
                extra={"versions": {"pace_strategy": __version__, "torch": torch.__version__}},
            )
        self._finished = False
        self.publish_ns = 0  #: rank 0: telemetry-thread time spent writing tags and the run record
        self._publisher: _Publisher | None = None
        # Summaries are built on the telemetry thread: only rank 0 needs them, decisions do not.
        self._summarizer = StepSummarizer(config.cv_window_steps)
        self._dataloader_workers: int | None = None
        self._workers_shared = False

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
        DataLoader workers (adapters learn of their loaders after the session starts)."""
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
        ~65 us per scalar on its bounded queue, ~1 ms per step for the pace/ tags)."""
        if self.rank != 0:
            return
        if self.metrics_sink is None and self.record is None:
            self._log_warnings(result)  # nothing to write: no thread, no summaries
            return
        if self._publisher is None:
            self._publisher = _Publisher(self._publish)
        self._publisher.submit(result)

    def _publish(self, result: WindowResult) -> None:
        started = time.perf_counter_ns()
        try:
            self._publish_now(result)
        finally:
            self.publish_ns += time.perf_counter_ns() - started

    def _log_warnings(self, result: WindowResult) -> None:
        for message in result.warnings:
            if self.record_path is not None:
                message += f" For the full picture: pace diagnose {self.record_path.parent}"
            log.warning(message)

    def _publish_now(self, result: WindowResult) -> None:
        self._log_warnings(result)
        summaries = self._summarizer.summarize(result.gathered)
        if self.metrics_sink is not None:
            for summary in summaries:
                self.metrics_sink(step_metrics(summary, self.config.per_rank_tag_limit), summary.step)
        if self.record is not None:
            self.record.write_window(summaries, result.decision)

    def finish(self) -> None:
        """Normal end of training (collective: every rank calls it): exchange and publish what is left."""
        if self._finished:
            return
        self._finished = True
        try:
            for result in self.pacer.flush():
                self.publish(result)
        except BaseException as error:
            self._close("failed", error)
            raise
        self._close("completed", None)
        if self._owns_group and dist.is_initialized():
            # The flush was the group's last collective on every rank: release it now, while the
            # peers are alive, rather than in an interpreter-exit destructor.
            dist.destroy_process_group(self._group)
        self._group = None

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

    def _close(self, status: str, error: BaseException | None) -> None:
        if self._publisher is not None:
            # Drain what was already handed over (bounded: a wedged sink must not hang shutdown).
            self._publisher.close(timeout_s=self.config.exchange_timeout_s if error is None else 10.0)
            self._publisher = None
        if self.record is not None:
            steps = max(self.pacer.steps_seen, 1)
            cost = {
                "window_work_ms_total": self.pacer.window_work_ns / 1e6,
                "window_work_us_per_step": self.pacer.window_work_ns / 1e3 / steps,
                "exchange_wait_us_per_step": self.pacer.exchange_wait_ns / 1e3 / steps,
                "flush_ms": self.pacer.flush_ns / 1e6,
                "telemetry_thread_us_per_step": self.publish_ns / 1e3 / steps,
            }
            message = None if error is None else f"{type(error).__name__}: {error}"
            # A run that never stepped (set up, then stopped or failed) leaves no record behind.
            self.record.close(
                status, message, extra={"rank0_pacer_cost": cost}, create=self.pacer.steps_seen > 0
            )


class _Publisher:
    """A single background thread that runs the telemetry sinks in order, one window at a time.

    A sink that raises is reported once and then skipped for the rest of the run: telemetry must
    never take training down.
    """

    _STOP = object()

    def __init__(self, publish: Callable[[WindowResult], None]) -> None:
        self._publish = publish
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="pace-telemetry", daemon=True)
        self._thread.start()

    def submit(self, result: WindowResult) -> None:
        self._queue.put(result)

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
            if self._failed:
                continue
            try:
                self._publish(item)  # type: ignore[arg-type]
            except Exception:
                self._failed = True
                log.exception(
                    "pace_strategy: a telemetry sink failed; telemetry is off for the rest of the run"
                )
