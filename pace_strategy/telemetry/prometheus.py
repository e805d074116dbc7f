"""Rank 0's live Prometheus endpoint (``PacingConfig.metrics_port``; ``pip install
pace-strategy[prometheus]``): the window's numbers for a Grafana panel, updated per window on the
telemetry thread, served by ``prometheus_client``'s own HTTP server thread.

Every metric is in its own registry (not the process-wide default: a second session in the same
process, or the user's own metrics, never collide). Per-rank series carry a ``rank`` label, capped
like the TensorBoard tags: above ``per_rank_tag_limit`` ranks, the lead's median, min and max
instead, and each group's lead with a ``group`` label where the ranks are grouped
(:mod:`~pace_strategy.telemetry.tag_groups`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.core.records import Decision, StepSummary
from pace_strategy.telemetry.sink import Published
from pace_strategy.telemetry.tag_groups import TagGroups

__all__ = ["METRICS", "MetricsEndpoint"]

#: name -> help of every metric served (names without the ``_total`` a counter gets on the wire)
METRICS = {
    "pace_skew_ms": "Latest minus earliest arrival at the last step's sync point, ms",
    "pace_transfer_ms": "Smallest wait at the last step's sync point (the transfer time), ms",
    "pace_step_ms": "Wall time of the last step on the slowest rank, ms",
    "pace_step_cv": "Coefficient of variation of the step time over the rolling window",
    "pace_straggler_rank": "The rank that arrived last at the last step",
    "pace_delay_ms_max": "Largest pacing delay applied at the last step, ms",
    "pace_pacing_active": "1 while some rank is paced, else 0",
    "pace_gc_ms_max": "Longest garbage-collector pause of any rank in the last step, ms",
    "pace_lead_ms": "How early each rank arrived at the last step's sync point, ms (0: the straggler)",
    "pace_lead_ms_median": "Median lead over the ranks at the last step, ms (above the per-rank limit)",
    "pace_lead_ms_min": "Smallest lead over the ranks at the last step, ms (above the per-rank limit)",
    "pace_lead_ms_max": "Largest lead over the ranks at the last step, ms (above the per-rank limit)",
    "pace_group_lead_ms": "How early each group of ranks (its last rank) arrived at the last step's sync "
    "point, ms (above the per-rank limit; 0: the straggler's group)",
    "pace_batch_share": "Samples each rank trained on in the last step (rebalancing)",
    "pace_steps": "Steps published (every rank's numbers exchanged)",
    "pace_windows": "Windows decided, by the controller's state after the window",
    "pace_hangs": "Hangs the watchdog named",
}


class MetricsEndpoint:
    """Serve the metrics on ``addr:port`` from now until :meth:`close`.

    Raises ``PacingConfigError`` naming ``metrics_port`` when ``prometheus_client`` is missing or the
    port cannot be bound (in use, or privileged).
    """

    def __init__(
        self,
        port: int,
        world_size: int,
        per_rank_tag_limit: int,
        *,
        addr: str = "0.0.0.0",
        groups: TagGroups | None = None,
    ) -> None:
        try:
            import prometheus_client as pc
        except ImportError:
            raise PacingConfigError(
                f"PacingConfig.metrics_port={port} needs prometheus_client: pip install "
                "'pace-strategy[prometheus]' (or set metrics_port=0, the default, for no endpoint)."
            ) from None
        self.world_size = world_size
        self.per_rank = world_size <= per_rank_tag_limit
        registry = pc.CollectorRegistry(auto_describe=True)
        self.registry = registry

        def gauge(name: str, labels: Sequence[str] = ()) -> Any:
            return pc.Gauge(name, METRICS[name], list(labels), registry=registry)

        self._gauges = {
            name: gauge(name)
            for name in (
                "pace_skew_ms",
                "pace_transfer_ms",
                "pace_step_ms",
                "pace_step_cv",
                "pace_straggler_rank",
                "pace_delay_ms_max",
                "pace_pacing_active",
                "pace_gc_ms_max",
            )
        }
        if self.per_rank:
            self._lead = gauge("pace_lead_ms", ["rank"])
            self._share = gauge("pace_batch_share", ["rank"])
        else:
            self._band = {
                name: gauge(name) for name in ("pace_lead_ms_median", "pace_lead_ms_min", "pace_lead_ms_max")
            }
        self._groups = None if self.per_rank else groups
        if self._groups is not None:  # group="replica_0", "dp_3", "node_12"
            self._group_lead = gauge("pace_group_lead_ms", ["group"])
        self._steps = pc.Counter("pace_steps", METRICS["pace_steps"], registry=registry)
        self._windows = pc.Counter("pace_windows", METRICS["pace_windows"], ["state"], registry=registry)
        self._hangs = pc.Counter("pace_hangs", METRICS["pace_hangs"], registry=registry)
        self._server: Any = None
        try:
            self._server, self._thread = pc.start_http_server(port, addr=addr, registry=registry)
        except OSError as error:
            raise PacingConfigError(
                f"PacingConfig.metrics_port={port}: rank 0 cannot serve metrics on {addr}:{port} ({error}). "
                "Choose a free port, or 0 for no endpoint."
            ) from None
        self.port = int(self._server.server_address[1])  #: the port bound (``port`` unless it was 0)

    def write(self, window: Published) -> None:
        """One published window (a :class:`~pace_strategy.telemetry.sink.Sink`)."""
        self.update(window.summaries, window.result.decision)

    def update(self, summaries: Sequence[StepSummary], decision: Decision) -> None:
        """One published window: the last step's numbers, the counts (telemetry thread)."""
        self._windows.labels(state=str(decision.state.value)).inc()
        if not summaries:
            return
        self._steps.inc(len(summaries))
        last = summaries[-1]
        g = self._gauges
        g["pace_skew_ms"].set(last.skew_ms)
        g["pace_transfer_ms"].set(last.wait_ms_min)
        g["pace_step_ms"].set(last.step_ms)
        g["pace_step_cv"].set(last.step_cv)
        g["pace_straggler_rank"].set(last.straggler_rank)
        g["pace_delay_ms_max"].set(last.delay_ms_max)
        g["pace_pacing_active"].set(1.0 if last.pacing_active else 0.0)
        g["pace_gc_ms_max"].set(last.largest_gc_ms())
        if self.per_rank:
            for rank, lead in enumerate(last.lead_ms):
                self._lead.labels(rank=str(rank)).set(lead)
            for rank, samples in enumerate(last.samples):
                if samples:
                    self._share.labels(rank=str(rank)).set(samples)
        else:
            median, low, high = last.lead_ms_band()
            self._band["pace_lead_ms_median"].set(median)
            self._band["pace_lead_ms_min"].set(low)
            self._band["pace_lead_ms_max"].set(high)
            if self._groups is not None:
                for group, lead in enumerate(last.group_lead_ms):
                    self._group_lead.labels(group=self._groups.label(group)).set(lead)

    def hang(self, line: Mapping[str, Any]) -> None:
        """The watchdog named hung ranks (``line``: the run record's hang line; counted only)."""
        self._hangs.inc()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
