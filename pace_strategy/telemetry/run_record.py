"""The run record: rank 0's full per-rank, per-step JSON-lines file for offline diagnosis.

Lines, in order: one ``header`` (schema, world size, config, topology), then ``step`` and ``decision``
lines as windows arrive (and a ``hang`` line where the hang watchdog named ranks, a ``shares`` line
where the rebalancing controller changed state or split), then one ``end`` line; a resumed run has
a ``resume`` line right after the header, a preempted one ``local_step`` lines before its ``end``.
Each window is flushed to disk, so a crash loses at most the window in flight; a reader tolerates a
truncated last line. The file (and its directory) is
created at the first write, not when the writer is built: a run that writes nothing leaves nothing.
Each kind of line is one typed class (:mod:`pace_strategy.telemetry.record_lines`): the writers build
them, and the reader's checks come from the same classes. See docs/telemetry.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from pace_strategy.core.glossary import coefficient_of_variation
from pace_strategy.core.records import Decision, Field, StepSummary
from pace_strategy.telemetry.columnar import COLUMNS_SCHEMA, COLUMNS_VERSION
from pace_strategy.telemetry.record_lines import (
    LINE_KINDS,
    DecisionLine,
    EndLine,
    HeaderLine,
    Line,
    LocalStepLine,
    RankColumns,
    SharesLine,
    StepLine,
    as_mapping,
    json_fields,
)

if TYPE_CHECKING:  # the reader (pace diagnose) does not import torch
    from pace_strategy.core.rebalance import RebalanceDecision
    from pace_strategy.telemetry.columnar import RankColumnsWriter

__all__ = [
    "RECORD_FILENAME",
    "SCHEMA",
    "SCHEMA_VERSION",
    "RunRecord",
    "RunRecordError",
    "RunRecordWriter",
    "RunSummary",
    "arrival_of",
    "attempt_number",
    "attempt_records",
    "hang_text",
    "iter_run_record",
    "read_run_record",
    "record_filename",
    "summarize",
]

SCHEMA = "pace_strategy/run-record"
#: 2: a DDP rank's arrival (the end of ``compute_ms``, the start of ``wait_ms``) is the end of its local
#: backward; 1: it was the step's first gradient (the rest of backward counted as waiting). The lines
#: are the same; version 1 records still read, and the diagnosis says which arrival a record has.
SCHEMA_VERSION = 2
RECORD_FILENAME = "pace_run.jsonl"


def record_filename(restart_count: int = 0) -> str:
    """The record's file name for an attempt of the job: ``pace_run.jsonl`` for the first,
    ``pace_run.restart{k}.jsonl`` after the k-th elastic restart (so that no attempt overwrites an
    earlier one's record in the same directory)."""
    return RECORD_FILENAME if restart_count <= 0 else f"pace_run.restart{restart_count}.jsonl"


_ATTEMPT = re.compile(r"pace_run(?:\.restart(\d+))?\.jsonl")


def attempt_number(name: str) -> int | None:
    """The restart count in a record's file name (:func:`record_filename`'s inverse), or ``None``."""
    match = _ATTEMPT.fullmatch(name)
    if match is None:
        return None
    return int(match.group(1) or 0)


def attempt_records(directory: str | os.PathLike[str]) -> list[Path]:
    """The records of a job's attempts in ``directory``, the first attempt first."""
    found = []
    for path in Path(directory).glob("pace_run*.jsonl"):
        number = attempt_number(path.name)
        if number is not None and path.is_file():
            found.append((number, path))
    return [path for _, path in sorted(found)]


class RunRecordError(ValueError):
    """A run record is missing, empty or unreadable."""


def _clean(value: float) -> float | None:
    # Microsecond resolution is plenty and keeps a 100k-step, 64-rank record to a few hundred MB.
    return round(value, 3) if math.isfinite(value) else None


def _cleans(values: Iterable[float]) -> list[float | None]:
    return [_clean(v) for v in values]


def step_line(s: StepSummary, with_ranks: bool = True) -> StepLine:
    """The line written for one step (the later per-rank columns only where the summary has them;
    none at all without ``with_ranks``: the columnar file holds them)."""
    return StepLine(
        step=s.step,
        valid=s.valid,
        warmup=s.warmup,
        skew_ms=_clean(s.skew_ms),
        straggler_rank=s.straggler_rank,
        compute_straggler_rank=s.compute_straggler_rank,
        step_ms=_clean(s.step_ms),
        step_cv=_clean(s.step_cv),
        wait_ms_min=_clean(s.wait_ms_min),
        wait_ms_max=_clean(s.wait_ms_max),
        delay_ms_max=_clean(s.delay_ms_max),
        pacing_active=s.pacing_active,
        buckets=s.buckets,
        ranks=RankColumns(
            lead_ms=_cleans(s.lead_ms),
            compute_ms=_cleans(s.compute_ms),
            wait_ms=_cleans(s.wait_ms),
            delay_ms=_cleans(s.delay_ms),
            step_ms=_cleans(s.rank_step_ms),
            data_ms=_cleans(s.data_ms),
            gap_ms=_cleans(s.gap_ms),
            gc_ms=_cleans(s.gc_ms) or None,
            gc_collections=list(s.gc_collections) or None,
            samples=list(s.samples) or None,
            opt_ms=_cleans(s.opt_ms) or None,
            # sparse: only where some rank's device was still behind its host (never on CPU); a
            # step without the column had every rank host-bound
            host_bound=list(s.host_bound) if s.host_bound and not all(s.host_bound) else None,
            # only where some rank reported its tokens (an adapter that sees them, or the loop)
            tokens=list(s.tokens) if any(s.tokens) else None,
        )
        if with_ranks
        else None,
    )


#: the exchanged row's columns that a ``local_step`` line names (every column but the three below)
_LOCAL_COLUMNS = tuple(f for f in Field if f not in (Field.STEP, Field.VALID, Field.WARMUP))


def local_step_line(rank: int, row: Sequence[float]) -> LocalStepLine:
    """The line for one step that only ``rank`` measured: the run ended (preempted) before the step
    was exchanged, so the other ranks' numbers are not known. Columns as the ``ranks`` lists of a
    ``step`` line, named after :class:`~pace_strategy.core.records.Field`."""
    columns = {f.name.lower(): _clean(row[f]) for f in _LOCAL_COLUMNS}
    return LocalStepLine(
        rank=rank,
        step=int(row[Field.STEP]),
        valid=bool(row[Field.VALID]),
        warmup=bool(row[Field.WARMUP]),
        step_ms=columns.pop("step_ms"),
        columns=columns,
    )


def decision_line(d: Decision, after_step: int) -> DecisionLine:
    """The line written for one controller decision (``gc_collect`` only when gc_sync decided one)."""
    return DecisionLine(
        window=d.window,
        after_step=after_step,
        state=d.state.value,
        pacing_active=d.pacing_active,
        delays_ms=list(d.delays_ms),
        reason=d.reason,
        baseline_step_ms=d.baseline_step_ms,
        paced_step_ms=d.paced_step_ms,
        gc_collect=None
        if d.gc_collect is None
        else {"after_step": d.gc_collect.after_step, "due": [round(v, 3) for v in d.gc_collect.due]},
    )


def shares_line(d: RebalanceDecision, after_step: int) -> SharesLine:
    """The line written when the rebalancing controller changes state or split: ``samples`` is the
    split (per-rank samples per step) in effect or, with ``from_step``, scheduled from that step."""
    return SharesLine(
        window=d.window,
        after_step=after_step,
        state=d.state.value,
        samples=list(d.shares),
        from_step=d.from_step,
        reason=d.reason,
        baseline_step_ms=d.baseline_step_ms,
        trial_step_ms=d.trial_step_ms,
        per_sample_ms=_cleans(d.per_sample_ms),
        balanced=d.balanced,
        balance=d.balance,
        cost=None if d.cost is None else list(d.cost),
    )


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
        rank_columns: RankColumnsWriter | None = None,
        shards: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.path = Path(path)
        #: ``record_format: arrow``: where each step's per-rank columns go instead of its step line
        self.rank_columns = rank_columns
        #: the node leaders write them (``exchange_topology: node_leaders``): ``{"file", "ranks"}`` each
        self.shards = [dict(s) for s in shards] if shards else None
        extra = dict(extra or {})
        described = {"schema": COLUMNS_SCHEMA, "version": COLUMNS_VERSION}
        if rank_columns is not None:
            extra["rank_columns"] = {"file": rank_columns.path.name, **described}
        elif self.shards is not None:
            extra["rank_columns"] = {"shards": self.shards, **described}
        # The hang watchdog writes from its own thread while the telemetry thread may write a window.
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._closed = False
        self.steps_written = 0
        self.local_steps_written = 0  #: ``local_step`` lines (a preempted run's unexchanged steps)
        #: lines that go right after the header (a resumed run's ``resume`` line), however late they come
        self._after_header: list[Line | Mapping[str, Any]] = []
        #: written with the first lines
        self._header: HeaderLine | None = HeaderLine(
            schema=SCHEMA,
            version=SCHEMA_VERSION,
            created_unix=time.time(),
            framework=framework,
            world_size=world_size,
            config=dict(config),
            topology=[dict(t) for t in topology],
            extra=dict(extra or {}),
        )

    def update_topology(self, topology: Sequence[Mapping[str, Any]]) -> None:
        """Replace the header's placements (only before the file is created: a header once written
        is not rewritten)."""
        if self._header is not None:
            self._header.topology = [dict(t) for t in topology]

    @property
    def created(self) -> bool:
        """Whether the file exists: something was written to it."""
        return self._header is None

    def write_window(
        self,
        summaries: Iterable[StepSummary],
        decision: Decision | None,
        rebalance: RebalanceDecision | None = None,
        gathered: Any = None,
    ) -> None:
        """Append a window's step lines, its decision line and, when the rebalancing controller changed
        state or split, a ``shares`` line. ``gathered``: the window the summaries were made of (a
        columnar record's rows are taken from it, not from the summaries' per-rank tuples)."""
        summaries = list(summaries)
        if self.rank_columns is not None:
            # the columns first: a step line is never on disk without its ranks' rows
            if gathered is not None:
                self.rank_columns.write_gathered(gathered)
            else:
                self.rank_columns.write(summaries)
        with_ranks = self.rank_columns is None and self.shards is None
        steps = [step_line(s, with_ranks=with_ranks) for s in summaries]
        self.steps_written += len(steps)
        last = steps[-1].step if steps else -1
        lines: list[Line] = list(steps)
        if decision is not None:
            lines.append(decision_line(decision, last))
        if rebalance is not None and rebalance.changed:
            lines.append(shares_line(rebalance, last))
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
        end = EndLine(
            status=status,
            steps=self.steps_written,
            error=error,
            local_steps=self.local_steps_written or None,
            extra=dict(extra or {}),
        )
        self._write([end], closing=True)
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        if self.rank_columns is not None:
            self.rank_columns.close()

    def add_after_header(self, obj: Line | Mapping[str, Any]) -> None:
        """A line that belongs right after the header (the ``resume`` line): kept, and serialized at
        the first write, until the file exists (so a run that writes nothing still leaves nothing);
        appended at once after that."""
        with self._lock:
            if self._header is not None:
                self._after_header.append(obj)
                return
        self.write_line(obj)

    def write_local_steps(self, rank: int, rows: Iterable[Sequence[float]]) -> None:
        """Append one ``local_step`` line per row (steps ``rank`` measured but never exchanged)."""
        lines: list[Line] = [local_step_line(rank, row) for row in rows]
        self.local_steps_written += len(lines)
        self._write(lines)

    def write_line(self, obj: Line | Mapping[str, Any]) -> None:
        """Append one line of another kind (a ``hang`` line); ignored once the record is closed."""
        with self._lock:
            if not self._closed:
                self._write_locked([obj], closing=False)

    def _write(self, objs: Iterable[Line | Mapping[str, Any]], *, closing: bool = False) -> None:
        with self._lock:
            self._write_locked(objs, closing=closing)

    def _write_locked(self, objs: Iterable[Line | Mapping[str, Any]], *, closing: bool) -> None:
        if self._closed and not closing:
            raise RuntimeError(f"run record {self.path} is already closed")
        if self._header is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
            objs = [self._header, *self._after_header, *objs]
            self._header = None
            self._after_header = []
        assert self._file is not None, "the file is open from the first write to close"
        # serialized now, not when handed over: a resume line is filled in place until it is written
        self._file.write("".join(json.dumps(as_mapping(o), separators=(",", ":")) + "\n" for o in objs))
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
    hangs: list[dict[str, Any]] = field(default_factory=list)  #: the hang watchdog's verdicts
    #: a resumed run's ``resume`` line (the step it resumed at, what was restored, from where)
    resume: dict[str, Any] | None = None
    #: ``local_step`` lines: steps rank 0 measured alone before a preemption, never exchanged
    local_steps: list[dict[str, Any]] = field(default_factory=list)
    #: ``shares`` lines: every change of the rebalancing controller's state or split
    shares: list[dict[str, Any]] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return int(self.header["world_size"])

    @property
    def restart_count(self) -> int:
        """Elastic restarts before the attempt that wrote this record (0: the first attempt)."""
        return int(self.header.get("restart_count", 0))

    @property
    def version(self) -> int:
        """The record's schema version (``SCHEMA_VERSION`` when this pace_strategy wrote it)."""
        return int(self.header.get("version", 1))

    @property
    def arrival(self) -> str:
        """What a DDP rank's arrival is in this record (:func:`arrival_of`)."""
        return arrival_of(self.header)


def arrival_of(header: Mapping[str, Any]) -> str:
    """What a DDP rank's arrival is in a record with this header: ``"end_of_backward"`` (schema 2 and
    later) or ``"first_gradient"`` (schema 1: the rest of its backward is in ``wait_ms``)."""
    return "end_of_backward" if int(header.get("version", 1)) >= 2 else "first_gradient"


def read_run_record(path: str | os.PathLike[str]) -> RunRecord:
    """Read a run record (a file, or a directory holding ``pace_run.jsonl``; of a directory holding
    several attempts of a restarted job, the latest attempt's)."""
    p = Path(path)
    if p.is_dir():
        attempts = attempt_records(p)
        p = attempts[-1] if attempts else p / RECORD_FILENAME
    if not p.is_file():
        raise RunRecordError(
            f"no run record at {p}: expected the {RECORD_FILENAME} that paced training writes"
        )
    objs = iter_run_record(p)
    record = RunRecord(path=p, header=next(objs))
    columns = rank_columns_of(record.header)
    for obj in objs:
        kind = obj.get("record")
        if kind == "step":
            record.steps.append(obj)
        elif kind == "decision":
            record.decisions.append(obj)
        elif kind == "hang":
            record.hangs.append(obj)
        elif kind == "resume":
            record.resume = obj
        elif kind == "local_step":
            record.local_steps.append(obj)
        elif kind == "shares":
            record.shares.append(obj)
        elif kind == "end":
            record.end = obj
        elif kind == TRUNCATED:
            record.truncated = True
    if columns is not None:
        _attach_ranks(record, p.parent, columns)
    return record


def rank_columns_of(header: Mapping[str, Any]) -> list[tuple[str, list[int]]] | None:
    """The record's columnar per-rank files (``record_format: arrow``) with the ranks each holds
    (one file of every rank, or each node leader's shard), or ``None`` when its step lines carry
    their ``ranks`` themselves."""
    columns = header.get("rank_columns")
    if not isinstance(columns, Mapping):
        return None
    name = columns.get("file")
    if isinstance(name, str) and name:
        return [(name, list(range(int(header["world_size"]))))]
    shards = columns.get("shards")
    if isinstance(shards, list) and shards:
        return [(str(s["file"]), [int(r) for r in s["ranks"]]) for s in shards]
    return None


def _attach_ranks(record: RunRecord, directory: Path, shards: list[tuple[str, list[int]]]) -> None:
    """Give each step line its ``ranks`` lists back from the columnar file (what every reader of
    :class:`RunRecord` expects). Steps whose rows were never written (a crash between the two files)
    are dropped, and the record reads as truncated."""
    from pace_strategy.telemetry.columnar import RankColumnsError, read_shards

    path = directory / shards[0][0]
    try:
        columns, labels, cut = read_shards(directory, shards, record.world_size)
    except RankColumnsError as error:
        raise RunRecordError(str(error)) from error
    if len(labels) < len(record.steps):
        record.steps = record.steps[: len(labels)]
        cut = True
    record.truncated = record.truncated or cut
    for i, step in enumerate(record.steps):
        if labels[i] != step["step"]:
            raise RunRecordError(
                f"{path} row block {i} is step {labels[i]} but the record's step line {i} is step "
                f"{step['step']}: the two files are not of one run"
            )
        ranks: dict[str, list[Any]] = {}
        for name, values in columns.items():
            row = values[i]
            if np.isnan(row).all() and name in _OPTIONAL_RANK_FIELDS:
                continue  # not recorded in this step
            if name == "tokens" and not np.nan_to_num(row).any():
                continue  # written only where some rank reported its tokens, as in the JSON lines
            if name == "host_bound":
                if row.all():
                    continue  # written only where some rank was not host-bound, as in the JSON lines
                ranks[name] = [int(v) for v in row]
            elif name in ("gc_collections", "samples", "tokens"):
                ranks[name] = [int(v) for v in row]
            else:
                ranks[name] = [None if math.isnan(v) else float(v) for v in row]
        step["ranks"] = ranks


#: ``record`` value of the marker object that ``iter_run_record`` yields for a cut-off last line.
TRUNCATED = "truncated"


def iter_run_record(p: Path) -> Iterator[dict[str, Any]]:
    """The objects of run-record file ``p`` in order, the header first (checked against the schema).

    A cut-off last line (a crash mid-write; everything before it is intact) ends the iteration with
    ``{"record": "truncated"}``. Any other unreadable line, a missing header, a newer schema version
    or a known line (``header``, ``step``, ``decision``, ``hang``, ``resume``, ``local_step``, ``end``)
    without a field that readers use,
    or with a value of the wrong type, raises ``RunRecordError`` naming the line and the field. Lines
    of other kinds are passed through unchecked (what a later writer may add).
    """
    with p.open("rb") as f:
        # one line at a time (memory bounded by a line, not the file), one line ahead: a cut-off
        # line is only forgiven when it is the last
        lines = iter(f)
        line = next(lines, None)
        if line is None:
            raise RunRecordError(f"run record {p} is empty")
        header_seen = False
        world_size = 0
        columnar = False  # the header names a columnar file: step lines carry no ``ranks``
        number = 0
        while line is not None:
            number += 1
            following = next(lines, None)
            obj = _parse_line(p, number, line, last=following is None, header_seen=header_seen)
            line = following
            if obj is None:
                continue
            if obj == {"record": TRUNCATED}:
                yield obj
                return
            if not header_seen:
                world_size = _check_header(p, number, obj)
                columnar = rank_columns_of(obj) is not None
                header_seen = True
            else:
                _check_line(p, number, obj, world_size, columnar)
            yield obj
    if not header_seen:
        raise RunRecordError(_not_a_record(p, number))


def _parse_line(p: Path, number: int, line: bytes, *, last: bool, header_seen: bool) -> Any:
    """One line's object; ``None`` for a blank line; ``{"record": "truncated"}`` for a cut-off last
    line after the header. Raises ``RunRecordError`` for any other line that is not JSON."""
    if not line.strip():
        return None
    try:
        obj: Any = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError) as error:  # JSON or UTF-8; RecursionError: absurd nesting
        if last and header_seen:
            return {"record": TRUNCATED}
        where = f"run record {p} line {number} is not valid JSON: {error}"
        if not header_seen:
            raise RunRecordError(f"{_not_a_record(p, number)}: {where}") from error
        raise RunRecordError(where) from error
    return obj


