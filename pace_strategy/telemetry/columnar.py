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
``tokens``              int32     tokens trained on (null where not recorded; 0: not known)
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
import time
from collections.abc import Collection, Iterator, Sequence
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
    "SHARD_BATCH_ROWS",
    "RankColumnsError",
    "RankColumnsWriter",
    "iter_shard_rows",
    "rank_columns_filename",
    "read_rank_columns",
    "read_shards",
    "shard_steps",
]

COLUMNS_SCHEMA = "pace_strategy/rank-columns"
COLUMNS_VERSION = 2
#: ``min_batch_rows`` of a node leader's shard (:class:`RankColumnsWriter`): a node's windows are a
#: few hundred rows each. A reader holds a batch of every shard at once (65,536 rows held 3.4 GB of
#: 1,024 shards), and pays ~0.2 ms per batch (16,384: 50k batches at 100k steps x 8,192 ranks)
SHARD_BATCH_ROWS = 16_384
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
INT_COLUMNS = ("gc_collections", "samples", "tokens")


class RankColumnsError(ValueError):
    """The columnar per-rank file of a run record is missing, of another schema, or does not match
    the record's step lines."""


def rank_columns_filename(record_name: str, node: int | None = None) -> str:
    """``pace_run.jsonl`` -> ``pace_run.ranks.arrow`` (and so for every attempt's record); a node
    leader's shard of node ``node``: ``pace_run.ranks.node{node}.arrow``."""
    stem = record_name[: -len(".jsonl")] if record_name.endswith(".jsonl") else record_name
    return f"{stem}.ranks.arrow" if node is None else f"{stem}.ranks.node{node}.arrow"


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
    """Appends each window's per-rank columns to ``path`` (rank 0's telemetry thread; or a node
    leader's shard of its node's ranks). The file is created at the first window; each window is
    flushed.

    Args:
        path: the file.
        world_size: the ranks it holds (all of them, or a node's).
        ranks: their global ranks, ascending (default ``range(world_size)``): the ``rank`` column.
        min_batch_rows: hold windows until they add up to this many rows, or the oldest held is
            ``max_hold_s`` old, then write them as one batch (and at :meth:`close`); 0: a batch per
            window. A reader pays ~0.2 ms per batch whatever its size: a node shard's window of 8
            ranks x 32 steps made 3.2 million batches of 100k steps x 8,192 ranks, minutes to read.
            A crash loses the rows held (at most ``max_hold_s`` of them).
        max_hold_s: see ``min_batch_rows``.
    """

    def __init__(
        self,
        path: str | Path,
        world_size: int,
        ranks: Sequence[int] | None = None,
        *,
        min_batch_rows: int = 0,
        max_hold_s: float = 30.0,
    ) -> None:
        self._pa = _pyarrow()  # fails at start, not at the first window, when pyarrow is missing
        self.path = Path(path)
        self.world_size = world_size
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(world_size))
        if len(self.ranks) != world_size:
            raise ValueError(f"{len(self.ranks)} ranks given for a file of {world_size}")
        self.rows_written = 0
        self.min_batch_rows, self.max_hold_s = min_batch_rows, max_hold_s
        self._held: list[Any] = []  # batches not written yet
        self._held_rows = 0
        self._held_since = 0.0  # time.monotonic() of the oldest held
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

    def write_gathered(self, g: Any, transfer: np.ndarray | None = None) -> None:
        """One record batch straight from a gathered window (``[every rank, steps, NUM_FIELDS]``
        float64, a torch tensor; this file's ranks are taken from it, their leads measured against
        every rank): no per-rank Python objects, the same values as :meth:`write`. ``transfer``:
        each step's smallest wait over every rank, when known (a node leader's, from the nodes'
        reductions: ``core.summary.node_transfer``), else taken from ``g``."""
        from pace_strategy.core import glossary
        from pace_strategy.core.records import Field

        window = g.numpy()
        if window.shape[1] == 0:
            return
        # Only this file's ranks are copied (a node leader's shard: its node of thousands); the
        # leads' reference, the step's smallest wait, is over every rank.
        if transfer is None:
            transfer = glossary.transfer_ms(g[:, :, Field.WAIT_MS], rank_axis=0).numpy()
        # [these ranks, steps, fields]: a view when they are consecutive (every rank, or a node of
        # consecutive ranks), which keeps the window's field-major layout; else a copy of their rows
        lo = self.ranks[0] if self.ranks else 0
        consecutive = self.ranks == tuple(range(lo, lo + len(self.ranks)))
        mine = window[lo : lo + len(self.ranks)] if consecutive else window[list(self.ranks)]

        def column(values: np.ndarray) -> np.ndarray:  # [ranks, steps] -> step-major [steps, ranks]
            return np.ascontiguousarray(values.T)

        columns: dict[str, Any] = {"lead_ms": column(mine[:, :, Field.WAIT_MS] - transfer)}
        fields = {"compute_ms": Field.COMPUTE_MS, "wait_ms": Field.WAIT_MS, "delay_ms": Field.DELAY_MS,
                  "step_ms": Field.STEP_MS, "data_ms": Field.DATA_MS, "gap_ms": Field.GAP_MS,
                  "gc_ms": Field.GC_MS, "opt_ms": Field.OPT_MS, "gc_collections": Field.GC_COLLECTIONS,
                  "samples": Field.SAMPLES, "tokens": Field.TOKENS,
                  "host_bound": Field.HOST_BOUND}  # fmt: skip
        for name, f in fields.items():
            columns[name] = column(mine[:, :, f])
        self.write_rows(window[0, :, Field.STEP].astype(np.int64).tolist(), columns)

    def write_rows(self, steps: Sequence[int], columns: dict[str, Any]) -> None:
        """A window's rows (a record batch of their own, or with the next windows': ``min_batch_rows``)
        from each step's per-rank values: ``columns[name][i]`` is step ``i``'s list
        (or tuple) of one value per rank, empty or ``None`` where the step lacks the column
        (``host_bound``: every rank host-bound); or ``columns[name]`` is a ``[steps, ranks]`` array."""
        if not steps:
            return
        batch = self._batch(steps, columns)
        with self._lock:
            if not self._held:
                self._held_since = time.monotonic()
            self._held.append(batch)
            self._held_rows += batch.num_rows
            if (
                self._held_rows >= self.min_batch_rows
                or time.monotonic() - self._held_since >= self.max_hold_s
            ):
                self._write_held()

    def _write_held(self) -> None:
        """Write the held windows as one batch (under the lock)."""
        if not self._held:
            return
        pa = self._pa
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._sink = pa.OSFile(str(self.path), "wb")
            options = pa.ipc.IpcWriteOptions(compression="zstd")
            self._writer = pa.ipc.new_stream(self._sink, self._schema, options=options)
        if len(self._held) == 1:
            batch = self._held[0]
        else:
            batch = pa.Table.from_batches(self._held).combine_chunks().to_batches()[0]
        self._writer.write_batch(batch)
        self._sink.flush()
        self.rows_written += batch.num_rows
        self._held, self._held_rows = [], 0

    def _batch(self, steps: Sequence[int], columns: dict[str, list[Any]]) -> pa.RecordBatch:
        pa, world, count = self._pa, self.world_size, len(steps)
        n = count * world
        arrays: list[Any] = [
            pa.array(np.repeat(np.asarray(steps, dtype=np.int64), world)),
            pa.array(np.tile(np.asarray(self.ranks, dtype=np.int32), count)),
        ]
        for name in FLOAT_COLUMNS:
            arrays.append(_column(pa, columns.get(name), count, world, np.float32))
        for name in INT_COLUMNS:
            values = _reported(columns.get(name), count, world) if name == "tokens" else columns.get(name)
            arrays.append(_column(pa, values, count, world, np.int32))
        bound = columns.get("host_bound")
        if not isinstance(bound, np.ndarray):
            bound = [b if b else (1,) * world for b in bound or [None] * count]
        arrays.append(pa.array(np.asarray(bound, dtype=bool).reshape(n)))
        return pa.RecordBatch.from_arrays(arrays, schema=self._schema)

    def close(self) -> None:
        with self._lock:
            self._write_held()
            if self._writer is not None:
                self._writer.close()
                self._sink.close()
                self._writer = self._sink = None


