"""A run record as numpy arrays (steps x ranks), built in one pass over the JSON lines."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

__all__ = [
    "DIAGNOSIS_SKIP",
    "RANK_AXIS",
    "RunArrays",
    "find_run_record",
    "load_arrays",
    "load_timeline",
    "timeline_records",
]

#: per-rank arrays are ``[steps, ranks]``: the axis the glossary functions reduce over
RANK_AXIS = 1

_RANK_FIELDS = ("wait_ms", "compute_ms", "data_ms", "gap_ms")
#: per-rank fields a reader may leave out (``load_arrays(skip=...)``): the RunArrays field and the
#: record's name. No check of the diagnosis reads either: the step's time is the slowest rank's
#: (``step_ms``), and the report plots the step's largest delay (``delay_max``).
_SKIPPABLE = {"rank_step": "step_ms", "delay": "delay_ms"}
#: what ``pace diagnose``, ``pace simulate --from-run`` and the demo leave out: each is a [steps,
#: ranks] array (819 MB at 100k steps x 1,024 ranks)
DIAGNOSIS_SKIP = ("rank_step", "delay")
#: per-rank fields that later records add: loaded when every kept step has them, else left ``None``
_OPTIONAL_RANK_FIELDS = ("gc_ms", "gc_collections", "samples", "opt_ms")


@dataclass
class RunArrays:
    """Post-warm-up, valid steps of one run. Per-rank arrays are ``[steps, ranks]`` float64, ms."""

    path: Path
    header: dict[str, Any]
    end: dict[str, Any] | None
    truncated: bool
    total_steps: int  #: every step line in the record, warm-up and invalid included
    step: np.ndarray  #: [S] global step
    wait: np.ndarray
    compute: np.ndarray
    data: np.ndarray
    gap: np.ndarray
    step_ms: np.ndarray  #: [S] slowest rank's step time
    pacing_active: np.ndarray  #: [S] bool
    decisions: list[dict[str, Any]]
    #: [S, ranks] pacing delay each rank applied; None: not loaded (:func:`load_arrays`'s ``skip``)
    delay: np.ndarray | None = None
    #: [S] the largest delay of the step (the step lines' ``delay_ms_max``; NaN where not written)
    delay_max: np.ndarray | None = None
    #: [S, ranks] each rank's own step time; None: not loaded (:func:`load_arrays`'s ``skip``)
    rank_step: np.ndarray | None = None
    gc_ms: np.ndarray | None = None  #: [S, ranks] time in the garbage collector; None: not recorded
    gc_collections: np.ndarray | None = None  #: [S, ranks] collections per step; None: not recorded
    #: [S, ranks] samples each rank trained on (0: not reported); None: not recorded
    samples: np.ndarray | None = None
    #: [S, ranks] collective completion -> step end (optimizer step, hooks); None: not recorded
    opt: np.ndarray | None = None
    #: ``[steps, ranks]`` bool: the host was the bottleneck of the step on that rank (its device had
    #: reached the arrival when the host ended the step); all true on CPU and in older records
    host_bound: np.ndarray | None = None
    shares: list[dict[str, Any]] = field(default_factory=list)  #: the record's ``shares`` lines
    hangs: list[dict[str, Any]] = field(default_factory=list)  #: the record's ``hang`` lines
    #: every attempt of an elastically restarted job whose record lies beside this one (this one
    #: included, ``"this": true``), first attempt first: path, restart_count, status, error, steps, hangs
    attempts: list[dict[str, Any]] = field(default_factory=list)
    #: a run and its resumptions read as one timeline (:func:`load_timeline`): one entry per record,
    #: oldest first (path, status, steps, first/last step, the resume line); empty for one record
    segments: list[dict[str, Any]] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return int(self.header["world_size"])

    def select(self, keep: np.ndarray) -> RunArrays:
        """The same run restricted to the steps where ``keep`` (``[S]`` bool, or step indices) holds:
        every per-step array, the optional ones included; the record's lines stay whole."""
        per_step = {
            f.name: getattr(self, f.name)[keep]
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), np.ndarray)
        }
        return dataclasses.replace(self, **per_step)

    @property
    def step_delay_max(self) -> np.ndarray:
        """``[S]`` each step's largest pacing delay, ms: from the per-rank delays when loaded, else
        the step lines' ``delay_ms_max`` (0 where neither says)."""
        if self.delay is not None:
            return self.delay.max(axis=1) if self.delay.size else np.zeros(self.steps)
        return np.nan_to_num(self.delay_max) if self.delay_max is not None else np.zeros(self.steps)

    @property
    def steps(self) -> int:
        return int(self.step.shape[0])

    def topology(self, key: str) -> list[Any]:
        """One topology field per rank (``host``, ``node_rank``, ``local_rank`` ...)."""
        topo = {int(t["rank"]): t for t in self.header.get("topology", [])}
        return [topo.get(r, {}).get(key) for r in range(self.world_size)]

    def describe_rank(self, rank: int) -> str:
        host, local = self.topology("host")[rank], self.topology("local_rank")[rank]
        parts = [f"host {host}" if host else None, f"local rank {local}" if local is not None else None]
        inner = ", ".join(p for p in parts if p)
        return f"rank {rank} ({inner})" if inner else f"rank {rank}"


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


