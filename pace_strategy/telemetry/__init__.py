"""Telemetry: the metric tag schema, the run record, and where each rank runs."""

from pace_strategy.telemetry.run_record import (
    RECORD_FILENAME,
    RunRecord,
    RunRecordError,
    RunRecordWriter,
    RunSummary,
    read_run_record,
    summarize,
)
from pace_strategy.telemetry.schema import TAGS, lead_tag, step_metrics
from pace_strategy.telemetry.topology import RankPlacement, local_placement

__all__ = [
    "RECORD_FILENAME",
    "TAGS",
    "RankPlacement",
    "RunRecord",
    "RunRecordError",
    "RunRecordWriter",
    "RunSummary",
    "lead_tag",
    "local_placement",
    "read_run_record",
    "step_metrics",
    "summarize",
]
