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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pace_strategy.core.records import StepSummary
from pace_strategy.telemetry.run_record import RECORD_FILENAME, RunRecordWriter

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
PLACEMENT = ("host", "dp_replicate", "dp_shard", "dp", "tp", "pp", "cp")
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


class _Cells:
    """Per-rank, per-step values gathered row by row (summed where several rows add to one cell),
    and each rank's placement, checked the same in every row."""

    def __init__(self, path: Path, places: Sequence[str]) -> None:
        self.path, self.places = path, list(places)
        self.cells: dict[tuple[int, int], dict[str, float]] = {}
        self.placement: dict[int, dict[str, Any]] = {}
        self.first_row: dict[int, str] = {}

    def cell(self, where: str, row: dict[str, Any]) -> tuple[tuple[int, int], dict[str, float], bool]:
        """The row's (rank, step), its cell, and whether the cell is new."""
        p = self.path
        rank = int(_number(p, where, "rank", row["rank"], integer=True))
        step = int(_number(p, where, "step", row["step"], integer=True))
        mine = {c: _placement_value(row[c]) for c in self.places}
        if rank not in self.placement:
            self.placement[rank], self.first_row[rank] = mine, where
        elif mine != self.placement[rank]:
            column = next(c for c in self.places if mine[c] != self.placement[rank][c])
            raise TableImportError(
                f"{p}: {where}: column {column!r}: rank {rank} is {mine[column]!r} here and "
                f"{self.placement[rank][column]!r} at {self.first_row[rank]}: a rank's placement is the "
                "same in every step"
            )
        key = (rank, step)
        new = key not in self.cells
        if new:
            self.cells[key] = {}
        return key, self.cells[key], new

    def table(self, columns: Sequence[str]) -> _Table:
        """The cells as ``[steps, ranks]`` arrays of ``columns`` (0 where a cell lacks one); every
        rank 0..W-1 in every step."""
        p = self.path
        if not self.cells:
            raise TableImportError(f"{p}: the table has no rows")
        ranks = sorted(self.placement)
        world = len(ranks)
        if ranks != list(range(world)):
            gap = next(r for r in range(world + 1) if r not in self.placement)
            raise TableImportError(
                f"{p}: column 'rank': ranks must be 0..{world - 1} with none missing; rank {gap} has no row"
            )
        steps = np.asarray(sorted({s for _, s in self.cells}), dtype=np.int64)
        if len(self.cells) != len(steps) * world:
            for s in steps.tolist():
                absent = [r for r in range(world) if (r, s) not in self.cells]
                if absent:
                    raise TableImportError(
                        f"{p}: step {s} has no row for rank{'s' if len(absent) > 1 else ''} "
                        f"{', '.join(map(str, absent[:8]))}{' ...' if len(absent) > 8 else ''}: every "
                        "step needs every rank (drop the step from the table, or fill it)"
                    )
        index = {int(s): i for i, s in enumerate(steps)}
        values = {c: np.zeros((len(steps), world)) for c in columns}
        for (rank, step), cell in self.cells.items():
            i = index[step]
            for c in columns:
                values[c][i, rank] = cell.get(c, 0.0)
        return _Table(steps=steps, values=values, placement=[self.placement[r] for r in range(world)])


def read_table(path: str | os.PathLike[str]) -> _Table:
    """The step table at ``path``, checked (:class:`TableImportError` on the first bad row)."""
    p = _existing(path)
    names, rows = _rows(p)
    _check_columns(p, names, TABLE_COLUMNS, "a step table")
    _require(p, names, ("rank", "step"))
    if not any(c in names for c in ("compute_ms", "wait_ms", "step_ms")):
        raise TableImportError(
            f"{p}: the table needs at least one of the columns compute_ms, wait_ms, step_ms (it has "
            f"{', '.join(names)})"
        )
    times = [c for c in (*_TIMES, "samples", "tokens") if c in names]
    cells = _Cells(p, [c for c in PLACEMENT if c in names])
    for where, row in rows:
        key, cell, new = cells.cell(where, row)
        if not new:
            raise TableImportError(f"{p}: {where}: rank {key[0]} step {key[1]} appears twice")
        for c in times:
            cell[c] = _number(p, where, c, row[c], integer=c in ("samples", "tokens"))
    return cells.table(times)


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


