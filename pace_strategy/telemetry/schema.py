"""Metric tag names, defined once: dashboards depend on them and a test pins them."""

from __future__ import annotations

import re
from typing import Any

from pace_strategy.core.records import StepSummary
from pace_strategy.telemetry.tag_groups import TagGroups

__all__ = [
    "BATCH_SHARE_PREFIX",
    "DASHBOARD",
    "DELAY_MS_MAX",
    "GC_MS_MAX",
    "LEAD_MS_MAX",
    "LEAD_MS_MEDIAN",
    "LEAD_MS_MIN",
    "LEAD_MS_PREFIX",
    "PACING_ACTIVE",
    "SKEW_MS",
    "STEP_CV",
    "STEP_MS",
    "STEP_MS_HIGH",
    "STEP_MS_LOW",
    "STRAGGLER_RANK",
    "TAGS",
    "WAIT_MS_MAX",
    "WAIT_MS_MIN",
    "batch_share_tag",
    "dashboard_layout",
    "lead_tag",
    "step_metrics",
]

SKEW_MS = "pace/skew_ms"  #: latest minus earliest arrival at this step's sync point, ms
STRAGGLER_RANK = "pace/straggler_rank"  #: the rank that arrived last
STEP_MS = "pace/step_ms"  #: wall time of the step (slowest rank), ms
STEP_CV = "pace/step_cv"  #: coefficient of variation of step time over the rolling window
WAIT_MS_MIN = "pace/wait_ms_min"  #: smallest wait at the sync point (~ transfer time), ms
WAIT_MS_MAX = "pace/wait_ms_max"  #: largest wait at the sync point, ms
DELAY_MS_MAX = "pace/delay_ms_max"  #: largest pacing delay applied at this step, ms
PACING_ACTIVE = "pace/pacing_active"  #: 1 while pacing is on, else 0
GC_MS_MAX = "pace/gc_ms_max"  #: longest time any rank spent in the garbage collector in this step, ms
LEAD_MS_PREFIX = "pace/lead_ms/rank_"  #: per-rank lead, ms: ``pace/lead_ms/rank_{r}``
#: above the per-rank tag limit, the lead over the ranks instead: median, smallest, largest, ms
LEAD_MS_MEDIAN = "pace/lead_ms/median"
LEAD_MS_MIN = "pace/lead_ms/min"
LEAD_MS_MAX = "pace/lead_ms/max"
#: and, where the ranks are grouped (``telemetry.tag_groups``), each group's lead: the smallest of
#: its ranks', ms: ``pace/lead_ms/replica_{i}``, ``pace/lead_ms/dp_{i}`` or ``pace/lead_ms/node_{i}``
LEAD_MS_GROUP_PREFIX = "pace/lead_ms/"
#: the step time's band: ``step_ms * (1 -/+ step_cv)``, ms (the dashboard's margin chart)
STEP_MS_LOW = "pace/step_ms_low"
STEP_MS_HIGH = "pace/step_ms_high"
#: per-rank samples trained on in the step, with rebalancing: ``pace/batch_share/rank_{r}``
BATCH_SHARE_PREFIX = "pace/batch_share/rank_"

#: The fixed tags written every step (per-rank lead tags come in addition).
TAGS: tuple[str, ...] = (
    SKEW_MS,
    STRAGGLER_RANK,
    STEP_MS,
    STEP_CV,
    WAIT_MS_MIN,
    WAIT_MS_MAX,
    DELAY_MS_MAX,
    PACING_ACTIVE,
    GC_MS_MAX,
    STEP_MS_LOW,
    STEP_MS_HIGH,
)

#: the dashboard's category in TensorBoard's Custom Scalars tab
DASHBOARD = "pace"


def lead_tag(rank: int) -> str:
    """The per-rank lead tag of ``rank``."""
    return f"{LEAD_MS_PREFIX}{rank}"


def batch_share_tag(rank: int) -> str:
    """The per-rank batch-share tag of ``rank``."""
    return f"{BATCH_SHARE_PREFIX}{rank}"


