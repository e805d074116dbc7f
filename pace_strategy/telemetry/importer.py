"""``pace import table|ops FILE OUT_DIR``: timings recorded elsewhere become a run record, so that
``pace diagnose``, its report and ``pace simulate --from-run`` read them unchanged.

A **step table** (CSV, or Parquet with pyarrow) has one row per rank and step: the columns ``rank``,
``step`` and at least one of ``compute_ms``, ``wait_ms``, ``step_ms``; optionally ``data_ms``,
``samples``, ``tokens``, ``host`` and the rank's mesh coordinates (``dp_replicate``, ``dp_shard``,
``dp``, ``tp``, ``pp``, ``cp``). Where the waits are not recorded they follow from the synchronous
model: every rank starts the step together, the collective completes once the last rank has arrived,
so a rank waits for the slowest rank's compute minus its own, plus the collective's time
(``step_ms`` minus the slowest compute where both are given, else 0). The record's header says which
(``imported.waits``), and the diagnosis repeats it. A rank's own ``step_ms`` alone (a worker's
iteration time with no waits in it) is its compute.

An **op table** has one row per op: ``rank``, ``step``, ``op``, ``start_ms``, ``duration_ms`` and the
placement columns; :data:`OPS` says what each op counts as (:func:`read_ops`).

Bad input fails before anything is written, naming the file, the row (CSV: the line) and the column;
the record is written into a temporary directory beside ``OUT_DIR`` and renamed, so it appears whole or
not at all. The table is held in memory while it is read (about 100 bytes per row).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import difflib
import gzip
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pace_strategy.core.records import StepSummary
from pace_strategy.telemetry.columnar import RankColumnsWriter, rank_columns_filename
from pace_strategy.telemetry.run_record import RECORD_FILENAME, RunRecordWriter
from pace_strategy.telemetry.topology import MESH_KEYS

__all__ = [
    "OPS",
    "OP_COLUMNS",
    "TABLE_COLUMNS",
    "TableImportError",
    "import_ops",
    "import_table",
    "import_traces",
    "main",
]

#: numeric per-rank, per-step columns (ms unless named otherwise)
_TIMES = ("compute_ms", "wait_ms", "step_ms", "data_ms")
#: per-rank placement columns: the same value in every step of a rank
PLACEMENT = ("host", *MESH_KEYS)
#: every column a table may have
TABLE_COLUMNS = ("rank", "step", *_TIMES, "samples", "tokens", *PLACEMENT)
#: steps a window of the written record holds (the default exchange's)
_WINDOW_STEPS = 32
#: steps over which ``step_cv`` is taken, as the live summarizer's rolling window
_CV_STEPS = 32


class TableImportError(ValueError):
    """A table cannot be imported: the message names the file, the row and column, and the fix."""


@dataclass
class _Table:
    """The table's values as ``[steps, ranks]`` arrays (NaN: the column is absent)."""

    steps: np.ndarray  #: the step numbers, ascending
    values: dict[str, np.ndarray]
    placement: list[dict[str, Any]]  #: per rank