def _reported(per_step: Any, steps: int, world: int) -> np.ndarray | None:
    """Tokens as ``[steps, ranks]``, NaN (null) in a step where no rank reported any (0 everywhere):
    the JSON lines leave those steps' ``tokens`` out."""
    if per_step is None:
        return None
    values = np.zeros((steps, world))
    if isinstance(per_step, np.ndarray):
        values[:] = per_step
    else:
        for i, row in enumerate(per_step):
            if row:
                values[i] = row
    values[~values.any(axis=1)] = np.nan
    return values


def _column(pa: Any, per_step: Any, steps: int, world: int, dtype: type) -> Any:
    """One column from each step's per-rank values (or a ``[steps, ranks]`` array); null where a step
    lacks it or a value is not finite (``None`` in a list). Durations are rounded to the microsecond
    first, as in the JSON lines, so that float32 gives back the same numbers (to 3 decimals) up to ~8 s."""
    n = steps * world
    if isinstance(per_step, np.ndarray):
        values = per_step.astype(np.float64, copy=False)
    elif per_step is None or not any(row for row in per_step if row is not None):
        return pa.nulls(n, type=pa.from_numpy_dtype(np.dtype(dtype)))
    else:
        values = np.full((steps, world), np.nan)
        for i, row in enumerate(per_step):
            if row:
                values[i] = row  # numpy reads None as NaN
    flat = np.round(values.reshape(n), 3)
    missing = ~np.isfinite(flat)
    out: np.ndarray = np.where(missing, 0, flat).astype(dtype)
    return pa.array(out, mask=missing if missing.any() else None)


