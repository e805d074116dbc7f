"""``pace import table FILE OUT_DIR``: a per-rank step table recorded elsewhere becomes a run record, so
that ``pace diagnose``, its report and ``pace simulate --from-run`` read it unchanged.

The table (CSV, or Parquet with pyarrow) has one row per rank and step: the columns ``rank``, ``step`` and
at least one of ``compute_ms``, ``wait_ms``, ``step_ms``; optionally ``data_ms``, ``samples``, ``host``
and the rank's mesh coordinates (``dp_replicate``, ``dp_shard``, ``dp``, ``tp``, ``pp``, ``cp``).
Where the waits are not recorded they follow from the synchronous model: every rank starts the step
together, the collective completes once the last rank has arrived, so a rank waits for the slowest
rank's compute minus its own, plus the collective's time (``step_ms`` minus the slowest compute where
both are given, else 0). The record's header says which (``imported.waits``), and the diagnosis repeats
it. A rank's own ``step_ms`` alone (a worker's iteration time with no waits in it) is its compute.

Bad input fails before anything is written, naming the file, the row (CSV: the line) and the column;
the record is written into a temporary directory beside ``OUT_DIR`` and renamed, so it appears whole or
not at all.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pace_strategy.core.records import StepSummary
from pace_strategy.telemetry.run_record import RECORD_FILENAME, RunRecordWriter

__all__ = ["TABLE_COLUMNS", "TableImportError", "import_table", "main"]

#: numeric per-rank, per-step columns (ms unless named otherwise)
_TIMES = ("compute_ms", "wait_ms", "step_ms", "data_ms")
#: per-rank placement columns: the same value in every step of a rank
PLACEMENT = ("host", "dp_replicate", "dp_shard", "dp", "tp", "pp", "cp")
#: every column a table may have
TABLE_COLUMNS = ("rank", "step", *_TIMES, "samples", *PLACEMENT)
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


def _rows(path: Path) -> tuple[list[str], Iterator[tuple[str, dict[str, Any]]]]:
    """The table's column names and its rows as ``(where, {column: value})``; ``where`` names the row
    for an error (``line N`` of a CSV file, ``row N`` of a Parquet file, counting data rows from 1)."""
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

        def parquet_rows() -> Iterator[tuple[str, dict[str, Any]]]:
            n = 0
            for batch in table.iter_batches():
                for row in batch.to_pylist():
                    n += 1
                    yield f"row {n}", row

        return names, parquet_rows()
    if suffix not in (".csv", ".tsv", ".txt"):
        raise TableImportError(f"{path}: expected a .csv or .parquet file (got {suffix or 'no suffix'!r})")
    f = path.open(newline="")
    try:
        reader = csv.reader(f, delimiter="\t" if suffix == ".tsv" else ",")
        names = [n.strip() for n in next(reader, [])]
    except (csv.Error, UnicodeDecodeError) as e:
        f.close()
        raise TableImportError(f"{path}: not a readable CSV table ({e})") from e

    def csv_rows() -> Iterator[tuple[str, dict[str, Any]]]:
        with f:
            for values in reader:
                if not values or all(not v.strip() for v in values):
                    continue
                where = f"line {reader.line_num}"
                if len(values) != len(names):
                    raise TableImportError(
                        f"{path}: {where}: {len(values)} fields for {len(names)} columns ({', '.join(names)})"
                    )
                yield where, dict(zip(names, (v.strip() for v in values), strict=True))

    return names, csv_rows()


def _check_columns(path: Path, names: Sequence[str]) -> None:
    for name in names:
        if name not in TABLE_COLUMNS:
            near = difflib.get_close_matches(name, TABLE_COLUMNS, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise TableImportError(
                f"{path}: unknown column {name!r}.{hint} Columns a step table may have: "
                f"{', '.join(TABLE_COLUMNS)}."
            )
    missing = [c for c in ("rank", "step") if c not in names]
    if missing:
        raise TableImportError(f"{path}: the table has no {' or '.join(map(repr, missing))} column")
    if not any(c in names for c in ("compute_ms", "wait_ms", "step_ms")):
        raise TableImportError(
            f"{path}: the table needs at least one of the columns compute_ms, wait_ms, step_ms (it has "
            f"{', '.join(names)})"
        )


def _number(path: Path, where: str, column: str, value: Any, *, integer: bool = False) -> float:
    if isinstance(value, str):
        try:
            x = float(value)
        except ValueError:
            x = math.nan
    else:
        x = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    bad = not math.isfinite(x) or (integer and x != int(x)) or x < 0
    if bad:
        kind = "a whole number >= 0" if integer else "a finite number >= 0 (ms)"
        raise TableImportError(f"{path}: {where}: column {column!r}: expected {kind}, got {value!r}")
    return x


def read_table(path: str | os.PathLike[str]) -> _Table:
    """The table at ``path``, checked (:class:`TableImportError` on the first bad row)."""
    p = Path(path)
    if not p.is_file():
        raise TableImportError(f"{p}: no such file")
    names, rows = _rows(p)
    _check_columns(p, names)
    times = [c for c in (*_TIMES, "samples") if c in names]
    places = [c for c in PLACEMENT if c in names]
    cells: dict[tuple[int, int], tuple[float, ...]] = {}
    placement: dict[int, dict[str, Any]] = {}
    first_row: dict[int, str] = {}
    for where, row in rows:
        rank = int(_number(p, where, "rank", row["rank"], integer=True))
        step = int(_number(p, where, "step", row["step"], integer=True))
        if (rank, step) in cells:
            raise TableImportError(f"{p}: {where}: rank {rank} step {step} appears twice")
        cells[(rank, step)] = tuple(
            _number(p, where, c, row[c], integer=c == "samples")
            if row[c] not in ("", None)
            else _missing(p, where, c)
            for c in times
        )
        mine = {c: _placement_value(row[c]) for c in places}
        if rank not in placement:
            placement[rank], first_row[rank] = mine, where
        elif mine != placement[rank]:
            column = next(c for c in places if mine[c] != placement[rank][c])
            raise TableImportError(
                f"{p}: {where}: column {column!r}: rank {rank} is {mine[column]!r} here and "
                f"{placement[rank][column]!r} at {first_row[rank]}: a rank's placement is the same in "
                "every step"
            )
    if not cells:
        raise TableImportError(f"{p}: the table has no rows")
    ranks = sorted(placement)
    world = len(ranks)
    if ranks != list(range(world)):
        gap = next(r for r in range(world + 1) if r not in placement)
        raise TableImportError(
            f"{p}: column 'rank': ranks must be 0..{world - 1} with none missing; rank {gap} has no row"
        )
    steps = np.asarray(sorted({s for _, s in cells}), dtype=np.int64)
    index = {int(s): i for i, s in enumerate(steps)}
    if len(cells) != len(steps) * world:
        for s in steps.tolist():
            absent = [r for r in range(world) if (r, s) not in cells]
            if absent:
                raise TableImportError(
                    f"{p}: step {s} has no row for rank{'s' if len(absent) > 1 else ''} "
                    f"{', '.join(map(str, absent[:8]))}{' ...' if len(absent) > 8 else ''}: every step "
                    "needs every rank (drop the step from the table, or fill it)"
                )
    values = {c: np.full((len(steps), world), np.nan) for c in times}
    for (rank, step), row_values in cells.items():
        i = index[step]
        for c, x in zip(times, row_values, strict=True):
            values[c][i, rank] = x
    return _Table(steps=steps, values=values, placement=[placement[r] for r in range(world)])


def _missing(path: Path, where: str, column: str) -> float:
    raise TableImportError(f"{path}: {where}: column {column!r} is empty (every row needs a value)")


def _placement_value(value: Any) -> Any:
    """A placement cell as the record keeps it: a whole number as ``int``, else the text."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@dataclass(frozen=True)
