"""The run record: rank 0's full per-rank, per-step JSON-lines file for offline diagnosis (schema v1).

Lines, in order: one ``header`` (schema, world size, config, topology), then ``step`` and ``decision``
lines as windows arrive, then one ``end`` line. Each window is flushed to disk, so a crash loses at
most the window in flight; a reader tolerates a truncated last line. The file (and its directory) is
created at the first write, not when the writer is built: a run that writes nothing leaves nothing.
See docs/telemetry.md.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pace_strategy.core.glossary import coefficient_of_variation
from pace_strategy.core.records import Decision, StepSummary

__all__ = [
    "RECORD_FILENAME",
    "SCHEMA",
    "SCHEMA_VERSION",
    "RunRecord",
    "RunRecordError",
    "RunRecordWriter",
    "RunSummary",
    "iter_run_record",
    "read_run_record",
    "summarize",
]

SCHEMA = "pace_strategy/run-record"
SCHEMA_VERSION = 1
RECORD_FILENAME = "pace_run.jsonl"


class RunRecordError(ValueError):
    """A run record is missing, empty or unreadable."""


def _clean(value: float) -> float | None:
    # Microsecond resolution is plenty and keeps a 100k-step, 64-rank record to a few hundred MB.
    return round(value, 3) if math.isfinite(value) else None


def _cleans(values: Iterable[float]) -> list[float | None]:
    return [_clean(v) for v in values]


def step_line(s: StepSummary) -> dict[str, Any]:
    """The JSON object written for one step."""
    return {
        "record": "step",
        "step": s.step,
        "valid": s.valid,
        "warmup": s.warmup,
        "skew_ms": _clean(s.skew_ms),
        "straggler_rank": s.straggler_rank,
        "compute_straggler_rank": s.compute_straggler_rank,
        "step_ms": _clean(s.step_ms),
        "step_cv": _clean(s.step_cv),
        "wait_ms_min": _clean(s.wait_ms_min),
        "wait_ms_max": _clean(s.wait_ms_max),
        "delay_ms_max": _clean(s.delay_ms_max),
        "pacing_active": s.pacing_active,
        "buckets": s.buckets,
        "ranks": {
            "lead_ms": _cleans(s.lead_ms),
            "compute_ms": _cleans(s.compute_ms),
            "wait_ms": _cleans(s.wait_ms),
            "delay_ms": _cleans(s.delay_ms),
            "step_ms": _cleans(s.rank_step_ms),
            "data_ms": _cleans(s.data_ms),
            "gap_ms": _cleans(s.gap_ms),
        },
    }


def decision_line(d: Decision, after_step: int) -> dict[str, Any]:
    """The JSON object written for one controller decision."""
    return {
        "record": "decision",
        "window": d.window,
        "after_step": after_step,
        "state": d.state.value,
        "pacing_active": d.pacing_active,
        "delays_ms": list(d.delays_ms),
        "reason": d.reason,
        "baseline_step_ms": d.baseline_step_ms,
        "paced_step_ms": d.paced_step_ms,
    }


class RunRecordWriter:
    """Appends the run record as JSON lines; only rank 0 owns one.

    Nothing touches the disk until the first window (or :meth:`close`) is written: then the
    directory is made, the file is opened and the header goes first.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        world_size: int,
        config: Mapping[str, Any],
        topology: Sequence[Mapping[str, Any]],
        framework: str,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._closed = False
        self.steps_written = 0
        header = {
            "record": "header",
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "created_unix": time.time(),
            "framework": framework,
            "world_size": world_size,
            "config": dict(config),
            "topology": [dict(t) for t in topology],
        }
        if extra:
            header.update(extra)
        self._header: dict[str, Any] | None = header  #: written with the first lines

    @property
    def created(self) -> bool:
        """Whether the file exists: something was written to it."""
        return self._header is None

    def write_window(self, summaries: Iterable[StepSummary], decision: Decision | None) -> None:
        lines = [step_line(s) for s in summaries]
        self.steps_written += len(lines)
        if decision is not None:
            last = lines[-1]["step"] if lines else -1
            lines.append(decision_line(decision, last))
        self._write(lines)

    def close(
        self,
        status: str = "completed",
        error: str | None = None,
        extra: Mapping[str, Any] | None = None,
        *,
        create: bool = True,
    ) -> None:
        """Write the ``end`` line and close the file; idempotent.

        ``create=False``: a record that nothing was written to yet stays absent (no file, no
        directory) instead of getting a header and an ``end`` line.
        """
        if self._closed:
            return
        self._closed = True
        if not self.created and not create:
            return
        end = {"record": "end", "status": status, "error": error, "steps": self.steps_written}
        end.update(extra or {})
        self._write([end], closing=True)
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, objs: Iterable[Mapping[str, Any]], *, closing: bool = False) -> None:
        if self._closed and not closing:
            raise RuntimeError(f"run record {self.path} is already closed")
        if self._header is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
            objs = [self._header, *objs]
            self._header = None
        assert self._file is not None, "the file is open from the first write to close"
        self._file.write("".join(json.dumps(o, separators=(",", ":")) + "\n" for o in objs))
        self._file.flush()


