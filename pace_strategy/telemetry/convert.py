"""Rewrite a JSON-lines run record into the columnar form (``record_format: arrow``) and back.

``pace convert RUN_DIR OUT_DIR --to arrow`` (or ``--to jsonl``) writes the converted record to another
directory; nothing in the source is changed. Every line but the step lines is copied as it is; a step
line's ``ranks`` move to the columnar file (or come back from it). The diagnosis of the converted
record is the diagnosis of the original (tests/unit/test_columnar_record.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pace_strategy.telemetry.columnar import (
    COLUMNS_SCHEMA,
    COLUMNS_VERSION,
    RankColumnsWriter,
    rank_columns_filename,
)
from pace_strategy.telemetry.run_record import (
    TRUNCATED,
    RunRecordError,
    iter_run_record,
    rank_columns_of,
    read_run_record,
)

__all__ = ["convert_record", "main"]

#: step lines per record batch of a converted record (a window of the default exchange)
BATCH_STEPS = 32


def convert_record(source: str | os.PathLike[str], out_dir: str | os.PathLike[str], to: str) -> Path:
    """Write ``source`` (a record file, or a run directory's latest) into ``out_dir`` in the form
    ``to`` (``"arrow"`` or ``"jsonl"``), under the same file name. Returns the new record's path."""
    from pace_strategy.telemetry.arrays import find_run_record

    src = find_run_record(source)
    out = Path(out_dir)
    target = out / src.name
    if target.resolve() == src.resolve():
        raise RunRecordError(f"convert into another directory than the record's own ({src.parent})")
    out.mkdir(parents=True, exist_ok=True)
    if to == "jsonl":
        _write_lines(target, _with_ranks(src))
    elif to == "arrow":
        _to_arrow(src, target)
    else:
        raise ValueError(f"to={to!r}: expected 'arrow' or 'jsonl'")
    return target


def _with_ranks(src: Path) -> Iterator[dict[str, Any]]:
    """The record's lines with each step's ``ranks`` in its line (read back from a columnar file)."""
    if rank_columns_of(next(iter_run_record(src))) is None:
        yield from (o for o in iter_run_record(src) if o.get("record") != TRUNCATED)
        return
    record = read_run_record(src)  # attaches the ranks
    steps = iter(record.steps)
    for obj in iter_run_record(src):
        kind = obj.get("record")
        if kind == "header":
            yield {k: v for k, v in obj.items() if k != "rank_columns"}
        elif kind == "step":
            step = next(steps, None)
            if step is None:  # its rows were never written: the record ends here
                return
            yield step
        elif kind != TRUNCATED:
            yield obj


def _to_arrow(src: Path, target: Path) -> None:
    lines = _with_ranks(src)
    header = next(lines)
    world = int(header["world_size"])
    columns = RankColumnsWriter(target.with_name(rank_columns_filename(target.name)), world)
    header = {
        **header,
        "rank_columns": {"file": columns.path.name, "schema": COLUMNS_SCHEMA, "version": COLUMNS_VERSION},
    }
    pending: list[dict[str, Any]] = []

    def flush() -> Iterator[dict[str, Any]]:
        if pending:
            names = {name for step in pending for name in step["ranks"]}
            columns.write_rows(
                [int(s["step"]) for s in pending], {n: [s["ranks"].get(n) for s in pending] for n in names}
            )
            yield from ({k: v for k, v in s.items() if k != "ranks"} for s in pending)
            pending.clear()

    def converted() -> Iterator[dict[str, Any]]:
        yield header
        for obj in lines:
            if obj.get("record") == "step":
                pending.append(obj)
                if len(pending) == BATCH_STEPS:
                    yield from flush()
                continue
            yield from flush()
            yield obj
        yield from flush()

    try:
        _write_lines(target, converted())
    finally:
        columns.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``pace convert RUN_DIR OUT_DIR --to {arrow,jsonl}``."""
    parser = argparse.ArgumentParser(
        prog="pace convert",
        description="Rewrite a run record with its per-rank columns in an Arrow file (--to arrow) or in "
        "its step lines (--to jsonl), into OUT_DIR; the source is not changed.",
    )
    parser.add_argument("run_dir", help="a run directory or a pace_run*.jsonl file")
    parser.add_argument("out_dir", help="where the converted record goes (not the source's directory)")
    parser.add_argument("--to", choices=("arrow", "jsonl"), required=True)
    args = parser.parse_args(argv)
    try:
        written = convert_record(args.run_dir, args.out_dir, args.to)
    except (RunRecordError, ImportError) as error:
        print(f"pace convert: {error}", file=sys.stderr)
        return 2
    print(written)
    return 0


def _write_lines(target: Path, objs: Iterator[dict[str, Any]]) -> None:
    with target.open("w", encoding="utf-8") as f:
        for obj in objs:
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")