class _FileBatches:
    """The record batches of one per-rank file, a batch at a time: each batch's step labels (one
    per step) and its columns; ``truncated`` once a batch cut off by a crash ended the iteration.
    ``columns``: only these are decompressed (the file's others are skipped); ``[]``: the labels
    only."""

    def __init__(self, path: Path, world_size: int, columns: Sequence[str] | None) -> None:
        self.path, self.world_size = path, world_size
        self.columns = columns
        self.truncated = False

    def __iter__(self) -> Iterator[tuple[np.ndarray, int, Any]]:
        pa, p, world_size = _pyarrow(), self.path, self.world_size
        if not p.is_file():
            raise RankColumnsError(f"{p} is missing: the run record's per-rank columns are written there")
        # read, not memory-mapped: a batch at a time is in memory, not every page of the file read so
        # far (a mapped 1 GB file counted in full in the reader's resident memory)
        with pa.OSFile(str(p)) as source:
            try:
                schema = pa.ipc.open_stream(source).schema
            except pa.ArrowInvalid as error:
                raise RankColumnsError(f"{p} is not an Arrow IPC stream: {error}") from error
            meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
            if meta.get("schema") != COLUMNS_SCHEMA or int(meta.get("version", "0")) > COLUMNS_VERSION:
                raise RankColumnsError(
                    f"{p} holds {meta.get('schema')!r} version {meta.get('version')}; this pace_strategy "
                    f"reads {COLUMNS_SCHEMA!r} up to version {COLUMNS_VERSION}"
                )
            names = [f.name for f in schema]
            wanted = names[2:] if self.columns is None else list(self.columns)
            unknown = set(wanted) - set(names)
            if unknown:
                raise RankColumnsError(f"{p} has no column {sorted(unknown)}")
            # only the columns asked for are decompressed (the step labels always)
            options = pa.ipc.IpcReadOptions(included_fields=[names.index(n) for n in ["step", *wanted]])
            source.seek(0)
            reader = pa.ipc.open_stream(source, options=options)
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                except (pa.ArrowInvalid, OSError):  # a batch cut off by a crash: the rest is intact
                    self.truncated = True
                    break
                if batch.num_rows % world_size:
                    raise RankColumnsError(
                        f"{p}: a batch of {batch.num_rows} rows is not whole steps of {world_size}"
                    )
                # a copy: a view would keep the whole decompressed batch alive until the end
                labels = batch.column("step").to_numpy()[::world_size].copy()
                yield labels, batch.num_rows // world_size, batch


def _values(batch: Any, name: str, count: int, world_size: int, flag: bool) -> np.ndarray:
    """One column of a batch as ``[steps, ranks]``: a flag as bool (null: True), else float64 (null:
    NaN), the durations rounded back to the microsecond as the writer rounded them before float32."""
    column = batch.column(name)
    if flag:
        return column.fill_null(True).to_numpy(zero_copy_only=False).reshape(count, world_size)
    values = column.to_numpy(zero_copy_only=False).reshape(count, world_size).astype(np.float64)
    if name in FLOAT_COLUMNS:
        np.round(values, 3, out=values)
    return values