def _not_a_record(p: Path, number: int) -> str:
    where = "line 1" if number == 1 else f"lines 1-{number}"
    return f"{p} is not a pace_strategy run record (no {SCHEMA!r} header on {where})"


_INT = (int,)
_BOOL = (bool,)
_STR = (str,)
_NUMBER = (int, float, type(None))  #: a duration; null where it was not finite
_NUMBERS = frozenset(_NUMBER)
_FLOAT_MAX = sys.float_info.max


def _are_numbers(values: Sequence[Any]) -> bool:
    """Whether every value is a JSON number that fits a float, or null."""
    kinds = set(map(type, values))
    # an integer beyond the float range (a hand-edited line) would overflow every statistic
    return kinds <= _NUMBERS and (
        int not in kinds or all(abs(v) <= _FLOAT_MAX for v in values if type(v) is int)
    )


#: per kind of line (but the header, checked apart): the fields every line must have and the ones a
#: later version added (checked where present), with their JSON types, from the line classes
_FIELDS = {kind: json_fields(cls) for kind, cls in LINE_KINDS.items() if kind != "header"}
_REQUIRED_RANK, _ADDED_RANK = json_fields(RankColumns)
_RANK_FIELDS = tuple(_REQUIRED_RANK)
#: per-rank step fields added in later versions: checked when present (older records lack them)
_OPTIONAL_RANK_FIELDS = tuple(_ADDED_RANK)
_TYPE_WORDS = {int: "an integer", bool: "true or false", str: "a string", dict: "an object", list: "a list"}


