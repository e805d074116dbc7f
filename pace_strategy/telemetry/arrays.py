"""A run record as numpy arrays (steps x ranks), built in one pass over the JSON lines."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pace_strategy.telemetry.run_record import (
    RECORD_FILENAME,
    TRUNCATED,
    RunRecordError,
    attempt_number,
    attempt_records,
    iter_run_record,
    rank_columns_of,
    read_run_record,
)
from pace_strategy.telemetry.topology import MESH_KEYS

__all__ = [
    "BLOCK_FIELDS",
    "DIAGNOSIS_SKIP",
    "OPTIONAL_BLOCK_FIELDS",
    "RANK_AXIS",
    "RowSource",
    "RunArrays",
    "RunLines",
    "find_run_record",
    "load_arrays",
    "load_lines",
    "load_timeline",
    "load_timeline_lines",
    "sample_arrays",
    "sample_steps",
    "timeline_records",
]

_Run = TypeVar("_Run", bound="RunLines")

#: per-rank arrays are ``[steps, ranks]``: the axis the glossary functions reduce over
RANK_AXIS = 1

_RANK_FIELDS = ("wait_ms", "compute_ms", "data_ms", "gap_ms")
#: per-rank fields a reader may leave out (``load_arrays(skip=...)``): the RunArrays field and the
#: record's name. No check of the diagnosis reads either: the step's time is the slowest rank's
#: (``step_ms``), and the report plots the step's largest delay (``delay_max``).
_SKIPPABLE = {"rank_step": "step_ms", "delay": "delay_ms"}
#: what a diagnosis of a run loaded whole can leave out: each is a [steps, ranks] array (819 MB at
#: 100k steps x 1,024 ranks). ``pace diagnose`` itself holds no such array (:meth:`RunLines.rank_blocks`)
DIAGNOSIS_SKIP = ("rank_step", "delay")
#: per-rank fields that later records add: loaded when every kept step has them, else left ``None``
_OPTIONAL_RANK_FIELDS = ("gc_ms", "gc_collections", "samples", "opt_ms", "tokens")


#: the per-rank fields :meth:`RunLines.rank_blocks` yields: the :class:`RunArrays` attribute and the
#: record's name
BLOCK_FIELDS = {
    "wait": "wait_ms",
    "compute": "compute_ms",
    "data": "data_ms",
    "gap": "gap_ms",
    "opt": "opt_ms",
    "gc_ms": "gc_ms",
    "gc_collections": "gc_collections",
    "samples": "samples",
    "tokens": "tokens",
    "host_bound": "host_bound",
}
#: of those, the ones a block leaves out where some of its steps lack them (or, in a columnar file,
#: hold a null)
OPTIONAL_BLOCK_FIELDS = ("opt", "gc_ms", "gc_collections", "samples", "tokens")
#: numbers per block of :meth:`RunLines.rank_blocks` (steps x ranks): 1 Mi (8 MB a float64 field)
_BLOCK_NUMBERS = 1 << 20
#: numbers of one file a columnar read converts at once, at least
_CONVERTED = 8192


@dataclass(frozen=True)
class RowSource:
    """Where one record's per-rank numbers are: its file, its columnar files (``None``: in its step
    lines), and which of its step lines are kept (warm-up and invalid steps are not)."""

    path: Path
    columnar: list[tuple[str, list[int]]] | None
    kept: np.ndarray  #: indices of the kept steps among the record's step lines, ascending


@dataclass(kw_only=True)
class RunLines:
    """Post-warm-up, valid steps of one run: every line of its record but the per-rank numbers,
    which :meth:`rank_blocks` reads a block of steps at a time (the memory of a block, not the run:
    ``pace diagnose`` reads 100k steps x 8,192 ranks this way)."""

    path: Path
    header: dict[str, Any]
    end: dict[str, Any] | None
    truncated: bool
    total_steps: int  #: every step line in the record, warm-up and invalid included
    step: np.ndarray  #: [S] global step
    step_ms: np.ndarray  #: [S] slowest rank's step time
    pacing_active: np.ndarray  #: [S] bool
    decisions: list[dict[str, Any]]
    #: [S] the largest delay of the step (the step lines' ``delay_ms_max``; NaN where not written)
    delay_max: np.ndarray | None = None
    shares: list[dict[str, Any]] = field(default_factory=list)  #: the record's ``shares`` lines
    hangs: list[dict[str, Any]] = field(default_factory=list)  #: the record's ``hang`` lines
    #: every attempt of an elastically restarted job whose record lies beside this one (this one
    #: included, ``"this": true``), first attempt first: path, restart_count, status, error, steps, hangs
    attempts: list[dict[str, Any]] = field(default_factory=list)
    #: a run and its resumptions read as one timeline (:func:`load_timeline`): one entry per record,
    #: oldest first (path, status, steps, first/last step, the resume line); empty for one record
    segments: list[dict[str, Any]] = field(default_factory=list)
    #: where the steps' per-rank numbers are read from, one entry per record of the timeline
    sources: list[RowSource] = field(default_factory=list)
    #: the steps kept by :meth:`select`, as indices among the sources' kept steps (None: all)
    rows: np.ndarray | None = None

    @property
    def world_size(self) -> int:
        return int(self.header["world_size"])

    @property
    def steps(self) -> int:
        return int(self.step.shape[0])

    def select(self: _Run, keep: np.ndarray) -> _Run:
        """The same run restricted to the steps where ``keep`` (``[S]`` bool, or step indices) holds:
        every per-step array, the optional ones included; the record's lines stay whole."""
        per_step = {
            f.name: getattr(self, f.name)[keep]
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), np.ndarray) and f.name != "rows"
        }
        rows = (np.arange(self.steps) if self.rows is None else self.rows)[keep]
        return dataclasses.replace(self, **per_step, rows=rows)

    @property
    def step_delay_max(self) -> np.ndarray:
        """``[S]`` each step's largest pacing delay, ms: the step lines' ``delay_ms_max`` (0 where
        they do not say)."""
        return np.nan_to_num(self.delay_max) if self.delay_max is not None else np.zeros(self.steps)

    def topology(self, key: str) -> list[Any]:
        """One topology field per rank (``host``, ``node_rank``, ``local_rank`` ...)."""
        topo = {int(t["rank"]): t for t in self.header.get("topology", [])}
        return [topo.get(r, {}).get(key) for r in range(self.world_size)]

    def describe_rank(self, rank: int) -> str:
        """``rank R (host H, local rank L, dp_replicate 0, dp_shard 1, ...)``: where the rank runs and,
        where the record has them, its coordinates in the training's device mesh (which replica,
        which shard, which tensor-parallel group or pipeline stage it belongs to)."""
        host, local = self.topology("host")[rank], self.topology("local_rank")[rank]
        parts = [f"host {host}" if host else None, f"local rank {local}" if local is not None else None]
        parts += [f"{key} {c}" for key in MESH_KEYS if (c := self.topology(key)[rank]) is not None]
        inner = ", ".join(p for p in parts if p)
        return f"rank {rank} ({inner})" if inner else f"rank {rank}"

    def lines_only(self) -> RunLines:
        """The run's lines alone (of a :class:`RunArrays`: without its per-rank arrays)."""
        return RunLines(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RunLines)})

    def block_steps(self) -> int:
        """Steps per block of :meth:`rank_blocks`."""
        return max(1, _BLOCK_NUMBERS // max(self.world_size, 1))

    def rank_blocks(self) -> Iterator[dict[str, np.ndarray]]:
        """The steps' per-rank numbers, in order, a block of steps at a time: ``[block steps, ranks]``
        arrays by :data:`BLOCK_FIELDS` name (float64, ms; ``host_bound`` bool), the numbers
        :func:`load_arrays` would hold in the same rows. A block leaves out each field of
        :data:`OPTIONAL_BLOCK_FIELDS` that some of its steps lack."""
        wanted = np.arange(self.steps) if self.rows is None else np.asarray(self.rows)
        offset = 0
        for source in self.sources:
            n = len(source.kept)
            mine = wanted[(wanted >= offset) & (wanted < offset + n)] - offset
            offset += n
            if len(mine):
                yield from _source_blocks(source, self.world_size, source.kept[mine], self.block_steps())


@dataclass(kw_only=True)
class RunArrays(RunLines):
    """A run's lines and its per-rank numbers in memory: ``[steps, ranks]`` float64 arrays, ms."""

    wait: np.ndarray
    compute: np.ndarray
    data: np.ndarray
    gap: np.ndarray
    #: [S, ranks] pacing delay each rank applied; None: not loaded (:func:`load_arrays`'s ``skip``)
    delay: np.ndarray | None = None
    #: [S, ranks] each rank's own step time; None: not loaded (:func:`load_arrays`'s ``skip``)
    rank_step: np.ndarray | None = None
    gc_ms: np.ndarray | None = None  #: [S, ranks] time in the garbage collector; None: not recorded
    gc_collections: np.ndarray | None = None  #: [S, ranks] collections per step; None: not recorded
    #: [S, ranks] samples each rank trained on (0: not reported); None: not recorded
    samples: np.ndarray | None = None
    #: [S, ranks] tokens each rank trained on (0: not reported); None: not recorded
    tokens: np.ndarray | None = None
    #: [S, ranks] collective completion -> step end (optimizer step, hooks); None: not recorded
    opt: np.ndarray | None = None
    #: ``[steps, ranks]`` bool: the host was the bottleneck of the step on that rank (its device had
    #: reached the arrival when the host ended the step); all true on CPU and in older records
    host_bound: np.ndarray | None = None

    @classmethod
    def of(cls, lines: RunLines, **numbers: Any) -> RunArrays:
        """``lines`` (their fields) with the per-rank ``numbers`` (this class's own fields)."""
        return cls(**{f.name: getattr(lines, f.name) for f in dataclasses.fields(RunLines)}, **numbers)

    @property
    def step_delay_max(self) -> np.ndarray:
        """``[S]`` each step's largest pacing delay, ms: from the per-rank delays when loaded, else
        the step lines' ``delay_ms_max`` (0 where neither says)."""
        if self.delay is not None:
            return self.delay.max(axis=1) if self.delay.size else np.zeros(self.steps)
        return super().step_delay_max

    def rank_blocks(self) -> Iterator[dict[str, np.ndarray]]:
        """As :meth:`RunLines.rank_blocks`, views of the arrays held."""
        held = {k: getattr(self, k) for k in BLOCK_FIELDS if getattr(self, k) is not None}
        step = self.block_steps()
        for i in range(0, self.steps, step):
            yield {k: v[i : i + step] for k, v in held.items()}


def sample_steps(steps: int, size: int, seed: int = 0) -> np.ndarray:
    """``size`` of ``steps`` step indices drawn with ``seed``, ascending; every step of a run of at
    most ``size``."""
    if steps <= size:
        return np.arange(steps)
    return np.sort(np.random.default_rng(seed).choice(steps, size=size, replace=False))


def sample_arrays(a: RunLines, rows: np.ndarray) -> RunArrays:
    """The steps ``rows`` of ``a`` (indices among its steps, ascending) with their per-rank numbers
    in memory, read a block at a time (:meth:`RunLines.rank_blocks`): a sample of a run too large to
    load whole (``pace simulate --from-run --calibration-steps``)."""
    chosen = a.select(rows)
    blocks = list(chosen.rank_blocks())

    def joined(name: str) -> np.ndarray | None:
        if not blocks:
            return np.zeros((0, a.world_size))
        parts = [b.get(name) for b in blocks]
        return None if any(p is None for p in parts) else np.concatenate(parts)  # type: ignore[arg-type]

    return RunArrays.of(
        chosen,
        wait=joined("wait"),
        compute=joined("compute"),
        data=joined("data"),
        gap=joined("gap"),
        opt=joined("opt"),
        gc_ms=joined("gc_ms"),
        gc_collections=joined("gc_collections"),
        samples=joined("samples"),
        tokens=joined("tokens"),
        host_bound=joined("host_bound"),
    )


def _source_blocks(
    source: RowSource, world: int, kept: np.ndarray, block: int
) -> Iterator[dict[str, np.ndarray]]:
    """The per-rank numbers of one record's step lines ``kept`` (indices among its step lines,
    ascending), ``block`` steps at a time."""
    if source.columnar is None:
        yield from _json_blocks(source.path, world, kept, block)
        return
    from pace_strategy.telemetry.columnar import iter_shard_rows

    names = [BLOCK_FIELDS[k] for k in BLOCK_FIELDS]
    parts: list[dict[str, np.ndarray]] = []
    held, first = 0, 0  # rows in ``parts``; the file's index of the next row read
    # a file's conversions of a chunk cover at least 8,192 numbers (a node shard of 8 ranks: 1,024
    # steps), else their overhead costs more than the numbers
    narrowest = min(len(ranks) for _, ranks in source.columnar)
    chunk = max(block, min(4096, _CONVERTED // max(narrowest, 1)))
    chunks = iter_shard_rows(
        source.path.parent,
        source.columnar,
        world,
        names,
        flags=("host_bound",),
        steps=int(kept[-1]) + 1,
        chunk_steps=chunk,
    )
    for values in chunks:
        count = len(values["wait_ms"])
        lo, hi = np.searchsorted(kept, (first, first + count))
        rows = kept[lo:hi] - first
        first += count
        if hi > lo:
            # consecutive rows (every step kept): views, no copy
            take = slice(int(rows[0]), int(rows[-1]) + 1) if rows[-1] - rows[0] == hi - lo - 1 else rows
            parts.append({k: values[name][take] for k, name in BLOCK_FIELDS.items()})
            held += hi - lo
        while held >= block:  # whole blocks out, the rest kept for the next
            joined = _joined(parts)
            yield _columnar_block({k: v[:block] for k, v in joined.items()})
            parts, held = [{k: v[block:] for k, v in joined.items()}], held - block
    if held:
        yield _columnar_block(_joined(parts))


def _joined(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in parts[0]}


def _columnar_block(out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A block of a columnar file's rows, an optional field with a null (NaN) left out, as
    :func:`load_arrays` leaves it out of the run."""
    for k in OPTIONAL_BLOCK_FIELDS:
        if np.isnan(out[k]).any():
            del out[k]
    return out


def _json_blocks(path: Path, world: int, kept: np.ndarray, block: int) -> Iterator[dict[str, np.ndarray]]:
    """The ``ranks`` lists of a record's step lines ``kept``, ``block`` steps at a time, each line's
    lists written into the block's arrays as it is read (held as Python objects, a block of 65k
    steps x 64 ranks took 1.3 GB): :func:`load_arrays`' reading of them, a block at a time."""
    names = [name for k, name in BLOCK_FIELDS.items() if k != "host_bound"]
    lists: _RankLists | None = None
    index, at = -1, 0  # the step line's index; the next kept index to reach
    for obj in iter_run_record(path):
        if obj.get("record") != "step":
            continue
        index += 1
        if at == len(kept):
            break
        if index != kept[at]:
            continue
        at += 1
        if lists is None:
            lists = _RankLists(world, min(block, len(kept) - at + 1), names)
        lists.add(obj["ranks"])
        if lists.host_bound.rows == lists.host_bound.capacity:
            yield lists.block(BLOCK_FIELDS)
            lists = None


def find_run_record(run_dir: str | os.PathLike[str]) -> Path:
    """The run record in ``run_dir``: the directory's own, or the single one below it.

    A directory that holds the records of several attempts of an elastically restarted job
    (``pace_run.jsonl``, ``pace_run.restart1.jsonl``, ...) gives the latest attempt's; the diagnosis
    notes the others (``RunArrays.attempts``)."""
    p = Path(run_dir)
    if p.is_file():
        return p
    if not p.exists():
        raise RunRecordError(f"{p} does not exist")
    if attempts := attempt_records(p):
        return attempts[-1]
    found = sorted({f.parent for f in p.rglob("pace_run*.jsonl") if attempt_number(f.name) is not None})
    if not found:
        raise RunRecordError(
            f"no {RECORD_FILENAME} in {p} or below it: is this a pace_strategy run directory?"
        )
    if len(found) > 1:
        listing = "\n".join(f"  {d}" for d in found)
        raise RunRecordError(f"{len(found)} run records under {p}; pass one of these directories:\n{listing}")
    return attempt_records(found[0])[-1]


def _attempts(p: Path, this: dict[str, Any]) -> list[dict[str, Any]]:
    """How every attempt of the job whose record is ``p`` ended (``this``: p's own, already read),
    from the records beside it; empty for a job that was never restarted."""
    paths = attempt_records(p.parent)
    if len(paths) < 2 or p not in paths:
        return []
    out = []
    for path in paths:
        if path == p:
            out.append(this)
            continue
        try:
            record = read_run_record(path)
        except RunRecordError as error:
            number = attempt_number(path.name)
            out.append({"path": str(path), "restart_count": number, "status": f"unreadable: {error}"})
            continue
        end = record.end or {}
        out.append(
            {
                "path": str(path),
                "restart_count": record.restart_count,
                "status": str(end.get("status", "no end line")),
                "error": end.get("error"),
                "steps": len(record.steps),
                "hangs": record.hangs,
                "this": False,
            }
        )
    return out


class _Column:
    """One per-rank field of the kept steps, written row by row into an array of ``capacity`` rows
    (the record's line count: an upper bound of its steps). Pages that no row reaches are never
    touched, so they cost no memory.

    Python lists of each step's values held every number as an object until the end, about six times
    the finished arrays (a 20,000-step, 64-rank record: 378 MB above the interpreter for 63 MB of
    arrays); written into place, the load holds the arrays and little else."""

    def __init__(self, world: int, capacity: int, dtype: type = np.float64) -> None:
        self._array: np.ndarray | None = None
        self.world, self.capacity, self.dtype = world, capacity, dtype
        self.rows = 0

    def add(self, values: Sequence[Any]) -> None:
        if self._array is None:  # at the first value: an optional field may never come
            self._array = np.empty((self.capacity, self.world), dtype=self.dtype)
        self._array[self.rows] = values  # None (a non-finite value written as null) becomes NaN
        self.rows += 1

    def array(self) -> np.ndarray:
        if self._array is None:
            return np.empty((0, self.world), dtype=self.dtype)
        return self._array[: self.rows]


def _line_count(p: Path) -> int:
    """Lines in the file (the last one may lack its newline): at least its step lines."""
    count = 1
    with p.open("rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
    return count


@dataclass
class _Lines:
    """What one pass over a record's lines gathers (the per-rank lists too, when collected)."""

    header: dict[str, Any]
    columnar: list[tuple[str, list[int]]] | None
    kept: list[int] = field(default_factory=list)  #: the kept steps' indices among the step lines
    steps: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    active: list[bool] = field(default_factory=list)
    delay_max: list[float | None] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    hangs: list[dict[str, Any]] = field(default_factory=list)
    shares: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    truncated: bool = False
    total: int = 0
    lists: _RankLists | None = None

    def cut(self, rows: int) -> None:
        """Keep the first ``rows`` kept steps (the rest have no per-rank rows: a crash between the
        two files)."""
        if rows < len(self.steps):
            self.truncated = True
            for name in ("kept", "steps", "step_ms", "active", "delay_max"):
                setattr(self, name, getattr(self, name)[:rows])

    def run(self, p: Path, **per_rank: Any) -> dict[str, Any]:
        """The :class:`RunLines` fields (``per_rank``: the :class:`RunArrays` ones to add)."""
        end, hangs, header, total = self.end, self.hangs, self.header, self.total
        return dict(
            path=p,
            header=header,
            end=end,
            truncated=self.truncated,
            total_steps=total,
            step=np.asarray(self.steps, dtype=np.int64),
            delay_max=np.asarray(self.delay_max, dtype=np.float64),
            step_ms=np.asarray(self.step_ms, dtype=np.float64),
            pacing_active=np.asarray(self.active, dtype=bool),
            decisions=self.decisions,
            shares=self.shares,
            hangs=hangs,
            attempts=_attempts(
                p,
                {
                    "path": str(p),
                    "restart_count": int(header.get("restart_count", 0)),
                    "status": str((end or {}).get("status", "no end line")),
                    "error": (end or {}).get("error"),
                    "steps": total,
                    "hangs": hangs,
                    "this": True,
                },
            ),
            sources=[RowSource(p, self.columnar, np.asarray(self.kept, dtype=np.int64))],
            **per_rank,
        )


class _RankLists:
    """The ``ranks`` lists of a JSON-lines record's kept steps, field by field (the ``fields``), as
    they are read."""

    def __init__(self, world: int, capacity: int, fields: Sequence[str]) -> None:
        self.columns = {k: _Column(world, capacity) for k in fields}
        self.host_bound = _Column(world, capacity, bool)
        self.every_rank_bound = [True] * world

    def add(self, ranks: dict[str, Any]) -> None:
        for k, column in self.columns.items():
            if k in ranks or k not in _OPTIONAL_RANK_FIELDS:
                column.add(ranks[k])
        # a step line without ``host_bound`` had every rank host-bound (the writer omits it
        # then; CPU runs and records written before the field never have it)
        self.host_bound.add(ranks.get("host_bound") or self.every_rank_bound)

    def block(self, fields: dict[str, str]) -> dict[str, np.ndarray]:
        """The steps read, by ``fields``' keys (their record names the values): a field some step
        lacked is left out."""
        rows = self.host_bound.rows
        out = {k: self.columns[name].array() for k, name in fields.items() if name in self.columns}
        out = {k: v for k, v in out.items() if len(v) == rows}
        out["host_bound"] = self.host_bound.array()
        return out


def _read_lines(p: Path, fields: Sequence[str] = ()) -> _Lines:
    """One pass over the record ``p``: its lines, and with ``fields`` these per-rank fields of a
    JSON-lines record's kept steps (``lists``; a columnar record's step lines have none)."""
    objs = iter_run_record(p)
    header = next(objs)
    out = _Lines(header=header, columnar=rank_columns_of(header))
    if fields and out.columnar is None:
        out.lists = _RankLists(int(header["world_size"]), _line_count(p), fields)
    for obj in objs:
        kind = obj.get("record")
        if kind == "step":
            out.total += 1
            if not obj["valid"] or obj["warmup"]:
                continue
            out.kept.append(out.total - 1)
            out.steps.append(obj["step"])
            out.step_ms.append(obj["step_ms"])
            out.delay_max.append(obj.get("delay_ms_max"))
            out.active.append(obj["pacing_active"])
            if out.lists is not None:
                out.lists.add(obj["ranks"])
        elif kind == "decision":
            out.decisions.append(obj)
        elif kind == "hang":
            out.hangs.append(obj)
        elif kind == "shares":
            out.shares.append(obj)
        elif kind == "end":
            out.end = obj
        elif kind == TRUNCATED:
            out.truncated = True
    return out


def load_lines(path: str | os.PathLike[str]) -> RunLines:
    """A run record (file or directory) without its per-rank numbers: every line, and where to
    read the numbers (:meth:`RunLines.rank_blocks`). Of a columnar record only the step labels of its
    per-rank files are read here (checked against the step lines)."""
    p = find_run_record(path)
    lines = _read_lines(p)
    if lines.columnar is not None:
        from pace_strategy.telemetry.columnar import RankColumnsError, shard_steps

        try:
            written, _ = shard_steps(p.parent, lines.columnar, lines.header["world_size"])
        except RankColumnsError as error:
            raise RunRecordError(str(error)) from error
        index = np.asarray(lines.kept, dtype=np.int64)
        rows = int(np.searchsorted(index, len(written)))
        _check_labels(p.parent / lines.columnar[0][0], written, index[:rows], lines.steps[:rows])
        lines.cut(rows)
    return RunLines(**lines.run(p))


def _check_labels(path: Path, written: np.ndarray, index: np.ndarray, labels: Sequence[int]) -> None:
    if not np.array_equal(written[index], np.asarray(labels, dtype=np.int64)):
        raise RunRecordError(f"{path} does not hold the steps of the record beside it: not one run")


def load_arrays(path: str | os.PathLike[str], *, skip: Collection[str] = ()) -> RunArrays:
    """Load a run record (file or directory) into arrays; tolerates a truncated last line.

    ``skip``: per-rank fields to leave out (``None`` in the result), of ``"rank_step"`` and
    ``"delay"``; :data:`DIAGNOSIS_SKIP` is what the diagnosis does without."""
    unknown = set(skip) - set(_SKIPPABLE)
    if unknown:
        raise ValueError(f"load_arrays cannot skip {sorted(unknown)}: only {sorted(_SKIPPABLE)}")
    extra = tuple(name for field_, name in _SKIPPABLE.items() if field_ not in skip)
    p = find_run_record(path)
    wanted = _RANK_FIELDS + extra + _OPTIONAL_RANK_FIELDS
    lines = _read_lines(p, wanted)
    world = int(lines.header["world_size"])
    lists = lines.lists
    columnar = lines.columnar
    loaded: dict[str, np.ndarray] = {}
    if columnar is not None:
        # the per-rank fields come from the columnar file: no JSON lists were read
        loaded, rows = _kept_rank_columns(p.parent, columnar, world, lines.kept, lines.steps, wanted)
        lines.cut(rows)
    steps = len(lines.steps)

    def arr(k: str) -> np.ndarray:
        if columnar is not None:
            return loaded[k] if k in loaded else np.full((steps, world), np.nan)
        assert lists is not None
        return lists.columns[k].array()

    def optional(k: str) -> np.ndarray | None:
        if columnar is not None:
            values = loaded.get(k)
            return values if values is not None and steps and not np.isnan(values).any() else None
        assert lists is not None
        return arr(k) if lists.columns[k].rows == steps and steps else None

    return RunArrays(
        **lines.run(
            p,
            wait=arr("wait_ms"),
            compute=arr("compute_ms"),
            data=arr("data_ms"),
            gap=arr("gap_ms"),
            delay=arr("delay_ms") if "delay" not in skip else None,
            rank_step=arr("step_ms") if "rank_step" not in skip else None,
            gc_ms=optional("gc_ms"),
            gc_collections=optional("gc_collections"),
            samples=optional("samples"),
            tokens=optional("tokens"),
            opt=optional("opt_ms"),
            # read as bool (a batch without the column: every rank bound, as a JSON line without it)
            host_bound=lists.host_bound.array()
            if lists is not None
            else loaded.get("host_bound", np.ones((steps, world), dtype=bool)),
        )
    )


def _kept_rank_columns(
    directory: Path,
    shards: list[tuple[str, list[int]]],
    world: int,
    kept: Sequence[int],
    labels: Sequence[int],
    fields: Sequence[str],
) -> tuple[dict[str, np.ndarray], int]:
    """The per-rank arrays of the kept steps (``kept``: their indices among the record's step lines,
    ``labels``: their step labels) from a columnar file, as the JSON lines would give them, and how
    many of the kept steps it has rows for; only ``fields`` (and ``host_bound``) are read."""
    from pace_strategy.telemetry.columnar import RankColumnsError, read_shards

    names = (*fields, "host_bound")
    index = np.asarray(kept, dtype=np.int64)
    try:
        columns, written, _ = read_shards(directory, shards, world, names, keep=index, flags=("host_bound",))
    except RankColumnsError as error:
        raise RunRecordError(str(error)) from error
    rows = int(np.searchsorted(index, len(written)))  # the kept steps that have rows
    _check_labels(directory / shards[0][0], written, index[:rows], labels[:rows])
    return columns, rows


# ---------------------------------------------------------------------- a run and its resumptions
def timeline_records(run_dirs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The records that ``pace diagnose RUN_DIR [RUN_DIR ...]`` reads as one timeline.

    Several arguments: one record each (:func:`find_run_record`), whatever they are. One directory
    with several run directories below it (Lightning's ``lightning_logs/version_N`` after a
    ``trainer.fit(ckpt_path=...)``): all of them when every record but the oldest begins with a
    ``resume`` line (a run and its resumptions), else the usual error listing them.
    """
    if len(run_dirs) != 1:
        return [find_run_record(d) for d in run_dirs]
    p = Path(run_dirs[0])
    if p.is_dir() and not attempt_records(p):
        dirs = sorted({f.parent for f in p.rglob("pace_run*.jsonl") if attempt_number(f.name) is not None})
        if len(dirs) > 1:
            try:
                records = sorted((find_run_record(d) for d in dirs), key=_created)
                if all(read_run_record(r).resume is not None for r in records[1:]):
                    return records
            except RunRecordError:
                pass  # an unreadable record is no timeline: the listing below names every directory
    return [find_run_record(p)]


def _created(path: Path) -> tuple[float, str]:
    # the header alone: the whole record (its per-rank numbers attached) took 35 s and 4.4 GB at
    # 10,000 steps x 1,024 ranks, to sort one record
    created = next(iter_run_record(path), {}).get("created_unix")
    return (float(created) if isinstance(created, (int, float)) else 0.0, str(path))


def load_timeline(records: Sequence[str | os.PathLike[str]], *, skip: Collection[str] = ()) -> RunArrays:
    """Several records of one run (a run, then its resumptions from checkpoints) as one
    :class:`RunArrays`, oldest first (by the header's creation time): their steps one after another.

    Every measured step is kept, including the steps a preempted run trained after the checkpoint it
    was resumed from (the resumed run trains them again): both are real time spent. ``segments`` says
    where each record begins and how it ended. One record: :func:`load_arrays`.
    """
    return _timeline(records, lambda p: load_arrays(p, skip=skip))


def load_timeline_lines(records: Sequence[str | os.PathLike[str]]) -> RunLines:
    """:func:`load_timeline` without the per-rank numbers (:func:`load_lines`): what ``pace
    diagnose`` reads, the numbers a block at a time."""
    return _timeline(records, load_lines)


def _timeline(records: Sequence[str | os.PathLike[str]], load: Callable[[Path], _Run]) -> _Run:
    paths = sorted((find_run_record(r) for r in records), key=_created)
    parts = [load(p) for p in paths]
    if len(parts) == 1:
        return parts[0]
    worlds = {a.world_size for a in parts}
    if len(worlds) > 1:
        listing = ", ".join(f"{a.path} ({a.world_size} ranks)" for a in parts)
        raise RunRecordError(
            f"these run records have different world sizes and are not one timeline: {listing}; "
            "diagnose each on its own (pace diagnose RUN_DIR)"
        )
    segments = []
    for a in parts:
        record = read_run_record(a.path)
        labels = [int(s["step"]) for s in record.steps]
        segments.append(
            {
                "path": str(a.path),
                "status": str((a.end or {}).get("status", "no end line")),
                "steps": len(labels),
                "first_step": min(labels, default=None),
                "last_step": max(labels, default=None),
                "local_steps": len(record.local_steps),
                "resume": record.resume,
            }
        )
    joined: dict[str, Any] = {}
    for f in dataclasses.fields(parts[0]):
        values = [getattr(a, f.name) for a in parts]
        if f.name in ("path", "header"):
            joined[f.name] = values[0]
        elif f.name == "end":
            joined[f.name] = values[-1]
        elif f.name == "truncated":
            joined[f.name] = any(values)
        elif f.name == "total_steps":
            joined[f.name] = sum(values)
        elif f.name in ("shares", "rows"):
            pass  # not joined (each part's own; the parts are whole)
        elif f.name == "segments":
            joined[f.name] = segments
        elif isinstance(values[0], list):
            joined[f.name] = [x for v in values for x in v]
        elif isinstance(values[0], np.ndarray) or values[0] is None:
            joined[f.name] = None if any(v is None for v in values) else np.concatenate(values)
    return type(parts[0])(**joined)


def timeline_notes(a: RunLines) -> list[str]:
    """The timeline in words: each record, where it resumed and how it ended (none for one record)."""
    notes = []
    for number, s in enumerate(a.segments, start=1):
        span = f"steps {s['first_step']}-{s['last_step']}" if s["steps"] else "no steps"
        resume = s["resume"]
        where = ""
        if resume is not None:
            restored = ", ".join(resume["restored"]) or "nothing"
            origin = resume["from"] or "a checkpoint"
            where = f", resumed at step {resume['step']} from {origin} (restored: {restored})"
        local = f", plus {s['local_steps']} steps measured on rank 0 only" if s["local_steps"] else ""
        part = f"timeline part {number} of {len(a.segments)}"
        notes.append(f"{part}, {s['path']}{where}: {span}{local}, {s['status']}")
    for before, after in zip(a.segments, a.segments[1:], strict=False):
        resume = after["resume"]
        if resume is not None and before["last_step"] is not None and before["last_step"] >= resume["step"]:
            notes.append(
                f"steps {resume['step']}-{before['last_step']} were trained twice (before the preemption and "
                "again after the resume); both measurements are in the diagnosis"
            )
    return notes