def read_rank_columns(
    path: str | Path,
    world_size: int,
    columns: Sequence[str] | None = None,
    keep: np.ndarray | None = None,
    flags: Collection[str] = (),
) -> tuple[dict[str, np.ndarray], np.ndarray, bool]:
    """The per-rank file ``path`` as ``[steps, world_size]`` float64 arrays (NaN for null; the
    integer and boolean columns too, but the boolean columns named in ``flags`` as bool arrays,
    null read as True as NaN casts: an eighth of the memory), the labels of every step it holds,
    and whether its last batch was cut off (a crash). ``columns``: only these (column projection;
    default all); ``keep``: only these steps (sorted indices among the file's steps; default all),
    filled batch by batch, so the memory is the arrays returned and one batch; a column null in
    every kept step is then left out. The durations come back rounded to the microsecond, as the
    writer rounded them before float32: the numbers the JSON lines would hold."""
    pa = _pyarrow()
    batches = _FileBatches(Path(path), world_size, columns)
    labels: list[np.ndarray] = []
    # with ``keep``: filled in place, a column's array made at its first value (a column null
    # throughout, as ``gc_ms`` where it was not recorded, is left out of the result); without:
    # every batch's arrays, joined at the end
    out: dict[str, np.ndarray] = {}
    parts: dict[str, list[np.ndarray]] = {}
    filled = 0  # rows of ``out`` written
    first = 0  # the index of the batch's first step among the file's steps
    for batch_labels, count, batch in batches:
        labels.append(batch_labels)
        rows = None
        if keep is not None:
            lo, hi = np.searchsorted(keep, (first, first + count))
            rows = keep[lo:hi] - first
        for name in batch.schema.names[1:]:
            flag = name in flags
            if rows is None:
                parts.setdefault(name, []).append(_values(batch, name, count, world_size, flag))
                continue
            if name not in out and batch.column(name).null_count == batch.num_rows:
                continue  # null so far: no array yet, nothing to convert
            if name not in out:
                assert keep is not None
                out[name] = np.empty((len(keep), world_size), dtype=bool if flag else np.float64)
                out[name][:filled] = True if flag else np.nan
            out[name][filled : filled + len(rows)] = _values(batch, name, count, world_size, flag)[rows]
        filled += count if rows is None else len(rows)
        first += count
    if keep is None:
        wanted = list(columns) if columns is not None else list(parts)
        out = {
            name: np.concatenate(parts[name])
            if parts.get(name)
            else np.empty((0, world_size), dtype=bool if name in flags else np.float64)
            for name in wanted
        }
    # Arrow's allocator keeps the decompressed batches' memory for reuse (1 GB after 100k steps x
    # 1,024 ranks): hand it back, the arrays are numpy's
    pa.default_memory_pool().release_unused()
    steps = np.concatenate(labels).astype(np.int64) if labels else np.empty(0, dtype=np.int64)
    return {name: values[:filled] for name, values in out.items()}, steps, batches.truncated


#: a record's per-rank files: (file name, the global ranks it holds)
Shards = Sequence[tuple[str, Sequence[int]]]


def read_shards(
    directory: Path,
    shards: Shards,
    world_size: int,
    columns: Sequence[str] | None = None,
    keep: np.ndarray | None = None,
    flags: Collection[str] = (),
) -> tuple[dict[str, np.ndarray], np.ndarray, bool]:
    """:func:`read_rank_columns` over a record's files (one for every rank, or a shard per node
    written by its leader), as ``[steps, world_size]`` arrays: the steps every file holds (a shard
    that stops earlier, its leader stopped or crashed first, shortens them all: ``truncated``). A
    column null in every kept step of every file is left out; where only some files have it, the
    others' ranks read NaN (a flag, True)."""
    # Each file's arrays go into the merged ones as soon as it is read (holding every shard's
    # arrays until the last would double the memory of the load).
    out: dict[str, np.ndarray] = {}
    first: np.ndarray | None = None  # the first file's step labels: every file must hold the same
    steps, longest, truncated = 0, 0, False
    for index, (name, ranks) in enumerate(shards):
        cols, labels, cut = read_rank_columns(directory / name, len(ranks), columns, keep, flags)
        if index == 0:
            if list(ranks) == list(range(world_size)):
                return cols, labels, cut
            first, steps = labels, len(labels)
        assert first is not None
        common = min(len(first), len(labels))
        if not np.array_equal(labels[:common], first[:common]):
            raise RankColumnsError(f"{directory / name} holds other steps than {shards[0][0]}: not one run")
        steps, longest, truncated = min(steps, common), max(longest, len(labels)), truncated or cut
        for column, values in cols.items():
            if column not in out:
                capacity = len(keep) if keep is not None else len(first)
                fill = True if column in flags else np.nan
                out[column] = np.full((capacity, world_size), fill, dtype=bool if column in flags else None)
            held = min(len(values), len(out[column]))
            out[column][:held, list(ranks)] = values[:held]
    assert first is not None
    rows = int(np.searchsorted(keep, steps)) if keep is not None else steps  # the kept steps all hold
    return {k: v[:rows] for k, v in out.items()}, first[:steps], truncated or longest > steps


