"""The columnar per-rank record (``record_format: arrow``): every rank's numbers of every step as Arrow.

With it, the JSON-lines run record becomes the small global stream (header, each step's summary,
decisions, shares, hangs, end) and the per-rank columns of each step go to an Arrow IPC *stream*
file beside it, ``pace_run.ranks.arrow`` (``pace_run.restart{k}.ranks.arrow`` for a restarted
attempt), one record batch per window, one row per (step, rank), step-major:

======================  ========  ==========================================================
column                  type      meaning
======================  ========  ==========================================================
``step``                int64     the step's label (as in the step line)
``rank``                int32     the rank
``lead_ms`` ...         float32   ``lead_ms``, ``compute_ms``, ``wait_ms``, ``delay_ms``,
                                  ``step_ms``, ``data_ms``, ``gap_ms``, ``gc_ms``, ``opt_ms``:
                                  as the step line's ``ranks`` lists; null where not finite
                                  (``gc_ms`` and ``opt_ms`` null where not recorded)
``gc_collections``      int32     collections in the step (null where not recorded)
``samples``             int32     samples trained on (null where not recorded)
``host_bound``          bool      the host was the step's bottleneck on that rank
======================  ========  ==========================================================

Why Arrow IPC: pandas, polars, DuckDB and pyarrow read it without this package
(``pyarrow.ipc.open_stream(path).read_all()``), it memory-maps, and each batch is written and
flushed as its window is, so a crash loses at most the batch being written (the stream format needs
no footer; a reader stops at the first incomplete batch). float32 keeps microsecond resolution up to
~100 s per step; batches are compressed with zstd. Bytes per rank-step: ``benchmarks/scale.py``.
Needs the ``arrow`` extra (``pip install pace-strategy[arrow]``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

    from pace_strategy.core.records import StepSummary

__all__ = [
    "COLUMNS_SCHEMA",
    "COLUMNS_VERSION",
    "FLOAT_COLUMNS",
    "RankColumnsError",
    "RankColumnsWriter",
    "rank_columns_filename",
    "read_rank_columns",
]

COLUMNS_SCHEMA = "pace_strategy/rank-columns"
COLUMNS_VERSION = 1
#: the float32 columns, named as the step line's ``ranks`` lists; the StepSummary attribute of each
FLOAT_COLUMNS: dict[str, str] = {
    "lead_ms": "lead_ms",
    "compute_ms": "compute_ms",
    "wait_ms": "wait_ms",
    "delay_ms": "delay_ms",
    "step_ms": "rank_step_ms",
    "data_ms": "data_ms",
    "gap_ms": "gap_ms",
    "gc_ms": "gc_ms",
    "opt_ms": "opt_ms",
}
INT_COLUMNS = ("gc_collections", "samples")


class RankColumnsError(ValueError):
    """The columnar per-rank file of a run record is missing, of another schema, or does not match
    the record's step lines."""


def rank_columns_filename(record_name: str) -> str:
    """``pace_run.jsonl`` -> ``pace_run.ranks.arrow`` (and so for every attempt's record)."""
    stem = record_name[: -len(".jsonl")] if record_name.endswith(".jsonl") else record_name
    return f"{stem}.ranks.arrow"


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
    except ImportError as error:
        raise ImportError(
            "record_format 'arrow' needs pyarrow: pip install 'pace-strategy[arrow]' (or pyarrow)"
        ) from error
    return pyarrow


def _schema(pa: Any, world_size: int) -> pa.Schema:
    fields = [pa.field("step", pa.int64(), nullable=False), pa.field("rank", pa.int32(), nullable=False)]
    fields += [pa.field(name, pa.float32()) for name in FLOAT_COLUMNS]
    fields += [pa.field(name, pa.int32()) for name in INT_COLUMNS]
    fields.append(pa.field("host_bound", pa.bool_()))
    metadata = {"schema": COLUMNS_SCHEMA, "version": str(COLUMNS_VERSION), "world_size": str(world_size)}
    return pa.schema(fields, metadata=metadata)


