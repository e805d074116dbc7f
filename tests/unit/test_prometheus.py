"""Rank 0's Prometheus endpoint: what a real HTTP scrape reads after a window, the per-rank cap, the
counters, and a port that cannot be bound failing at start naming the field."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.core.records import Decision, PolicyState, StepSummary
from pace_strategy.telemetry.prometheus import MetricsEndpoint
from tests.integration.helpers import free_port, parse_metrics

pytestmark = pytest.mark.timeout(30)


def _summary(step: int, world: int) -> StepSummary:
    zeros = (0.0,) * world
    return StepSummary(
        step=step, valid=True, warmup=False, skew_ms=12.5, straggler_rank=world - 1,
        compute_straggler_rank=world - 1, step_ms=80.0, step_cv=0.1, wait_ms_min=0.5, wait_ms_max=13.0,
        delay_ms_max=2.0, pacing_active=True, lead_ms=tuple(float(world - 1 - r) for r in range(world)),
        compute_ms=zeros, wait_ms=zeros, delay_ms=zeros, rank_step_ms=zeros, data_ms=zeros, gap_ms=zeros,
        buckets=0, gc_ms=(3.0, *zeros[1:]), samples=(8,) * world,
    )  # fmt: skip


def _scrape(port: int) -> dict[str, float]:
    return parse_metrics(
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    )


def _decision(state: PolicyState) -> Decision:
    return Decision(window=0, state=state, delays_ms=(0.0, 2.0), reason="test")


def test_a_scrape_reads_the_last_step_of_the_last_window():
    endpoint = MetricsEndpoint(0, 3, per_rank_tag_limit=64, addr="127.0.0.1")  # 0: any free port
    try:
        assert endpoint.port > 0
        endpoint.update([_summary(0, 3), _summary(1, 3)], _decision(PolicyState.PACING))
        endpoint.update([_summary(2, 3)], _decision(PolicyState.PACING))
        endpoint.hang({"ranks": [1]})
        m = _scrape(endpoint.port)
        assert m["pace_skew_ms"] == 12.5 and m["pace_step_ms"] == 80.0 and m["pace_transfer_ms"] == 0.5
        assert (
            m["pace_straggler_rank"] == 2.0 and m["pace_pacing_active"] == 1.0 and m["pace_gc_ms_max"] == 3.0
        )
        assert [m[f'pace_lead_ms{{rank="{r}"}}'] for r in range(3)] == [2.0, 1.0, 0.0]
        assert m['pace_batch_share{rank="1"}'] == 8.0
        assert m["pace_steps_total"] == 3.0 and m['pace_windows_total{state="pacing"}'] == 2.0
        assert m["pace_hangs_total"] == 1.0
    finally:
        endpoint.close()
        endpoint.close()  # idempotent
    with pytest.raises(OSError):
        _scrape(endpoint.port)  # nothing serves once closed


def test_above_the_per_rank_limit_the_lead_is_a_band():
    endpoint = MetricsEndpoint(0, 5, per_rank_tag_limit=4, addr="127.0.0.1")
    try:
        endpoint.update([_summary(0, 5)], _decision(PolicyState.MONITOR))
        m = _scrape(endpoint.port)
        assert not any(k.startswith("pace_lead_ms{") for k in m)
        assert (m["pace_lead_ms_median"], m["pace_lead_ms_min"], m["pace_lead_ms_max"]) == (2.0, 0.0, 4.0)
    finally:
        endpoint.close()


def test_a_port_in_use_fails_at_start_naming_the_field():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PacingConfigError, match=rf"metrics_port={port}: rank 0 cannot serve"):
            MetricsEndpoint(port, 2, per_rank_tag_limit=64, addr="127.0.0.1")


def test_the_endpoint_binds_the_configured_host_only():
    """``metrics_host`` reaches the endpoint rank 0's sinks start: bound to loopback, it answers there
    and is not bound on every interface."""
    from pace_strategy.core.config import PacingConfig
    from pace_strategy.telemetry.sinks import Publisher

    publisher = Publisher.for_rank(0, PacingConfig(metrics_port=free_port(), metrics_host="127.0.0.1"), 2)
    (endpoint,) = [s for s in publisher.sinks if isinstance(s, MetricsEndpoint)]
    try:
        assert endpoint._server.server_address[0] == "127.0.0.1"
        assert "pace_steps_total" in _scrape(endpoint.port)
    finally:
        publisher.close(timeout_s=5.0)


@pytest.mark.parametrize("host", ["", "  ", 7])
def test_a_metrics_host_that_is_no_address_fails_naming_the_field(host):
    from pace_strategy.core.config import PacingConfig

    with pytest.raises(PacingConfigError, match=r"PacingConfig\.metrics_host=.* is invalid"):
        PacingConfig(metrics_host=host)
