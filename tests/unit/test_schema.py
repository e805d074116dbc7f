"""Dashboards depend on these names: changing one is a breaking change."""

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
    )
    assert schema.lead_tag(3) == "pace/lead_ms/rank_3"


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
    )


def test_step_metrics_values_and_per_rank_limit():
    m = schema.step_metrics(summary(3), per_rank_tag_limit=64)
    assert m["pace/skew_ms"] == 12.5 and m["pace/straggler_rank"] == 1.0 and m["pace/pacing_active"] == 1.0
    assert m["pace/lead_ms/rank_2"] == 2.0
    assert set(schema.TAGS) <= set(m)
    limited = schema.step_metrics(summary(3), per_rank_tag_limit=2)
    assert not any(k.startswith(schema.LEAD_MS_PREFIX) for k in limited)