class RankColumnsWriter:
    """Appends each window's per-rank columns to ``path`` (rank 0's telemetry thread). The file is
    created at the first window; each window is flushed."""

    def __init__(self, path: str | Path, world_size: int) -> None:
        self._pa = _pyarrow()  # fails at start, not at the first window, when pyarrow is missing
        self.path = Path(path)
        self.world_size = world_size
        self.rows_written = 0
        self._schema = _schema(self._pa, world_size)
        self._sink: Any = None
        self._writer: Any = None
        self._lock = threading.Lock()

    def write(self, summaries: Sequence[StepSummary]) -> None:
        """One record batch: every rank of every step in ``summaries``."""
        if not summaries:
            return
        columns: dict[str, list[tuple[Any, ...]]] = {
            name: [getattr(s, attribute) for s in summaries] for name, attribute in FLOAT_COLUMNS.items()
        }
        for name in INT_COLUMNS:
            columns[name] = [getattr(s, name) for s in summaries]
        columns["host_bound"] = [s.host_bound for s in summaries]
        self.write_rows([s.step for s in summaries], columns)

    def write_rows(self, steps: Sequence[int], columns: dict[str, list[Any]]) -> None:
        """One record batch from each step's per-rank values: ``columns[name][i]`` is step ``i``'s list
        (or tuple) of one value per rank, empty or ``None`` where the step lacks the column
        (``host_bound``: every rank host-bound)."""
        if not steps:
            return
        batch = self._batch(steps, columns)
        with self._lock:
            if self._writer is None:
                pa = self._pa
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._sink = pa.OSFile(str(self.path), "wb")
                options = pa.ipc.IpcWriteOptions(compression="zstd")
                self._writer = pa.ipc.new_stream(self._sink, self._schema, options=options)
            self._writer.write_batch(batch)
            self._sink.flush()
            self.rows_written += batch.num_rows

    def _batch(self, steps: Sequence[int], columns: dict[str, list[Any]]) -> pa.RecordBatch:
        pa, world, count = self._pa, self.world_size, len(steps)
        n = count * world
        arrays: list[Any] = [
            pa.array(np.repeat(np.asarray(steps, dtype=np.int64), world)),
            pa.array(np.tile(np.arange(world, dtype=np.int32), count)),
        ]
        for name in FLOAT_COLUMNS:
            arrays.append(_column(pa, columns.get(name) or [None] * count, world, np.float32))
        for name in INT_COLUMNS:
            arrays.append(_column(pa, columns.get(name) or [None] * count, world, np.int32))
        bound = [b if b else (1,) * world for b in columns.get("host_bound") or [None] * count]
        arrays.append(pa.array(np.asarray(bound, dtype=bool).reshape(n)))
        return pa.RecordBatch.from_arrays(arrays, schema=self._schema)

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._sink.close()
                self._writer = self._sink = None


def _column(pa: Any, per_step: Sequence[Any], world: int, dtype: type) -> Any:
    """One column from each step's per-rank values; null where a step lacks it or a value is not
    finite (``None`` in a list). Durations are rounded to the microsecond first, as in the JSON lines,
    so that float32 gives back the same numbers (to 3 decimals) up to ~8 s."""
    n = len(per_step) * world
    if not any(row for row in per_step if row is not None):
        return pa.nulls(n, type=pa.from_numpy_dtype(np.dtype(dtype)))
    values = np.full((len(per_step), world), np.nan)
    for i, row in enumerate(per_step):
        if row:
            values[i] = row  # numpy reads None as NaN
    flat = np.round(values.reshape(n), 3)
    missing = ~np.isfinite(flat)
    out: np.ndarray = np.where(missing, 0, flat).astype(dtype)
    return pa.array(out, mask=missing if missing.any() else None)


def read_rank_columns(
    path: str | Path, world_size: int, columns: Sequence[str] | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray, bool]:
    """The per-rank file ``path`` as ``[steps, world_size]`` arrays (float64, NaN for null; the
    integer and boolean columns too), the step labels ``[steps]``, and whether its last batch was cut
    off (a crash). ``columns``: only these (column projection); default all."""
    pa = _pyarrow()
    p = Path(path)
    if not p.is_file():
        raise RankColumnsError(f"{p} is missing: the run record's per-rank columns are written there")
    batches = []
    truncated = False
    with pa.memory_map(str(p)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid as error:
            raise RankColumnsError(f"{p} is not an Arrow IPC stream: {error}") from error
        meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
        if meta.get("schema") != COLUMNS_SCHEMA or int(meta.get("version", "0")) > COLUMNS_VERSION:
            raise RankColumnsError(
                f"{p} holds {meta.get('schema')!r} version {meta.get('version')}; this pace_strategy reads "
                f"{COLUMNS_SCHEMA!r} up to version {COLUMNS_VERSION}"
            )
        wanted = list(columns) if columns is not None else [f.name for f in reader.schema][2:]
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError):  # a batch cut off by a crash: the rest is intact
                truncated = True
                break
            batches.append(batch.select(["step", *wanted]))
    rows = sum(b.num_rows for b in batches)
    if rows % world_size:
        raise RankColumnsError(f"{p} has {rows} rows, not a whole number of steps of {world_size} ranks")
    steps = rows // world_size
    out: dict[str, np.ndarray] = {}
    for name in wanted:
        column = np.empty(rows, dtype=np.float64)
        at = 0
        for b in batches:
            chunk = b.column(name)
            column[at : at + len(chunk)] = chunk.to_numpy(zero_copy_only=False)
            at += len(chunk)
        out[name] = column.reshape(steps, world_size)
    labels = np.empty(steps, dtype=np.int64)
    at = 0
    for b in batches:
        step = b.column("step").to_numpy()[::world_size]
        labels[at : at + len(step)] = step
        at += len(step)
    return out, labels, truncated