def shard_steps(directory: Path, shards: Shards, world_size: int) -> tuple[np.ndarray, bool]:
    """The step labels every file of a record holds (only the ``step`` column is decompressed), and
    whether one of them stops short of another or was cut off (``truncated``)."""
    first: np.ndarray | None = None
    steps, longest, truncated = 0, 0, False
    for name, ranks in shards:
        batches = _FileBatches(directory / name, len(ranks), [])
        labels = np.concatenate([b[0] for b in batches] or [np.empty(0, dtype=np.int64)]).astype(np.int64)
        if first is None:
            first, steps = labels, len(labels)
        common = min(len(first), len(labels))
        if not np.array_equal(labels[:common], first[:common]):
            raise RankColumnsError(f"{directory / name} holds other steps than {shards[0][0]}: not one run")
        steps, longest = min(steps, common), max(longest, len(labels))
        truncated = truncated or batches.truncated
    assert first is not None
    return first[:steps], truncated or longest > steps


def iter_shard_rows(
    directory: Path,
    shards: Shards,
    world_size: int,
    columns: Sequence[str],
    flags: Collection[str] = (),
    steps: int | None = None,
    chunk_steps: int = 256,
) -> Iterator[dict[str, np.ndarray]]:
    """The record's per-rank ``columns`` (every file merged into ``[steps, world_size]`` arrays, as
    :func:`read_shards` gives them) ``chunk_steps`` steps at a time, in order, for the first
    ``steps`` steps (default: every step the files all hold): the memory is a chunk, not the run.
    Each file's rows of a chunk are converted together: a node shard holds a few ranks (a batch per
    window of 32 steps x 8 ranks in records written before the shards held their windows), and
    converting every column of every file's every batch on its own costs more than the numbers
    (about 29 million conversions at 100k steps x 8,192 ranks)."""
    pa = _pyarrow()
    files = [iter(_FileBatches(directory / name, len(ranks), columns)) for name, ranks in shards]
    # where each file's ranks go: a slice where they are consecutive (a node's), else their indices
    ranks_of: list[slice | np.ndarray] = [
        slice(r[0], r[0] + len(r)) if list(r) == list(range(r[0], r[0] + len(r))) else np.asarray(r)
        for _, r in shards
    ]
    whole = len(shards) == 1 and list(shards[0][1]) == list(range(world_size))
    # each file's rows read but not handed out yet: its batches (the first maybe sliced) and steps
    pending: list[list[Any]] = [[] for _ in files]
    held = [0] * len(files)
    ended = False
    done = 0
    while not ended and (steps is None or done < steps):
        want = chunk_steps if steps is None else min(chunk_steps, steps - done)
        for i, batches in enumerate(files):
            while held[i] < want:
                batch = next(batches, None)
                if batch is None:  # this file ends here: the steps every file holds end here too
                    ended = True
                    break
                _, count, b = batch
                pending[i].append(b)
                held[i] += count
        take = min(want, *held)
        if take == 0:
            break
        out: dict[str, np.ndarray] = {}
        for i, ranks in enumerate(ranks_of):
            n = len(shards[i][1])
            table = pa.Table.from_batches(pending[i])
            rows = table.slice(0, take * n)
            for name in columns:
                values = _values(rows, name, take, n, name in flags)
                if whole:
                    out[name] = values
                    continue
                if name not in out:
                    flag = name in flags
                    out[name] = np.full(
                        (take, world_size), True if flag else np.nan, dtype=bool if flag else None
                    )
                out[name][:, ranks] = values
            rest = table.slice(take * n)
            pending[i] = rest.to_batches() if rest.num_rows else []
            held[i] -= take
        done += take
        yield out
    pa.default_memory_pool().release_unused()