def load_arrays(path: str | os.PathLike[str], *, skip: Collection[str] = ()) -> RunArrays:
    """Load a run record (file or directory) into arrays; tolerates a truncated last line.

    ``skip``: per-rank fields to leave out (``None`` in the result), of ``"rank_step"`` and
    ``"delay"``; :data:`DIAGNOSIS_SKIP` is what the diagnosis does without."""
    unknown = set(skip) - set(_SKIPPABLE)
    if unknown:
        raise ValueError(f"load_arrays cannot skip {sorted(unknown)}: only {sorted(_SKIPPABLE)}")
    extra = tuple(name for field_, name in _SKIPPABLE.items() if field_ not in skip)
    p = find_run_record(path)
    objs = iter_run_record(p)
    header = next(objs)
    world = int(header["world_size"])
    columnar = rank_columns_of(header)
    # the per-rank fields come from the columnar file, when the record has one: no JSON lists here
    capacity = _line_count(p) if columnar is None else 0
    kept: list[int] = []  # with a columnar file: the indices of the kept steps among all step lines
    wanted = _RANK_FIELDS + extra + _OPTIONAL_RANK_FIELDS
    cols = {k: _Column(world, capacity) for k in wanted}
    host_bound = _Column(world, capacity, bool)
    every_rank_bound = [True] * world
    steps, step_ms, active, delay_max = [], [], [], []
    decisions: list[dict[str, Any]] = []
    hangs: list[dict[str, Any]] = []
    shares: list[dict[str, Any]] = []
    end = None
    truncated = False
    total = 0
    for obj in objs:
        kind = obj.get("record")
        if kind == "step":
            total += 1
            if not obj["valid"] or obj["warmup"]:
                continue
            steps.append(obj["step"])
            step_ms.append(obj["step_ms"])
            delay_max.append(obj.get("delay_ms_max"))
            active.append(obj["pacing_active"])
            if columnar is not None:
                kept.append(total - 1)
                continue
            ranks = obj["ranks"]
            for k in _RANK_FIELDS + extra:
                cols[k].add(ranks[k])
            for k in _OPTIONAL_RANK_FIELDS:
                if k in ranks:
                    cols[k].add(ranks[k])
            # a step line without ``host_bound`` had every rank host-bound (the writer omits it
            # then; CPU runs and records written before the field never have it)
            host_bound.add(ranks.get("host_bound") or every_rank_bound)
        elif kind == "decision":
            decisions.append(obj)
        elif kind == "hang":
            hangs.append(obj)
        elif kind == "shares":
            shares.append(obj)
        elif kind == "end":
            end = obj
        elif kind == TRUNCATED:
            truncated = True

    loaded: dict[str, np.ndarray] = {}
    if columnar is not None:
        loaded, rows = _kept_rank_columns(p.parent, columnar, world, kept, steps, wanted)
        if rows < len(steps):  # steps whose rows were never written (a crash between the two files)
            truncated = True
            steps, step_ms, active, delay_max = steps[:rows], step_ms[:rows], active[:rows], delay_max[:rows]

    def arr(k: str) -> np.ndarray:
        if columnar is None:
            return cols[k].array()
        return loaded[k] if k in loaded else np.full((len(steps), world), np.nan)

    def optional(k: str) -> np.ndarray | None:
        if columnar is not None:
            values = loaded.get(k)
            return values if values is not None and len(steps) and not np.isnan(values).any() else None
        return arr(k) if cols[k].rows == len(steps) and steps else None

    return RunArrays(
        path=p,
        header=header,
        end=end,
        truncated=truncated,
        total_steps=total,
        step=np.asarray(steps, dtype=np.int64),
        wait=arr("wait_ms"),
        compute=arr("compute_ms"),
        data=arr("data_ms"),
        gap=arr("gap_ms"),
        delay=arr("delay_ms") if "delay" not in skip else None,
        delay_max=np.asarray(delay_max, dtype=np.float64),
        rank_step=arr("step_ms") if "rank_step" not in skip else None,
        step_ms=np.asarray(step_ms, dtype=np.float64),
        pacing_active=np.asarray(active, dtype=bool),
        decisions=decisions,
        gc_ms=optional("gc_ms"),
        gc_collections=optional("gc_collections"),
        samples=optional("samples"),
        opt=optional("opt_ms"),
        # read as bool (a batch without the column: every rank bound, as a JSON line without it)
        host_bound=host_bound.array()
        if columnar is None
        else loaded.get("host_bound", np.ones((len(steps), world), dtype=bool)),
        shares=shares,
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
    if not np.array_equal(written[index[:rows]], np.asarray(labels[:rows], dtype=np.int64)):
        raise RunRecordError(
            f"{directory / shards[0][0]} does not hold the steps of the record beside it: not one run"
        )
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
    created = read_run_record(path).header.get("created_unix")
    return (float(created) if isinstance(created, (int, float)) else 0.0, str(path))


def load_timeline(records: Sequence[str | os.PathLike[str]], *, skip: Collection[str] = ()) -> RunArrays:
    """Several records of one run (a run, then its resumptions from checkpoints) as one
    :class:`RunArrays`, oldest first (by the header's creation time): their steps one after another.

    Every measured step is kept, including the steps a preempted run trained after the checkpoint it
    was resumed from (the resumed run trains them again): both are real time spent. ``segments`` says
    where each record begins and how it ended. One record: :func:`load_arrays`.
    """
    paths = sorted((find_run_record(r) for r in records), key=_created)
    parts = [load_arrays(p, skip=skip) for p in paths]
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
    last = parts[-1]

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(a, name) for a in parts])

    def cat_optional(name: str) -> np.ndarray | None:
        values = [getattr(a, name) for a in parts]
        return None if any(v is None for v in values) else np.concatenate(values)

    return RunArrays(
        path=parts[0].path,
        header=parts[0].header,
        end=last.end,
        truncated=any(a.truncated for a in parts),
        total_steps=sum(a.total_steps for a in parts),
        step=cat("step"),
        wait=cat("wait"),
        compute=cat("compute"),
        delay=cat_optional("delay"),
        delay_max=cat_optional("delay_max"),
        data=cat("data"),
        gap=cat("gap"),
        rank_step=cat_optional("rank_step"),
        step_ms=cat("step_ms"),
        pacing_active=cat("pacing_active"),
        decisions=[d for a in parts for d in a.decisions],
        gc_ms=cat_optional("gc_ms"),
        gc_collections=cat_optional("gc_collections"),
        samples=cat_optional("samples"),
        opt=cat_optional("opt"),
        host_bound=cat_optional("host_bound"),
        hangs=[h for a in parts for h in a.hangs],
        attempts=[t for a in parts for t in a.attempts],
        segments=segments,
    )


def timeline_notes(a: RunArrays) -> list[str]:
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