class _Derived:
    """The record's per-rank numbers, ``[steps, ranks]`` ms, and how the waits were had."""

    compute: np.ndarray
    wait: np.ndarray
    data: np.ndarray
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
        transfer = (
            np.clip(step.max(axis=1) - slowest, 0.0, None)
            if step is not None and "compute_ms" in v
            else np.zeros(len(t.steps))
        )
        wait = slowest[:, None] - compute + transfer[:, None]
        end = slowest + transfer
    step_ms = step.max(axis=1) if step is not None and "compute_ms" in v else end
    data = v.get("data_ms")
    return _Derived(
        compute=np.clip(compute, 0.0, None),
        wait=np.clip(wait, 0.0, None),
        data=data if data is not None else np.zeros_like(compute),
        step_ms=np.maximum(step_ms, end),
        waits=how,
    )


def _summaries(t: _Table, d: _Derived) -> Iterator[StepSummary]:
    world = d.wait.shape[1]
    zeros = (0.0,) * world
    samples = t.values.get("samples")
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
            data_ms=tuple(d.data[i].tolist()),
            gap_ms=zeros,
            buckets=1,
            samples=tuple(int(x) for x in samples[i]) if samples is not None else (),
        )


def import_table(source: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write the run record of the table ``source`` into ``out_dir`` (new, or empty); returns the
    record's path. :class:`TableImportError` on bad input, with nothing written."""
    src, out = Path(source), Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TableImportError(f"{out}: exists and is not an empty directory; name a new OUT_DIR")
    table = read_table(src)
    derived = derive(table)
    world = derived.wait.shape[1]
    topology = [{"rank": r, **table.placement[r]} for r in range(world)]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        writer = RunRecordWriter(
            staging / RECORD_FILENAME,
            world_size=world,
            config={},
            topology=topology,
            framework="import",
            extra={
                "imported": {
                    "format": "table",
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pace import",
        description="Turn timings recorded elsewhere into a run record that pace diagnose and pace "
        "simulate --from-run read.",
    )
    sub = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    table = sub.add_parser("table", help="a per-rank step table (CSV or Parquet): docs/import.md")
    table.add_argument("file", help="the table: .csv, or .parquet (needs pyarrow)")
    table.add_argument("out_dir", help="a new directory for the run record")
    args = parser.parse_args(argv)
    try:
        path = import_table(args.file, args.out_dir)
    except TableImportError as e:
        print(f"pace import: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}; next: pace diagnose {Path(args.out_dir)}")
    return 0
