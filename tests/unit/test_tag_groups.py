"""Above ``per_rank_tag_limit`` the tags and the Prometheus endpoint group the ranks by their place
(a replica of an HSDP mesh, a tensor-parallel group, a node): which grouping, each group's lead
against every rank's, and both outputs read back (TensorBoard's event file, a real HTTP scrape)."""

from __future__ import annotations

import re
import urllib.request

import pytest
from torch.utils.tensorboard import SummaryWriter

from pace_strategy.core.records import Decision, PolicyState
from pace_strategy.core.summary import StepSummarizer
from pace_strategy.integrations.dashboard import add_scalars
from pace_strategy.telemetry.prometheus import MetricsEndpoint
from pace_strategy.telemetry.schema import dashboard_layout, step_metrics
from pace_strategy.telemetry.tag_groups import TagGroups, tag_groups
from tests.integration.helpers import parse_metrics, read_scalars
from tests.unit.test_window_layout import _window

pytestmark = pytest.mark.timeout(60)


def _places(world: int, **coordinates) -> list[dict]:
    """``coordinates``: name -> function of the rank."""
    return [
        {"rank": r, "node_rank": r // 4, **{k: f(r) for k, f in coordinates.items()}} for r in range(world)
    ]


def test_the_grouping_follows_the_layout():
    by4, by2 = tuple(r // 4 for r in range(16)), tuple(r // 2 for r in range(16))
    hsdp = _places(16, dp_replicate=lambda r: r // 4, dp_shard=lambda r: r % 4)
    assert tag_groups(hsdp, 16, per_rank_tag_limit=8) == TagGroups("replica", by4)
    # FSDP x TP: a tensor-parallel group (one dp_shard coordinate) arrives as one data-parallel rank
    tp = _places(16, dp_shard=lambda r: r // 2, tp=lambda r: r % 2)
    assert tag_groups(tp, 16, per_rank_tag_limit=8) == TagGroups("dp", by2)
    assert tag_groups(_places(16), 16, per_rank_tag_limit=8) == TagGroups("node", by4)
    # per rank up to the limit; no grouping that gives more groups than the limit, or one group
    assert tag_groups(hsdp, 16, per_rank_tag_limit=16) is None
    assert tag_groups(_places(16), 16, per_rank_tag_limit=3) is None
    assert tag_groups([{**p, "node_rank": 0} for p in _places(16)], 16, per_rank_tag_limit=8) is None
    assert tag_groups(_places(16)[:8], 16, per_rank_tag_limit=8) is None  # not every rank placed


def test_a_group_s_lead_is_its_last_rank_s():
    world, index = 12, tuple(r // 3 for r in range(12))
    g = _window(world, 6, 0, seed=3)
    summaries = StepSummarizer(8).summarize(g, per_rank=True, groups=index)
    for summary in summaries:
        expected = [min(summary.lead_ms[r] for r in range(world) if index[r] == k) for k in range(4)]
        assert summary.group_lead_ms == pytest.approx(expected)
        assert summary.group_lead_ms[index[summary.straggler_rank]] == 0.0
    # the same numbers where the summaries keep no per-rank tuples (a wide world)
    wide = StepSummarizer(8).summarize(g, per_rank=False, groups=index)
    assert [s.group_lead_ms for s in wide] == [s.group_lead_ms for s in summaries]


def test_the_group_tags_and_their_dashboard_chart_are_written_and_read_back(tmp_path):
    world, groups = 12, TagGroups("node", tuple(r // 3 for r in range(12)))
    summaries = StepSummarizer(8).summarize(_window(world, 4, 0, seed=1), per_rank=False, groups=groups.index)
    writer = SummaryWriter(str(tmp_path))
    layout = dashboard_layout(world, 8, groups=groups)
    writer.add_custom_scalars(layout)
    for summary in summaries:
        add_scalars(writer, step_metrics(summary, 8, groups=groups), summary.step)
    writer.close()
    scalars = read_scalars(tmp_path)
    written = {tag for tag in scalars if tag.startswith("pace/lead_ms/node_")}
    assert written == {f"pace/lead_ms/node_{k}" for k in range(4)}
    assert not any(re.fullmatch(r"pace/lead_ms/rank_\d+", tag) for tag in scalars)
    (chart,) = [series for title, (_, series) in layout["pace"].items() if title.startswith("lead per node")]
    assert all(re.fullmatch(chart[0], tag) for tag in written)
    for summary in summaries:
        for k in range(4):
            assert scalars[f"pace/lead_ms/node_{k}"][summary.step] == pytest.approx(summary.group_lead_ms[k])


def test_the_endpoint_serves_each_group_s_lead_over_http():
    world, groups = 12, TagGroups("replica", tuple(r // 3 for r in range(12)))
    window = _window(world, 4, 0, seed=2)
    last = StepSummarizer(8).summarize(window, per_rank=False, groups=groups.index)[-1]
    endpoint = MetricsEndpoint(0, world, per_rank_tag_limit=8, addr="127.0.0.1", groups=groups)
    try:
        decision = Decision(window=0, state=PolicyState.MONITOR, delays_ms=(0.0,) * world, reason="test")
        endpoint.update([last], decision)
        text = urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=10).read().decode()
    finally:
        endpoint.close()
    scraped = parse_metrics(text)
    for k in range(4):
        assert scraped[f'pace_group_lead_ms{{group="replica_{k}"}}'] == pytest.approx(last.group_lead_ms[k])
    assert scraped[f'pace_group_lead_ms{{group="replica_{groups.index[last.straggler_rank]}"}}'] == 0.0
    assert not any(k.startswith("pace_lead_ms{") for k in scraped)


def test_without_groups_nothing_changes():
    summary = StepSummarizer(8).summarize(_window(12, 4, 0, seed=4), per_rank=False)[-1]
    assert summary.group_lead_ms == ()
    assert not any(tag.startswith("pace/lead_ms/node_") for tag in step_metrics(summary, 8))