def _bad_line(p: Path, number: int, problem: str) -> RunRecordError:
    return RunRecordError(
        f"run record {p} line {number}: {problem}; the line is not what pace_strategy writes "
        f"(schema {SCHEMA!r} version {SCHEMA_VERSION}): fix or delete the line"
    )


def _check_fields(
    p: Path,
    number: int,
    obj: dict[str, Any],
    fields: tuple[Mapping[str, tuple[type, ...]], Mapping[str, tuple[type, ...]]],
) -> None:
    required, added = fields
    for key, types in (*required.items(), *((k, t) for k, t in added.items() if k in obj)):
        if key not in obj:
            raise _bad_line(p, number, f"{obj['record']} has no {key!r} field")
        # exact types: JSON gives only these, and a bool is not a count
        number_ = float in types
        if type(obj[key]) not in types or (number_ and not _are_numbers((obj[key],))):
            expected = (
                ("a number or null" if type(None) in types else "a number")
                if number_
                else " or ".join(_TYPE_WORDS.get(t, "null") for t in types)
            )
            raise _bad_line(p, number, f"{obj['record']} field {key!r}={obj[key]!r} is not {expected}")


def _check_header(p: Path, number: int, obj: Any) -> int:
    """The world size of header ``obj`` (line ``number``), once it is checked."""
    if not isinstance(obj, dict) or obj.get("record") != "header" or obj.get("schema") != SCHEMA:
        raise RunRecordError(_not_a_record(p, number))
    version = obj.get("version")
    if type(version) is not int:
        raise _bad_line(p, number, f"header field 'version'={version!r} is not an integer")
    if version > SCHEMA_VERSION:
        raise RunRecordError(
            f"{p} has run-record schema version {version}; this pace_strategy reads up to "
            f"{SCHEMA_VERSION}. Upgrade pace_strategy."
        )
    world = obj.get("world_size")
    if type(world) is not int or world < 1:
        raise _bad_line(p, number, f"header field 'world_size'={world!r} is not an integer >= 1")
    for key, kind in (("config", dict), ("topology", list), ("rank_columns", dict)):
        if key in obj and type(obj[key]) is not kind:
            raise _bad_line(p, number, f"header field {key!r} is not {_TYPE_WORDS[kind]}")
    restarts = obj.get("restart_count", 0)
    if type(restarts) is not int or restarts < 0:
        raise _bad_line(p, number, f"header field 'restart_count'={restarts!r} is not an integer >= 0")
    for entry in obj.get("topology", []):
        if type(entry) is not dict or type(entry.get("rank")) is not int:
            raise _bad_line(p, number, f"header 'topology' entry {entry!r} is not an object with a 'rank'")
    return world