def _check_columns(path: Path, names: Sequence[str], allowed: Sequence[str], kind: str) -> None:
    for name in names:
        if name not in allowed:
            near = difflib.get_close_matches(name, allowed, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise TableImportError(
                f"{path}: unknown column {name!r}.{hint} Columns {kind} may have: {', '.join(allowed)}."
            )


def _require(path: Path, names: Sequence[str], required: Sequence[str]) -> None:
    missing = [c for c in required if c not in names]
    if missing:
        raise TableImportError(f"{path}: the table has no {' or '.join(map(repr, missing))} column")


def _number(
    path: Path, where: str, column: str, value: Any, *, integer: bool = False, signed: bool = False
) -> float:
    if value in ("", None):
        raise TableImportError(f"{path}: {where}: column {column!r} is empty (every row needs a value)")
    if isinstance(value, str):
        try:
            x = float(value)
        except ValueError:
            x = math.nan
    else:
        x = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    bad = not math.isfinite(x) or (integer and x != int(x)) or (x < 0 and not signed)
    if bad:
        kind = "a whole number >= 0" if integer else "a finite number" + ("" if signed else " >= 0 (ms)")
        raise TableImportError(f"{path}: {where}: column {column!r}: expected {kind}, got {value!r}")
    return x


#: rows read, checked and converted at a time
_CHUNK_ROWS = 65_536


@dataclass
class _Chunk:
    """Consecutive rows of a table: each column's raw values (an object array) and where each row is
    (for an error: ``line N`` of a CSV file, ``row N`` of a Parquet file counting data rows from 1)."""

    columns: dict[str, np.ndarray]
    kind: str  #: "line" or "row"
    numbers: list[int]  #: each row's line or row number

    def where(self, i: int) -> str:
        return f"{self.kind} {self.numbers[i]}"

    def __len__(self) -> int:
        return len(self.numbers)


def _chunks(path: Path) -> tuple[list[str], Iterator[_Chunk]]:
    """The table's column names and its rows, :data:`_CHUNK_ROWS` at a time."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise TableImportError(
                f"{path}: reading Parquet needs pyarrow: pip install 'pace-strategy[arrow]', or export the "
                "table as CSV"
            ) from e
        table = pq.ParquetFile(path)
        names = list(table.schema_arrow.names)

        def parquet_chunks() -> Iterator[_Chunk]:
            n = 0
            for batch in table.iter_batches(batch_size=_CHUNK_ROWS):
                # numbers stay numeric arrays (a null is NaN), text an object array
                columns = {name: batch.column(name).to_numpy(zero_copy_only=False) for name in names}
                yield _Chunk(columns, "row", list(range(n + 1, n + batch.num_rows + 1)))
                n += batch.num_rows

        return names, parquet_chunks()
    if suffix not in (".csv", ".tsv", ".txt"):
        raise TableImportError(f"{path}: expected a .csv or .parquet file (got {suffix or 'no suffix'!r})")
    f = path.open(newline="")
    try:
        reader = csv.reader(f, delimiter="\t" if suffix == ".tsv" else ",")
        names = [n.strip() for n in next(reader, [])]
    except (csv.Error, UnicodeDecodeError) as e:
        f.close()
        raise TableImportError(f"{path}: not a readable CSV table ({e})") from e

    def csv_chunks() -> Iterator[_Chunk]:
        with f:
            rows: list[list[str]] = []
            numbers: list[int] = []
            for values in reader:
                if not values or all(not v.strip() for v in values):
                    continue
                if len(values) != len(names):
                    raise TableImportError(
                        f"{path}: line {reader.line_num}: {len(values)} fields for {len(names)} columns "
                        f"({', '.join(names)})"
                    )
                rows.append(values)
                numbers.append(reader.line_num)
                if len(rows) == _CHUNK_ROWS:
                    yield _csv_chunk(names, rows, numbers)
                    rows, numbers = [], []
            if rows:
                yield _csv_chunk(names, rows, numbers)

    return names, csv_chunks()


def _csv_chunk(names: list[str], rows: list[list[str]], numbers: list[int]) -> _Chunk:
    cells = np.empty((len(rows), len(names)), dtype=object)
    cells[:] = rows
    columns = {name: np.char.strip(cells[:, i].astype(str)).astype(object) for i, name in enumerate(names)}
    return _Chunk(columns, "line", numbers)


def _numbers(
    path: Path, chunk: _Chunk, column: str, *, integer: bool = False, signed: bool = False
) -> np.ndarray:
    """A chunk's column as float64, checked as :func:`_number` checks one value (its error names the
    first bad row)."""
    raw = chunk.columns[column]
    try:
        x = raw.astype(np.float64)
    except (ValueError, TypeError):
        x = None
    if x is not None:
        bad = ~np.isfinite(x)
        if not signed:
            bad |= x < 0
        if integer:
            bad |= x != np.round(x)
        if not bad.any():
            return x
    for i, value in enumerate(raw):  # the first bad value raises with its row
        _number(path, chunk.where(i), column, value, integer=integer, signed=signed)
    raise AssertionError("unreachable: a bad value was found above")


class _Rows:
    """Every row's rank and step and the numeric columns asked for, gathered chunk by chunk as arrays,
    each rank's placement checked the same in every row; :meth:`grid` puts them on ``[steps, ranks]``."""

    def __init__(self, path: Path, places: Sequence[str]) -> None:
        self.path, self.places = path, list(places)
        self.parts: dict[str, list[np.ndarray]] = {}
        self.placement: dict[int, dict[str, Any]] = {}
        self.first_row: dict[int, str] = {}
        #: per placement column, each known rank's raw value as text (index: rank)
        self.known: dict[str, np.ndarray] = {c: np.empty(0, dtype=object) for c in self.places}

    def add(self, chunk: _Chunk, values: dict[str, np.ndarray]) -> np.ndarray:
        """The chunk's ranks and steps, checked, and ``values`` (its other columns, converted) kept;
        returns the ranks."""
        p = self.path
        rank = _numbers(p, chunk, "rank", integer=True).astype(np.int32)
        step = _numbers(p, chunk, "step", integer=True).astype(np.int64)
        self._check_placement(chunk, rank)
        columns: dict[str, np.ndarray] = {"rank": rank, "step": step, **values}
        for name, x in columns.items():
            self.parts.setdefault(name, []).append(x)
        return rank

    def _check_placement(self, chunk: _Chunk, rank: np.ndarray) -> None:
        if not self.places:
            for i in np.unique(rank, return_index=True)[1]:
                self._first(chunk, int(rank[i]), int(i))
            return
        size = int(rank.max()) + 1
        for c in self.places:
            known = self.known[c]
            if len(known) < size:
                known = np.concatenate([known, np.full(size - len(known), None, dtype=object)])
            text = chunk.columns[c].astype(str)
            for i in np.unique(rank, return_index=True)[1]:  # ranks seen for the first time
                r = int(rank[i])
                if known[r] is None:
                    known[r] = text[i]
                    self._first(chunk, r, int(i))
            self.known[c] = known
            mismatch = np.flatnonzero(text != known[rank])
            if len(mismatch):
                i = int(mismatch[0])
                r = int(rank[i])
                raise TableImportError(
                    f"{self.path}: {chunk.where(i)}: column {c!r}: rank {r} is "
                    f"{_placement_value(chunk.columns[c][i])!r} here and {self.placement[r][c]!r} at "
                    f"{self.first_row[r]}: a rank's placement is the same in every step"
                )

    def _first(self, chunk: _Chunk, r: int, i: int) -> None:
        if r not in self.placement:
            self.placement[r] = {c: _placement_value(chunk.columns[c][i]) for c in self.places}
            self.first_row[r] = chunk.where(i)

    def column(self, name: str) -> np.ndarray:
        """Every row's ``name``, once: its chunks are let go as they are joined (at 100M rows each
        column is 0.4-0.8 GB, and a second copy of every one would hold them twice)."""
        parts = self.parts.pop(name, [])
        return np.concatenate(parts) if parts else np.zeros(0)

    def grid(self) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
        """The steps (ascending), the world size, each row's cell (``step index * W + rank``) and how
        many rows each cell has; every rank 0..W-1 must have a row."""
        p = self.path
        if not self.placement:
            raise TableImportError(f"{p}: the table has no rows")
        world = max(self.placement) + 1
        if len(self.placement) != world:
            gap = next(r for r in range(world) if r not in self.placement)
            raise TableImportError(
                f"{p}: column 'rank': ranks must be 0..{world - 1} with none missing; rank {gap} has no row"
            )
        steps, cell = _step_index(self.column("step"))
        cell *= world
        cell += self.column("rank")
        counts = np.bincount(cell, minlength=len(steps) * world)
        empty = np.flatnonzero(counts == 0)
        if len(empty):
            s = int(steps[empty[0] // world])
            absent = [int(c % world) for c in empty[empty // world == empty[0] // world]]
            raise TableImportError(
                f"{p}: step {s} has no row for rank{'s' if len(absent) > 1 else ''} "
                f"{', '.join(map(str, absent[:8]))}{' ...' if len(absent) > 8 else ''}: every step needs "
                "every rank (drop the step from the table, or fill it)"
            )
        return steps, world, cell, counts


def _step_index(step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct steps (ascending) and each row's index among them, computed in place of ``step``.
    Step labels are nearly contiguous in practice: a table of present labels then takes the place of
    a sort (which held three more copies of the column: 2.4 GB at 100M rows)."""
    lo, hi = int(step.min()), int(step.max())
    if hi - lo + 1 > 4 * len(step):  # sparse labels: sort
        steps, index = np.unique(step, return_inverse=True)
        return steps, index.astype(np.int64)
    step -= lo
    present = np.zeros(hi - lo + 1, dtype=bool)
    present[step] = True
    place = np.cumsum(present) - 1
    steps = np.flatnonzero(present) + lo
    np.take(place, step, out=step)
    return steps, step


def read_table(path: str | os.PathLike[str]) -> _Table:
    """The step table at ``path``, checked (:class:`TableImportError` on the first bad row), read a
    chunk of rows at a time into arrays."""
    p = _existing(path)
    names, chunks = _chunks(p)
    _check_columns(p, names, TABLE_COLUMNS, "a step table")
    _require(p, names, ("rank", "step"))
    if not any(c in names for c in ("compute_ms", "wait_ms", "step_ms")):
        raise TableImportError(
            f"{p}: the table needs at least one of the columns compute_ms, wait_ms, step_ms (it has "
            f"{', '.join(names)})"
        )
    times = [c for c in (*_TIMES, "samples", "tokens") if c in names]
    rows = _Rows(p, [c for c in PLACEMENT if c in names])
    for chunk in chunks:
        rows.add(chunk, {c: _numbers(p, chunk, c, integer=c in ("samples", "tokens")) for c in times})
    steps, world, cell, counts = rows.grid()
    twice = np.flatnonzero(counts > 1)
    if len(twice):
        s, r = int(steps[twice[0] // world]), int(twice[0] % world)
        raise TableImportError(f"{p}: {_second_row(p, r, s)}: rank {r} step {s} appears twice")
    values = {}
    for c in times:
        grid = np.empty(len(steps) * world)
        grid[cell] = rows.column(c)
        values[c] = grid.reshape(len(steps), world)
    return _Table(steps=steps, values=values, placement=[rows.placement[r] for r in range(world)])


def _second_row(path: Path, rank: int, step: int) -> str:
    """Where the second row of ``rank`` and ``step`` is (read again: an error's cost only)."""
    seen = False
    for chunk in _chunks(path)[1]:
        r = chunk.columns["rank"].astype(np.float64)
        s = chunk.columns["step"].astype(np.float64)
        for i in np.flatnonzero((r == rank) & (s == step)):
            if seen:
                return chunk.where(int(i))
            seen = True
    return "a later row"


def _existing(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.is_file():
        raise TableImportError(f"{p}: no such file")
    return p


#: the ops of an op table, and what each counts as
OPS = {
    "forward": "compute",
    "backward": "compute",
    "tp_collective": "compute",  # inside forward and backward: part of the tensor-parallel group's work
    "other": "compute",
    "data": "data",  # part of compute (the glossary's), and its own column
    "dp_collective": "sync",
    "pp_send": "pipeline",
    "pp_recv": "pipeline",
    "optimizer": "opt",
    "gc": "gc",
}
#: every column an op table may have
OP_COLUMNS = ("rank", "step", "op", "start_ms", "duration_ms", *PLACEMENT)


def _op_codes(path: Path, chunk: _Chunk) -> np.ndarray:
    """The chunk's ops as indices into :data:`OPS` (an unknown op fails naming its row)."""
    names = list(OPS)
    raw = chunk.columns["op"].astype(str)
    unique, first, inverse = np.unique(np.char.strip(raw), return_index=True, return_inverse=True)
    for value, i in zip(unique.tolist(), first.tolist(), strict=True):
        if value not in OPS:
            near = difflib.get_close_matches(value, names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TableImportError(
                f"{path}: {chunk.where(int(i))}: column 'op': {value!r} is not an op{hint}; expected one of "
                f"{', '.join(names)}"
            )
    return np.asarray([names.index(v) for v in unique.tolist()], dtype=np.int64)[inverse]


def read_ops(path: str | os.PathLike[str]) -> tuple[_Table, bool]:
    """The op table at ``path`` reduced to a step table: per rank and step, compute (data, forward,
    backward, tensor-parallel collectives, other), the input wait, the optimizer step, GC time and,
    where the step has gradient collectives (``dp_collective``) and no pipeline ops, the wait: the
    end of its last gradient collective minus its arrival (the end of its last backward op). Pipeline
    sends and receives are neither compute nor waiting at the sync point: they are waiting behind a
    slower stage. Returns the table and whether the waits were measured (else: synchronous model)."""
    p = _existing(path)
    names, chunks = _chunks(p)
    _check_columns(p, names, OP_COLUMNS, "an op table")
    _require(p, names, ("rank", "step", "op", "start_ms", "duration_ms"))
    rows = _Rows(p, [c for c in PLACEMENT if c in names])
    for chunk in chunks:
        start = _numbers(p, chunk, "start_ms", signed=True)
        duration = _numbers(p, chunk, "duration_ms")
        rows.add(chunk, {"op": _op_codes(p, chunk), "start": start, "end": start + duration})
    steps, world, cell, _ = rows.grid()
    op, start, end = rows.column("op"), rows.column("start"), rows.column("end")
    parts = np.asarray(list(OPS.values()))[op]
    size = len(steps) * world

    def total(*kinds: str) -> np.ndarray:
        mask = np.isin(parts, kinds)
        return np.bincount(cell[mask], weights=(end - start)[mask], minlength=size)

    def extreme(ufunc: Any, initial: float, values: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        out = np.full(size, initial)
        ufunc.at(out, cell if mask is None else cell[mask], values if mask is None else values[mask])
        return out

    first, last = extreme(np.minimum, np.inf, start), extreme(np.maximum, -np.inf, end)
    backward = extreme(np.maximum, -np.inf, end, op == list(OPS).index("backward"))
    sync_end = extreme(np.maximum, -np.inf, end, parts == "sync")
    measured = not np.isin(parts, ["pipeline"]).any() and bool(np.isfinite(sync_end).all())
    grids = {
        "compute_ms": total("compute", "data"),
        "data_ms": total("data"),
        "opt_ms": total("opt"),
        "gc_ms": total("gc"),
        "step_ms": last - first,
    }
    if measured:
        arrival = np.where(np.isfinite(backward), backward, first)
        grids["wait_ms"] = np.maximum(0.0, sync_end - arrival)
    else:
        grids["sync_ms"] = total("sync")
    values = {c: v.reshape(len(steps), world) for c, v in grids.items()}
    table = _Table(steps=steps, values=values, placement=[rows.placement[r] for r in range(world)])
    return table, measured


def _placement_value(value: Any) -> Any:
    """A placement cell as the record keeps it: a whole number as ``int``, else the text."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else value
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return int(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


@dataclass(frozen=True)
class _Derived:
    """The record's per-rank numbers, ``[steps, ranks]`` ms, and how the waits were had."""

    compute: np.ndarray
    wait: np.ndarray
    data: np.ndarray | None  #: None: not in the table
    step_ms: np.ndarray  #: [steps]
    waits: str  #: "recorded" or "synchronous_model"


def derive(t: _Table) -> _Derived:
    """Compute and waits from what the table has (module docstring)."""
    v = t.values
    compute, wait, step = v.get("compute_ms"), v.get("wait_ms"), v.get("step_ms")
    if compute is None:
        # a rank's step time with its wait taken out, or (no waits) its own iteration time
        assert step is not None
        compute = step - wait if wait is not None else step
    slowest = compute.max(axis=1)
    if wait is not None:
        how = "recorded"
        end = (compute + wait).max(axis=1)
    else:
        how = "synchronous_model"
        if "sync_ms" in v:  # an op table's gradient collectives: the last rank's is the transfer
            transfer = v["sync_ms"].min(axis=1)
        elif step is not None and "compute_ms" in v:
            transfer = np.clip(step.max(axis=1) - slowest, 0.0, None)
        else:
            transfer = np.zeros(len(t.steps))
        wait = slowest[:, None] - compute + transfer[:, None]
        end = slowest + transfer
    step_ms = step.max(axis=1) if step is not None and "compute_ms" in v else end
    data = v.get("data_ms")
    return _Derived(
        compute=np.clip(compute, 0.0, None),
        wait=np.clip(wait, 0.0, None),
        data=data,
        step_ms=np.maximum(step_ms, end),
        waits=how,
    )


def _summaries(t: _Table, d: _Derived) -> Iterator[StepSummary]:
    world = d.wait.shape[1]
    zeros = (0.0,) * world
    samples, tokens, gc, opt = (t.values.get(c) for c in ("samples", "tokens", "gc_ms", "opt_ms"))
    for i, step in enumerate(t.steps.tolist()):
        w = d.wait[i]
        lead = w - w.min()
        recent = d.step_ms[max(0, i - _CV_STEPS + 1) : i + 1]
        mean = float(recent.mean())
        yield StepSummary(
            step=int(step),
            valid=True,
            warmup=False,
            skew_ms=float(w.max() - w.min()),
            straggler_rank=int(w.argmin()),
            compute_straggler_rank=int(d.compute[i].argmax()),
            step_ms=float(d.step_ms[i]),
            step_cv=float(recent.std() / mean) if mean > 0 else 0.0,
            wait_ms_min=float(w.min()),
            wait_ms_max=float(w.max()),
            delay_ms_max=0.0,
            pacing_active=False,
            lead_ms=tuple(lead.tolist()),
            compute_ms=tuple(d.compute[i].tolist()),
            wait_ms=tuple(w.tolist()),
            delay_ms=zeros,
            rank_step_ms=(float(d.step_ms[i]),) * world,
            data_ms=tuple(d.data[i].tolist()) if d.data is not None else zeros,
            gap_ms=zeros,
            buckets=1,
            samples=tuple(int(x) for x in samples[i]) if samples is not None else (),
            gc_ms=tuple(gc[i].tolist()) if gc is not None else (),
            opt_ms=tuple(opt[i].tolist()) if opt is not None else (),
            tokens=tuple(int(x) for x in tokens[i]) if tokens is not None else (),
        )


def import_table(
    source: str | os.PathLike[str], out_dir: str | os.PathLike[str], record_format: str = "jsonl"
) -> Path:
    """Write the run record of the step table ``source`` into ``out_dir`` (new, or empty); returns
    the record's path. :class:`TableImportError` on bad input, with nothing written."""
    src = Path(source)
    _check_out(out_dir)
    table = read_table(src)
    return write_record(table, derive(table), src, out_dir, "table", record_format)


def import_ops(
    source: str | os.PathLike[str], out_dir: str | os.PathLike[str], record_format: str = "jsonl"
) -> Path:
    """Write the run record of the op table ``source`` (:func:`read_ops`) into ``out_dir``."""
    src = Path(source)
    _check_out(out_dir)
    table, _ = read_ops(src)
    return write_record(table, derive(table), src, out_dir, "ops", record_format)


def _check_out(out_dir: str | os.PathLike[str]) -> None:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TableImportError(f"{out}: exists and is not an empty directory; name a new OUT_DIR")


def write_record(
    table: _Table,
    derived: _Derived,
    src: Path,
    out_dir: str | os.PathLike[str],
    kind: str,
    record_format: str = "jsonl",
) -> Path:
    """The run record of ``table`` in ``out_dir``: written into a directory beside it, then renamed
    (it appears whole or not at all). ``record_format``: ``jsonl`` (each step's per-rank lists in its
    line) or ``arrow`` (in a columnar file beside it, as ``record_format: arrow`` writes them; needs
    pyarrow; for many ranks: a tenth of the size, read faster)."""
    out = Path(out_dir)
    _check_out(out)
    if record_format not in ("jsonl", "arrow"):
        raise TableImportError(f"record format {record_format!r}: expected 'jsonl' or 'arrow'")
    world = derived.wait.shape[1]
    topology = [{"rank": r, **table.placement[r]} for r in range(world)]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        columns = None
        if record_format == "arrow":
            try:
                columns = RankColumnsWriter(staging / rank_columns_filename(RECORD_FILENAME), world)
            except ImportError as e:
                raise TableImportError(f"--format arrow: {e}") from e
        writer = RunRecordWriter(
            staging / RECORD_FILENAME,
            world_size=world,
            config={},
            topology=topology,
            framework="import",
            rank_columns=columns,
            extra={
                "imported": {
                    "format": kind,
                    "source": str(src.resolve()),
                    "waits": derived.waits,
                    "columns": sorted(table.values),
                }
            },
        )
        window: list[StepSummary] = []
        for s in _summaries(table, derived):
            window.append(s)
            if len(window) == _WINDOW_STEPS:
                writer.write_window(window, None)
                window = []
        if window:
            writer.write_window(window, None)
        writer.close()
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out / RECORD_FILENAME


#: a gradient collective in a profiler trace: gloo's and NCCL's CPU-side spans, c10d's ops, NCCL kernels
_COLLECTIVE = re.compile(
    r"^(gloo|nccl):(all_reduce|allreduce|reduce_scatter|all_gather|allgather)"
    r"|^c10d::(allreduce_|reduce_scatter|_reduce_scatter_base|allgather|_allgather_base)"
    r"|^nccl(Dev)?Kernel_(AllReduce|ReduceScatter|AllGather)",
    re.IGNORECASE,
)
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_BACKWARD = "autograd::engine::evaluate_function"
_DATA = "enumerate(DataLoader)"
_OPTIMIZER = "Optimizer.step#"
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


def _load_trace(path: Path) -> dict[str, Any]:
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (OSError, ValueError, EOFError) as e:
        raise TableImportError(f"{path}: not a readable Chrome-trace JSON file ({e})") from e
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TableImportError(f"{path}: no 'traceEvents' list: not a PyTorch profiler trace")
    return trace


def _trace_rank(path: Path, trace: dict[str, Any]) -> int:
    info = trace.get("distributedInfo") or {}
    if isinstance(info.get("rank"), int):
        return int(info["rank"])
    match = _RANK_IN_NAME.search(path.name)
    if match:
        return int(match.group(1))
    raise TableImportError(
        f"{path}: the trace has no distributedInfo.rank (a run without torch.distributed) and its name "
        "no 'rank<N>': name each rank's file rank<N>... "
        "(tensorboard_trace_handler(dir, worker_name=f'rank{rank}'))"
    )


def _trace_steps(path: Path, trace: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per ``ProfilerStep#N``: the rank's compute, wait, input, optimizer and step time, ms.

    CPU traces: arrival is the end of the last backward op (``autograd::engine::evaluate_function``,
    its gradient hand-off to the collective included), completion the end of the step's last gradient
    collective (gloo's span on its own thread waits for every peer), compute the step's start to
    arrival. GPU traces (kernel events): the device's view, each kernel in the step whose CPU launch
    falls in it (by correlation id): arrival is the end of the last compute kernel launched before the
    optimizer step, completion the end of the last collective kernel, compute the step's first
    kernel to arrival."""
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    spans = []
    for e in events:
        m = _STEP.match(str(e.get("name", "")))
        if m:
            spans.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), int(m.group(1))))
    if not spans:
        raise TableImportError(
            f"{path}: no ProfilerStep#N spans: record with torch.profiler.profile(schedule=...) and call "
            "prof.step() once per training step"
        )
    spans.sort()
    starts = [s[0] for s in spans]

    def step_of(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts <= spans[i][1] else None

    out: dict[int, dict[str, Any]] = {
        n: {"start": a, "end": b, "data_ms": 0.0, "opt_ms": 0.0, "opt_at": None} for a, b, n in spans
    }
    by_index = [n for _, _, n in spans]
    for e in events:
        name = str(e.get("name", ""))
        ts, end = float(e.get("ts", 0.0)), float(e.get("ts", 0.0)) + float(e.get("dur", 0.0))
        i = step_of(ts)
        if i is None or e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        cell = out[by_index[i]]
        if _COLLECTIVE.search(name):
            cell["sync_end"] = max(cell.get("sync_end", end), end)
        elif name.startswith(_BACKWARD):
            cell["arrival"] = max(cell.get("arrival", end), end)
        elif name.startswith(_DATA):
            cell["data_ms"] += (end - ts) / 1000.0
        elif name.startswith(_OPTIMIZER):
            cell["opt_ms"] += (end - ts) / 1000.0
            cell["opt_at"] = ts if cell["opt_at"] is None else min(cell["opt_at"], ts)
    _device_view(events, out, lambda at: None if (i := step_of(at)) is None else by_index[i])
    return _step_times(path, out)


def _device_view(
    events: list[dict[str, Any]], cells: dict[int, dict[str, Any]], step_at: Callable[[float], int | None]
) -> None:
    """GPU traces: each kernel counted in the step ``step_at`` its CPU launch (by correlation id);
    the device's arrival and completion replace the host's in every step's ``cells``."""
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        return
    for cell in cells.values():
        cell.pop("arrival", None)
        cell.pop("sync_end", None)
    launch = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and isinstance(e.get("args"), dict)
        and "correlation" in e["args"]
    }
    for e in kernels:
        ts, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        at = launch.get((e.get("args") or {}).get("correlation"), ts)
        step = step_at(at)
        if step is None:
            continue
        cell = cells[step]
        cell["device_start"] = min(cell.get("device_start", ts), ts)
        if _COLLECTIVE.search(str(e.get("name", ""))):
            cell["sync_end"] = max(cell.get("sync_end", end), end)
        elif cell["opt_at"] is None or at < cell["opt_at"]:
            cell["arrival"] = max(cell.get("arrival", end), end)


def _step_times(path: Path, out: dict[int, dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Each step's times (ms) from its marks; a step without arrival or completion is left out."""
    steps = {}
    for n, cell in out.items():
        if "arrival" not in cell or "sync_end" not in cell:
            continue  # a step without backward or gradient collective (validation, the profiler's edges)
        start = cell.get("device_start", cell["start"])
        steps[n] = {
            "compute_ms": max(0.0, cell["arrival"] - start) / 1000.0,
            "wait_ms": max(0.0, cell["sync_end"] - cell["arrival"]) / 1000.0,
            "data_ms": cell["data_ms"],
            "opt_ms": cell["opt_ms"],
            "step_ms": (cell["end"] - cell["start"]) / 1000.0,
        }
    if not steps:
        raise TableImportError(
            f"{path}: no step holds both a backward op and a gradient collective (gloo/nccl all-reduce, "
            "reduce-scatter or all-gather): was the trace recorded around a distributed training step?"
        )
    return steps


def read_traces(directory: str | os.PathLike[str]) -> tuple[_Table, int]:
    """One PyTorch profiler trace per rank in ``directory`` (``*.json``, ``*.json.gz``) as a step
    table of the steps every rank has; returns it and how many steps some rank lacked (left out)."""
    d = Path(directory)
    if not d.is_dir():
        raise TableImportError(f"{d}: not a directory of profiler traces")
    files = sorted(p for p in d.iterdir() if p.name.endswith((".json", ".json.gz")))
    if not files:
        raise TableImportError(f"{d}: no *.json or *.json.gz trace files")
    per_rank: dict[int, dict[int, dict[str, float]]] = {}
    hosts: dict[int, str] = {}
    where: dict[int, Path] = {}
    for path in files:
        trace = _load_trace(path)
        rank = _trace_rank(path, trace)
        if rank in per_rank:
            raise TableImportError(
                f"{path}: rank {rank} has a trace already ({where[rank].name}); keep one trace per rank "
                "(one profiling cycle)"
            )
        per_rank[rank], where[rank] = _trace_steps(path, trace), path
        if trace.get("host_name"):
            hosts[rank] = str(trace["host_name"])
    world = len(per_rank)
    if sorted(per_rank) != list(range(world)):
        gap = next(r for r in range(world + 1) if r not in per_rank)
        raise TableImportError(f"{d}: traces of ranks {sorted(per_rank)}: rank {gap} has none")
    common = sorted(set.intersection(*(set(s) for s in per_rank.values())))
    if not common:
        raise TableImportError(f"{d}: no ProfilerStep number is in every rank's trace")
    dropped = len(set().union(*(set(s) for s in per_rank.values()))) - len(common)
    columns = ("compute_ms", "wait_ms", "data_ms", "opt_ms", "step_ms")
    values = {c: np.array([[per_rank[r][n][c] for r in range(world)] for n in common]) for c in columns}
    placement = [{"host": hosts[r]} if r in hosts else {} for r in range(world)]
    return _Table(steps=np.asarray(common, dtype=np.int64), values=values, placement=placement), dropped


def import_traces(
    source: str | os.PathLike[str], out_dir: str | os.PathLike[str], record_format: str = "jsonl"
) -> Path:
    """Write the run record of the profiler traces in ``source`` (:func:`read_traces`) into ``out_dir``."""
    _check_out(out_dir)
    table, _ = read_traces(source)
    return write_record(table, derive(table), Path(source), out_dir, "torch-profiler", record_format)


#: ``pace import KIND``: the function that imports it, and its help
KINDS = {
    "table": (import_table, "a per-rank step table (CSV or Parquet): docs/import.md"),
    "ops": (import_ops, "a per-rank op table (CSV or Parquet): docs/import.md"),
    "torch-profiler": (import_traces, "a directory of PyTorch profiler traces, one per rank: docs/import.md"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pace import",
        description="Turn timings recorded elsewhere into a run record that pace diagnose and pace "
        "simulate --from-run read.",
    )
    sub = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    for name, (_, help_text) in KINDS.items():
        kind = sub.add_parser(name, help=help_text)
        kind.add_argument(
            "file",
            help="the traces' directory" if name == "torch-profiler" else "the table: .csv, or .parquet",
        )
        kind.add_argument("out_dir", help="a new directory for the run record")
        kind.add_argument(
            "--format",
            choices=("jsonl", "arrow"),
            default="jsonl",
            help="the record's per-rank numbers in its JSON lines (default) or in an Arrow file beside "
            "them (needs pyarrow; for many ranks)",
        )
    args = parser.parse_args(argv)
    try:
        path = KINDS[args.kind][0](args.file, args.out_dir, args.format)
    except TableImportError as e:
        print(f"pace import: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}; next: pace diagnose {Path(args.out_dir)}")
    return 0