def step_metrics(
    summary: StepSummary,
    per_rank_tag_limit: int,
    *,
    batch_shares: bool = False,
    groups: TagGroups | None = None,
) -> dict[str, float]:
    """The tag -> value mapping logged for one step; ``batch_shares`` (rebalancing on) adds the
    per-rank samples, where the step reported them; ``groups`` names the summary's group leads."""
    metrics = {
        SKEW_MS: summary.skew_ms,
        STRAGGLER_RANK: float(summary.straggler_rank),
        STEP_MS: summary.step_ms,
        STEP_CV: summary.step_cv,
        WAIT_MS_MIN: summary.wait_ms_min,
        WAIT_MS_MAX: summary.wait_ms_max,
        DELAY_MS_MAX: summary.delay_ms_max,
        PACING_ACTIVE: 1.0 if summary.pacing_active else 0.0,
        GC_MS_MAX: summary.largest_gc_ms(),
        STEP_MS_LOW: summary.step_ms * (1.0 - summary.step_cv),
        STEP_MS_HIGH: summary.step_ms * (1.0 + summary.step_cv),
    }
    if len(summary.lead_ms) > per_rank_tag_limit or not summary.lead_ms:
        metrics[LEAD_MS_MEDIAN], metrics[LEAD_MS_MIN], metrics[LEAD_MS_MAX] = summary.lead_ms_band()
        if groups is not None:
            for group, value in enumerate(summary.group_lead_ms):
                metrics[LEAD_MS_GROUP_PREFIX + groups.label(group)] = value
    else:
        for rank, value in enumerate(summary.lead_ms):
            metrics[lead_tag(rank)] = value
        if batch_shares and any(summary.samples):
            for rank, samples in enumerate(summary.samples):
                metrics[batch_share_tag(rank)] = float(samples)
    return metrics


def dashboard_layout(
    world_size: int,
    per_rank_tag_limit: int,
    *,
    batch_shares: bool = False,
    groups: TagGroups | None = None,
) -> dict[str, dict[str, list[Any]]]:
    """TensorBoard's custom-scalars layout of the ``pace/`` tags (``SummaryWriter.add_custom_scalars``):
    one category, :data:`DASHBOARD`, whose charts put the ranks side by side. Up to
    ``per_rank_tag_limit`` ranks, every rank's lead on one multiline chart (a regex over the per-rank
    tags); above it, the median lead with its min..max band (a margin chart) and, with ``groups``,
    every group's lead on one multiline chart. Every regex matches tags :func:`step_metrics` writes
    for the same arguments."""
    charts: dict[str, list[Any]] = {}
    if world_size <= per_rank_tag_limit:
        charts["lead per rank (ms early at the sync point; 0 = the straggler)"] = [
            "Multiline",
            [re.escape(LEAD_MS_PREFIX) + r"\d+"],
        ]
    else:
        charts[f"lead over the {world_size} ranks: median, min..max (ms)"] = [
            "Margin",
            [LEAD_MS_MEDIAN, LEAD_MS_MIN, LEAD_MS_MAX],
        ]
        if groups is not None:
            charts[f"lead per {groups.kind} (ms early, its last rank; 0 = the straggler's)"] = [
                "Multiline",
                [re.escape(LEAD_MS_GROUP_PREFIX + groups.kind + "_") + r"\d+"],
            ]
    charts["straggler rank (the rank that arrived last)"] = ["Multiline", [re.escape(STRAGGLER_RANK)]]
    charts["skew and transfer time (ms)"] = ["Multiline", [re.escape(SKEW_MS), re.escape(WAIT_MS_MIN)]]
    charts["step time with its CV band (ms)"] = ["Margin", [STEP_MS, STEP_MS_LOW, STEP_MS_HIGH]]
    charts["pacing: on (1) or off, and the largest delay (ms)"] = [
        "Multiline",
        [re.escape(PACING_ACTIVE), re.escape(DELAY_MS_MAX)],
    ]
    if batch_shares and world_size <= per_rank_tag_limit:
        charts["rebalancing: samples per rank"] = ["Multiline", [re.escape(BATCH_SHARE_PREFIX) + r"\d+"]]
    charts["garbage collection: longest pause in the step (ms)"] = ["Multiline", [re.escape(GC_MS_MAX)]]
    return {DASHBOARD: charts}