def _check_line(p: Path, number: int, obj: Any, world_size: int, columnar: bool = False) -> None:
    if not isinstance(obj, dict) or type(obj.get("record")) is not str:
        raise _bad_line(p, number, "not a JSON object with a 'record' field")
    kind = obj["record"]
    if kind == "header":
        raise _bad_line(p, number, "a second header (two run records in one file?)")
    fields = _FIELDS.get(kind)
    if fields is None:
        return
    _check_fields(p, number, obj, fields)
    if kind == "decision" and not _are_numbers(obj["delays_ms"]):
        raise _bad_line(p, number, "decision field 'delays_ms' is not a list of numbers")
    if kind == "shares" and (
        len(obj["samples"]) != world_size or not all(type(n) is int and n > 0 for n in obj["samples"])
    ):
        raise _bad_line(
            p, number, f"shares field 'samples' is not a list of {world_size} positive sample counts"
        )
    if kind == "resume" and not all(type(name) is str for name in obj["restored"]):
        raise _bad_line(p, number, f"resume field 'restored'={obj['restored']!r} is not a list of names")
    if kind == "local_step" and not 0 <= obj["rank"] < world_size:
        raise _bad_line(p, number, f"local_step field 'rank'={obj['rank']} is not a rank of the {world_size}")
    if kind == "hang" and not all(type(r) is int and 0 <= r < world_size for r in obj["ranks"]):
        raise _bad_line(
            p, number, f"hang field 'ranks'={obj['ranks']!r} is not a list of ranks of the {world_size}"
        )
    if kind != "step":
        return
    for key in ("straggler_rank", "compute_straggler_rank"):
        if not 0 <= obj[key] < world_size:
            raise _bad_line(p, number, f"step field {key!r}={obj[key]} is not a rank of the {world_size}")
    ranks = obj.get("ranks")
    if ranks is None:
        if columnar:
            return
        raise _bad_line(p, number, "step has no 'ranks' field")
    for key in _RANK_FIELDS + tuple(k for k in _OPTIONAL_RANK_FIELDS if k in ranks):
        values = ranks.get(key)
        if type(values) is not list or len(values) != world_size or not _are_numbers(values):
            raise _bad_line(
                p, number, f"step field 'ranks.{key}' is not a list of {world_size} numbers (one per rank)"
            )


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
    hangs: tuple[str, ...] = ()  #: one :func:`hang_text` per ``hang`` line
    restart_count: int = 0  #: elastic restarts before this attempt

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
        rows += [("hang", text) for text in self.hangs]
        if self.restart_count:
            rows.append(("elastic restart", f"attempt {self.restart_count + 1} of the job"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def hang_text(line: Mapping[str, Any]) -> str:
    """A ``hang`` line in words: ``rank 2 (host h) had not reached step 8 after 20 s``."""
    ranks, hosts = list(line["ranks"]), list(line["hosts"])
    if not ranks:
        return f"step {line['step']} stood still on every rank"
    named = ", ".join(
        f"rank {r} (host {hosts[i]})" if i < len(hosts) else f"rank {r}" for i, r in enumerate(ranks)
    )
    waited = line["waited_s"]
    after = f" after {waited:.0f} s" if isinstance(waited, (int, float)) else ""
    return f"{named} had not reached step {line['step']}{after} (the other ranks were waiting for it)"


def summarize(record: RunRecord) -> RunSummary:
    """Headline numbers of a run record."""
    steps = [s for s in record.steps if s["valid"] and not s["warmup"]]
    world = record.world_size
    skews = [s["skew_ms"] for s in steps if s["skew_ms"] is not None]
    # counted over the steps, not the ranks: the header's world size is whatever the file says
    counts = Counter(int(s["straggler_rank"]) for s in steps)
    straggler = min(counts, key=lambda r: (-counts[r], r)) if counts else (0 if world else -1)
    step_times = [s["step_ms"] for s in steps if s["step_ms"] is not None]
    cv = coefficient_of_variation(step_times)
    active = [s for s in steps if s["pacing_active"]]
    delays = [s["delay_ms_max"] for s in active if s["delay_ms_max"] is not None]
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
        hangs=tuple(hang_text(h) for h in record.hangs),
        restart_count=record.restart_count,
    )