@dataclass
class RunRecord:
    """A run record read back from disk."""

    path: Path
    header: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    truncated: bool = False  #: the last line was cut off (a crashed run); it was skipped

    @property
    def world_size(self) -> int:
        return int(self.header["world_size"])


def read_run_record(path: str | os.PathLike[str]) -> RunRecord:
    """Read a run record (a file, or a directory holding ``pace_run.jsonl``)."""
    p = Path(path)
    if p.is_dir():
        p = p / RECORD_FILENAME
    if not p.is_file():
        raise RunRecordError(
            f"no run record at {p}: expected the {RECORD_FILENAME} that paced training writes"
        )
    objs = iter_run_record(p)
    record = RunRecord(path=p, header=next(objs))
    for obj in objs:
        kind = obj.get("record")
        if kind == "step":
            record.steps.append(obj)
        elif kind == "decision":
            record.decisions.append(obj)
        elif kind == "end":
            record.end = obj
        elif kind == TRUNCATED:
            record.truncated = True
    return record


#: ``record`` value of the marker object that ``iter_run_record`` yields for a cut-off last line.
TRUNCATED = "truncated"


def iter_run_record(p: Path) -> Iterator[dict[str, Any]]:
    """The objects of run-record file ``p`` in order, the header first (checked against the schema).

    A cut-off last line (a crash mid-write; everything before it is intact) ends the iteration with
    ``{"record": "truncated"}``; any other unreadable line, a missing header or a newer schema
    version raises ``RunRecordError``.
    """
    with p.open(encoding="utf-8") as f:
        lines = f.readlines()
    if not lines:
        raise RunRecordError(f"run record {p} is empty")
    not_a_record = f"{p} is not a pace_strategy run record (no {SCHEMA!r} header on line 1)"
    header_seen = False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and header_seen:
                yield {"record": TRUNCATED}
                return
            if number == len(lines):
                raise RunRecordError(not_a_record) from error
            raise RunRecordError(f"run record {p} line {number} is not valid JSON: {error}") from error
        if not header_seen:
            if obj.get("record") != "header" or obj.get("schema") != SCHEMA:
                raise RunRecordError(not_a_record)
            if int(obj.get("version", -1)) > SCHEMA_VERSION:
                raise RunRecordError(
                    f"{p} has run-record schema version {obj['version']}; this pace_strategy reads up to "
                    f"{SCHEMA_VERSION}. Upgrade pace_strategy."
                )
            header_seen = True
        yield obj
    if not header_seen:
        raise RunRecordError(not_a_record)


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class RunSummary:
    """Headline numbers of a run (post-warm-up, valid steps)."""

    steps: int
    world_size: int
    skew_ms_p50: float
    skew_ms_p95: float
    straggler_rank: int
    straggler_share: float
    step_ms_median: float
    step_cv: float
    pacing_active_share: float
    delay_ms_max: float
    delay_ms_mean_when_active: float
    final_state: str
    final_reason: str

    def table(self) -> str:
        """A short plain-text table."""
        rows = [
            ("steps (post-warm-up)", f"{self.steps}"),
            ("ranks", f"{self.world_size}"),
            ("skew p50 / p95", f"{self.skew_ms_p50:.1f} ms / {self.skew_ms_p95:.1f} ms"),
            ("straggler", f"rank {self.straggler_rank} in {self.straggler_share:.0%} of steps"),
            ("step time median", f"{self.step_ms_median:.1f} ms"),
            ("step-time CV", f"{self.step_cv:.3f}"),
            ("pacing active", f"{self.pacing_active_share:.0%} of steps"),
            (
                "delays applied",
                f"max {self.delay_ms_max:.1f} ms, mean {self.delay_ms_mean_when_active:.1f} ms when active",
            ),
            ("controller", f"{self.final_state}: {self.final_reason}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def summarize(record: RunRecord) -> RunSummary:
    """Headline numbers of a run record."""
    steps = [s for s in record.steps if s["valid"] and not s["warmup"]]
    world = record.world_size
    skews = [s["skew_ms"] for s in steps if s["skew_ms"] is not None]
    counts = [0] * world
    for s in steps:
        counts[int(s["straggler_rank"])] += 1
    straggler = max(range(world), key=counts.__getitem__) if world else -1
    step_times = [s["step_ms"] for s in steps if s["step_ms"] is not None]
    cv = coefficient_of_variation(step_times)
    active = [s for s in steps if s["pacing_active"]]
    delays = [s["delay_ms_max"] for s in active]
    last = record.decisions[-1] if record.decisions else {"state": "monitor", "reason": "no decision yet"}
    return RunSummary(
        steps=len(steps),
        world_size=world,
        skew_ms_p50=_percentile(skews, 0.5),
        skew_ms_p95=_percentile(skews, 0.95),
        straggler_rank=straggler,
        straggler_share=counts[straggler] / len(steps) if steps else 0.0,
        step_ms_median=statistics.median(step_times) if step_times else float("nan"),
        step_cv=cv,
        pacing_active_share=len(active) / len(steps) if steps else 0.0,
        delay_ms_max=max(delays, default=0.0),
        delay_ms_mean_when_active=statistics.fmean(delays) if delays else 0.0,
        final_state=str(last["state"]),
        final_reason=str(last["reason"]),
    )