def read_ops(path: str | os.PathLike[str]) -> tuple[_Table, bool]:
    """The op table at ``path`` reduced to a step table: per rank and step, compute (data, forward,
    backward, tensor-parallel collectives, other), the input wait, the optimizer step, GC time and,
    where the step has gradient collectives (``dp_collective``) and no pipeline ops, the wait: the
    end of its last gradient collective minus its arrival (the end of its last backward op). Pipeline
    sends and receives are neither compute nor waiting at the sync point: they are waiting behind a
    slower stage. Returns the table and whether the waits were measured (else: synchronous model)."""
    p = _existing(path)
    names, rows = _rows(p)
    _check_columns(p, names, OP_COLUMNS, "an op table")
    _require(p, names, ("rank", "step", "op", "start_ms", "duration_ms"))
    cells = _Cells(p, [c for c in PLACEMENT if c in names])
    pipeline = False
    for where, row in rows:
        op = str(row["op"]).strip()
        if op not in OPS:
            near = difflib.get_close_matches(op, OPS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TableImportError(
                f"{p}: {where}: column 'op': {op!r} is not an op{hint}; expected one of {', '.join(OPS)}"
            )
        start = _number(p, where, "start_ms", row["start_ms"], signed=True)
        end = start + _number(p, where, "duration_ms", row["duration_ms"])
        _, cell, _ = cells.cell(where, row)
        part = OPS[op]
        duration = end - start
        cell["first"] = min(cell.get("first", start), start)
        cell["last"] = max(cell.get("last", end), end)
        if part in ("compute", "data"):
            cell["compute_ms"] = cell.get("compute_ms", 0.0) + duration
        if part in ("data", "opt", "gc"):
            name = {"data": "data_ms", "opt": "opt_ms", "gc": "gc_ms"}[part]
            cell[name] = cell.get(name, 0.0) + duration
        if op == "backward":
            cell["arrival"] = max(cell.get("arrival", end), end)
        elif part == "sync":
            cell["sync_end"] = max(cell.get("sync_end", end), end)
            cell["sync_ms"] = cell.get("sync_ms", 0.0) + duration
        pipeline = pipeline or part == "pipeline"
    measured = not pipeline and all("sync_end" in c for c in cells.cells.values())
    for cell in cells.cells.values():
        cell["step_ms"] = cell["last"] - cell["first"]
        if measured:
            cell["wait_ms"] = max(0.0, cell["sync_end"] - cell.get("arrival", cell["first"]))
    columns = ["compute_ms", "data_ms", "opt_ms", "gc_ms", "step_ms", "wait_ms" if measured else "sync_ms"]
    table = cells.table(columns)
    return table, measured


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
        data=data if data is not None else np.zeros_like(compute),
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
            data_ms=tuple(d.data[i].tolist()),
            gap_ms=zeros,
            buckets=1,
            samples=tuple(int(x) for x in samples[i]) if samples is not None else (),
            gc_ms=tuple(gc[i].tolist()) if gc is not None else (),
            opt_ms=tuple(opt[i].tolist()) if opt is not None else (),
            tokens=tuple(int(x) for x in tokens[i]) if tokens is not None else (),
        )


def import_table(source: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write the run record of the step table ``source`` into ``out_dir`` (new, or empty); returns
    the record's path. :class:`TableImportError` on bad input, with nothing written."""
    src = Path(source)
    _check_out(out_dir)
    table = read_table(src)
    return write_record(table, derive(table), src, out_dir, "table")


def import_ops(source: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write the run record of the op table ``source`` (:func:`read_ops`) into ``out_dir``."""
    src = Path(source)
    _check_out(out_dir)
    table, _ = read_ops(src)
    return write_record(table, derive(table), src, out_dir, "ops")


def _check_out(out_dir: str | os.PathLike[str]) -> None:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TableImportError(f"{out}: exists and is not an empty directory; name a new OUT_DIR")


def write_record(
    table: _Table, derived: _Derived, src: Path, out_dir: str | os.PathLike[str], kind: str
) -> Path:
    """The run record of ``table`` in ``out_dir``: written into a directory beside it, then renamed
    (it appears whole or not at all)."""
    out = Path(out_dir)
    _check_out(out)
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
    launch = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and isinstance(e.get("args"), dict)
        and "correlation" in e["args"]
    }
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]

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
    if kernels:
        for cell in out.values():  # the device's view replaces the host's
            cell.pop("arrival", None)
            cell.pop("sync_end", None)
        for e in kernels:
            ts, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
            at = launch.get((e.get("args") or {}).get("correlation"), ts)
            i = step_of(at)
            if i is None:
                continue
            cell = out[by_index[i]]
            cell["device_start"] = min(cell.get("device_start", ts), ts)
            if _COLLECTIVE.search(str(e.get("name", ""))):
                cell["sync_end"] = max(cell.get("sync_end", end), end)
            elif cell["opt_at"] is None or at < cell["opt_at"]:
                cell["arrival"] = max(cell.get("arrival", end), end)
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


def import_traces(source: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write the run record of the profiler traces in ``source`` (:func:`read_traces`) into ``out_dir``."""
    _check_out(out_dir)
    table, _ = read_traces(source)
    return write_record(table, derive(table), Path(source), out_dir, "torch-profiler")


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
    args = parser.parse_args(argv)
    try:
        path = KINDS[args.kind][0](args.file, args.out_dir)
    except TableImportError as e:
        print(f"pace import: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}; next: pace diagnose {Path(args.out_dir)}")
    return 0
