"""A run record as numpy arrays (steps x ranks), built in one pass over the JSON lines."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pace_strategy.telemetry.run_record import RECORD_FILENAME, TRUNCATED, RunRecordError, iter_run_record

__all__ = ["RANK_AXIS", "RunArrays", "find_run_record", "load_arrays"]

#: per-rank arrays are ``[steps, ranks]``: the axis the glossary functions reduce over
RANK_AXIS = 1

_RANK_FIELDS = ("wait_ms", "compute_ms", "delay_ms", "data_ms", "gap_ms", "step_ms")


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
    delay: np.ndarray
    data: np.ndarray
    gap: np.ndarray
    rank_step: np.ndarray
    step_ms: np.ndarray  #: [S] slowest rank's step time
    pacing_active: np.ndarray  #: [S] bool
    decisions: list[dict[str, Any]]

    @property
    def world_size(self) -> int:
        return int(self.header["world_size"])

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
    """The run record in ``run_dir``: the directory's own, or the single one below it."""
    p = Path(run_dir)
    if p.is_file():
        return p
    if not p.exists():
        raise RunRecordError(f"{p} does not exist")
    if (p / RECORD_FILENAME).is_file():
        return p / RECORD_FILENAME
    found = sorted(p.rglob(RECORD_FILENAME))
    if not found:
        raise RunRecordError(
            f"no {RECORD_FILENAME} in {p} or below it: is this a pace_strategy run directory?"
        )
    if len(found) > 1:
        listing = "\n".join(f"  {f.parent}" for f in found)
        raise RunRecordError(f"{len(found)} run records under {p}; pass one of these directories:\n{listing}")
    return found[0]


def load_arrays(path: str | os.PathLike[str]) -> RunArrays:
    """Load a run record (file or directory) into arrays; tolerates a truncated last line."""
    p = find_run_record(path)
    objs = iter_run_record(p)
    header = next(objs)
    world = int(header["world_size"])
    cols: dict[str, list[Any]] = {k: [] for k in _RANK_FIELDS}
    steps, step_ms, active = [], [], []
    decisions: list[dict[str, Any]] = []
    end = None
    truncated = False
    total = 0
    for obj in objs:
        kind = obj.get("record")
        if kind == "step":
            total += 1
            if not obj["valid"] or obj["warmup"]:
                continue
            ranks = obj["ranks"]
            for k in _RANK_FIELDS:
                cols[k].append(ranks[k])
            steps.append(obj["step"])
            step_ms.append(obj["step_ms"])
            active.append(obj["pacing_active"])
        elif kind == "decision":
            decisions.append(obj)
        elif kind == "end":
            end = obj
        elif kind == TRUNCATED:
            truncated = True

    def arr(k: str) -> np.ndarray:
        a = np.asarray(cols[k], dtype=np.float64)
        return a.reshape(len(steps), world)

    return RunArrays(
        path=p,
        header=header,
        end=end,
        truncated=truncated,
        total_steps=total,
        step=np.asarray(steps, dtype=np.int64),
        wait=arr("wait_ms"),
        compute=arr("compute_ms"),
        delay=arr("delay_ms"),
        data=arr("data_ms"),
        gap=arr("gap_ms"),
        rank_step=arr("step_ms"),
        step_ms=np.asarray(step_ms, dtype=np.float64),
        pacing_active=np.asarray(active, dtype=bool),
        decisions=decisions,
    )
