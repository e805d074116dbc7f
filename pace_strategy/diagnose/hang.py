"""A hung run's evidence (``RUN_DIR/hang/``, written by rank 0 when the watchdog named ranks) as
diagnosis notes: where every rank stood, and the innermost frames of each rank's stacks."""

from __future__ import annotations

import json
from pathlib import Path

from pace_strategy.core.evidence import EVIDENCE_DIR, top_frames

__all__ = ["hang_evidence_notes"]


def hang_evidence_notes(record_path: Path) -> list[str]:
    """Notes from the evidence beside ``record_path`` (none when there is none, or it is unreadable:
    the ``hang`` line is noted anyway)."""
    directory = record_path.parent / EVIDENCE_DIR
    try:
        summary = json.loads((directory / "hang.json").read_text())
        marks = summary["marks"]
        hung = set(summary["hang"]["ranks"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    notes = [f"hang evidence in {directory}: stacks of ranks {summary.get('stacks')}, Flight Recorder "
             f"{summary.get('flight_recorder')}"]  # fmt: skip
    for rank, mark in sorted(marks.items(), key=lambda item: int(item[0])):
        label = "hung" if int(rank) in hung else "waiting"
        if not isinstance(mark, dict):
            notes.append(f"hang: rank {rank} ({label}): no entry on the store")
            continue
        ended, begun = mark.get("steps_ended"), mark.get("last_step_begun")
        where = f"{mark.get('where')}, {ended} steps ended, last begun {begun}"
        stacks = directory / f"stacks_rank{rank}.txt"
        frames = top_frames(stacks.read_text()) if stacks.is_file() else []
        at = f"; innermost frames: {' | '.join(frames)}" if frames else "; no stacks (frozen or gone)"
        notes.append(f"hang: rank {rank} ({label}): {where}{at}")
    return notes
