"""Dashboards depend on these names: changing one is a breaking change."""

import pytest

from pace_strategy.core.records import StepSummary
from pace_strategy.telemetry import schema


def test_tag_names_are_pinned():
    assert schema.TAGS == (
        "pace/skew_ms",
        "pace/straggler_rank",
        "pace/step_ms",
        "pace/step_cv",
        "pace/wait_ms_min",
        "pace/wait_ms_max",
        "pace/delay_ms_max",
        "pace/pacing_active",
        "pace/gc_ms_max",
        "pace/step_ms_low",
        "pace/step_ms_high",
    )
    assert schema.lead_tag(3) == "pace/lead_ms/rank_3"
    assert (schema.LEAD_MS_MEDIAN, schema.LEAD_MS_MIN, schema.LEAD_MS_MAX) == (
        "pace/lead_ms/median",
        "pace/lead_ms/min",
        "pace/lead_ms/max",
    )


def summary(world):
    zeros = (0.0,) * world
    return StepSummary(
        step=7,
        valid=True,
        warmup=False,
        skew_ms=12.5,
        straggler_rank=1,
        compute_straggler_rank=1,
        step_ms=80.0,
        step_cv=0.1,
        wait_ms_min=0.5,
        wait_ms_max=13.0,
        delay_ms_max=2.0,
        pacing_active=True,
        lead_ms=tuple(float(r) for r in range(world)),
        compute_ms=zeros,
        wait_ms=zeros,
        delay_ms=zeros,
        rank_step_ms=zeros,
        data_ms=zeros,
        gap_ms=zeros,
        buckets=1,
        samples=(8,) * world,
    )


def test_step_metrics_values_and_per_rank_limit():
    m = schema.step_metrics(summary(3), per_rank_tag_limit=64)
    assert m["pace/skew_ms"] == 12.5 and m["pace/straggler_rank"] == 1.0 and m["pace/pacing_active"] == 1.0
    assert m["pace/lead_ms/rank_2"] == 2.0
    assert set(schema.TAGS) <= set(m)
    assert m["pace/step_ms_low"] == 72.0 and m["pace/step_ms_high"] == 88.0  # step_ms x (1 -/+ cv)
    assert schema.LEAD_MS_MEDIAN not in m
    limited = schema.step_metrics(summary(3), per_rank_tag_limit=2)
    assert not any(k.startswith(schema.LEAD_MS_PREFIX) for k in limited)
    # above the limit: the lead over the ranks (0, 1, 2 here) as median and band
    assert (limited["pace/lead_ms/median"], limited["pace/lead_ms/min"], limited["pace/lead_ms/max"]) == (
        1.0,
        0.0,
        2.0,
    )


@pytest.mark.parametrize(
    ("world", "limit", "shares"), [(3, 64, False), (3, 64, True), (3, 2, True), (128, 64, False)]
)
def test_every_chart_of_the_dashboard_matches_tags_that_are_written(world, limit, shares):
    import re

    written = set(schema.step_metrics(summary(world), limit, batch_shares=shares))
    layout = schema.dashboard_layout(world, limit, batch_shares=shares)
    assert list(layout) == [schema.DASHBOARD]
    for title, (kind, series) in layout[schema.DASHBOARD].items():
        if kind == "Margin":  # exact tags: value, lower, upper
            assert len(series) == 3 and set(series) <= written, title
        else:
            assert kind == "Multiline"
            for regex in series:
                assert any(re.fullmatch(regex, tag) for tag in written), (title, regex)
    titles = " ".join(layout[schema.DASHBOARD])
    assert ("lead per rank" in titles) == (world <= limit)
