"""Two diagnoses side by side (``pace diagnose --compare RUN_A RUN_B``): before and after a change."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

from pace_strategy.diagnose.result import Diagnosis

__all__ = ["STAT_ROWS", "compare_dict", "compare_text"]


def _ms(x: float) -> str:
    return f"{x:.1f} ms"


def _share(x: float) -> str:
    return f"{x:.1%}"


def _plain(x: float) -> str:
    return f"{x:g}"


def _cv(x: float) -> str:
    return f"{x:.3f}"


#: (label, stats key, format) of the headline table, in order
STAT_ROWS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("ranks", "world_size", _plain),
    ("usable steps", "steps", _plain),
    ("median step", "median_step_ms", _ms),
    ("mean step", "mean_step_ms", _ms),
    ("step CV", "step_cv", _cv),
    ("skew p50", "skew_ms_p50", _ms),
    ("skew p99", "skew_ms_p99", _ms),
    ("transfer p50", "transfer_ms_p50", _ms),
    ("lost to waiting", "lost_step_fraction", _share),
    ("noise floor (jitter)", "noise_floor_fraction", _share),
    ("jitter sd per rank", "jitter_sigma_ms", _ms),
)


def _change(a: Any, b: Any) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return ""
    if a == 0:
        return "" if b == 0 else "new"
    return f"{b / a - 1:+.0%}"


def _findings_by_mode(d: Diagnosis) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in d.findings:
        where = f"ranks {','.join(map(str, f.ranks))} " if f.ranks and len(f.ranks) <= 8 else ""
        out.setdefault(f.mode.value, []).append(f"{where}{f.lost_step_fraction:.1%}")
    return out


def _projection_by_ranks(d: Diagnosis) -> dict[int, float]:
    return {int(p["ranks"]): float(p["lost_fraction"]) for p in d.projection.get("waiting", [])}


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return [line.rstrip() for line in lines]


def compare_text(name_a: str, a: Diagnosis, name_b: str, b: Diagnosis) -> str:
    """The headline numbers, the findings and the projections of two runs, side by side."""
    out = []
    for label, name, d in (("A", name_a, a), ("B", name_b, b)):
        out.append(f"{label}: {name}")
        out.append(textwrap.fill(d.summary, width=100, initial_indent="   ", subsequent_indent="   "))
    out.append("")
    rows = [["", "A", "B", "B vs A"]]
    for label, key, fmt in STAT_ROWS:
        va, vb = a.stats.get(key), b.stats.get(key)
        rows.append(
            [label, fmt(va) if va is not None else "-", fmt(vb) if vb is not None else "-", _change(va, vb)]
        )
    crowded = [", ".join(d.stats.get("oversubscribed_hosts") or []) or "none" for d in (a, b)]
    rows.append(["oversubscribed hosts", crowded[0], crowded[1], ""])
    out += _table(rows)
    fa, fb = _findings_by_mode(a), _findings_by_mode(b)
    rows = [["finding (share of step time)", "A", "B"]]
    for mode in dict.fromkeys([*fa, *fb]):
        rows.append([mode, "; ".join(fa.get(mode, [])) or "-", "; ".join(fb.get(mode, [])) or "-"])
    out += ["", *_table(rows)]
    pa, pb = _projection_by_ranks(a), _projection_by_ranks(b)
    if pa or pb:
        rows = [["waiting at scale (simulated)", "A", "B"]]
        for n in sorted({*pa, *pb}):
            rows.append(
                [
                    f"{n:,} ranks",
                    _share(pa[n]) if n in pa else "-",
                    _share(pb[n]) if n in pb else "-",
                ]
            )
        out += ["", *_table(rows)]
    return "\n".join(out)


def compare_dict(name_a: str, a: Diagnosis, name_b: str, b: Diagnosis) -> dict[str, Any]:
    """``--compare --json``: both diagnoses and, per headline number, A, B and B / A."""
    change = {}
    for _, key, _ in STAT_ROWS:
        va, vb = a.stats.get(key), b.stats.get(key)
        ratio = vb / va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else None
        change[key] = {"a": va, "b": vb, "ratio": ratio}
    return {
        "a": {"run_record": name_a, **a.to_dict()},
        "b": {"run_record": name_b, **b.to_dict()},
        "change": change,
    }
