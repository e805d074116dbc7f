"""``pace diagnose RUN_DIR [RUN_DIR ...] [--json]``: the terminal report, report.html and plots beside
the run (several run directories, or one holding a run and its resumptions: one timeline);
``pace diagnose --compare RUN_A RUN_B``: two runs side by side."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.telemetry.run_record import RunRecordError

if TYPE_CHECKING:
    from pace_strategy.diagnose.config import DiagnosisConfig
    from pace_strategy.diagnose.digest import RunDigest
    from pace_strategy.diagnose.result import Diagnosis
    from pace_strategy.telemetry.arrays import RunLines

__all__ = ["build_parser", "main"]


def _rank_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        counts = [-1]
    if any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(
            f"--project-ranks {text!r} is invalid: expected rank counts >= 1 separated by commas "
            "(e.g. 8,64,512), or '' for no projection"
        )
    return counts


def _modes(text: str) -> set[str]:
    """``--fail-on``'s modes; ``any``: every mode but ``healthy``."""
    from pace_strategy.diagnose.result import MODES

    names = {x for x in text.replace(" ", "").split(",") if x}
    if "any" in names:
        names = (names - {"any"}) | (set(MODES) - {"healthy"})
    unknown = sorted(names - set(MODES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--fail-on {text!r} is invalid: {', '.join(unknown) or 'no mode'} is no mode; expected modes "
            f"separated by commas, or 'any', from: {', '.join(MODES)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    from pace_strategy.diagnose.projection import DEFAULT_PROJECT_RANKS

    p = argparse.ArgumentParser(
        prog="pace diagnose",
        description="Say which failure mode a run shows (straggler, locality, crowded host, amplification, "
        "fabric, data), where, with what evidence and what it would cost at scale; write report.html and "
        "PNG plots beside the run.",
    )
    p.add_argument(
        "run_dir",
        nargs="*",
        help="a directory holding pace_run.jsonl (or a parent holding exactly one, or a run and its "
        "resumptions, e.g. lightning_logs after trainer.fit(ckpt_path=...)); several: one run's records "
        "read as one timeline, oldest first",
    )
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("RUN_A", "RUN_B"),
        help="diagnose two runs and print their numbers, findings and projections side by side "
        "(before/after a change); writes no report",
    )
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    p.add_argument("--out", default=None, help="report directory (default: RUN_DIR/pace_report)")
    p.add_argument("--no-report", action="store_true", help="skip the HTML/Markdown report and plots")
    p.add_argument(
        "--project-ranks",
        type=_rank_counts,
        default=list(DEFAULT_PROJECT_RANKS),
        metavar="R,R,...",
        help="rank counts to project every finding to with the simulator calibrated on the run "
        f"(default {','.join(map(str, DEFAULT_PROJECT_RANKS))}; '' for none)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override a diagnosis threshold"
    )
    p.add_argument(
        "--fail-on",
        type=_modes,
        default=set(),
        metavar="MODE[,MODE]",
        help="exit with status 1 when the diagnosis names one of these modes ('any': every mode but "
        "healthy), after printing it as usual: for CI jobs and schedulers",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.run_dir) == (args.compare is not None):
        parser.error("pass RUN_DIR, or --compare RUN_A RUN_B")
    from pace_strategy.diagnose.config import DiagnosisConfig
    from pace_strategy.settings import load_mapping

    try:
        cfg = DiagnosisConfig.from_dict(load_mapping(None, args.set))
        if args.compare:
            return _compare(args, cfg)
        started = time.monotonic()
        arrays, result, digest = _diagnose(args.run_dir, cfg, args.project_ranks)
    except (RunRecordError, PacingConfigError, ValueError) as error:
        print(f"pace diagnose: error: {error}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - started
    paths = {}
    if not args.no_report:
        from pace_strategy.diagnose.report import PLOTS, render_report

        out_dir = Path(args.out) if args.out else _report_parent(arrays) / "pace_report"
        paths = render_report(arrays, result, out_dir, cfg, digest)
    if args.json:
        payload = result.to_dict()
        payload["run_record"] = str(arrays.path)
        payload["report"] = {k: str(v) for k, v in paths.items()}
        print(json.dumps(payload, indent=2))
        return _status(result, args.fail_on)
    print(f"pace diagnose: {', '.join(s['path'] for s in arrays.segments) or arrays.path}")
    print(
        f"  {arrays.world_size} ranks, {arrays.steps:,} usable steps of {arrays.total_steps:,}, "
        f"analysed in {elapsed:.1f} s"
    )
    print(_text(result))
    if paths:
        beside = "plots and report.md" if set(paths) & set(PLOTS) else "report.md; no plots: see the report"
        print(f"\nreport: {paths['html']}  ({beside} beside it)")
    return _status(result, args.fail_on)


def _status(result: Diagnosis, fail_on: set[str]) -> int:
    """1 when a finding's mode is one ``--fail-on`` names (said on stderr), else 0."""
    named = sorted({str(f.mode) for f in result.findings} & fail_on)
    if named:
        print(f"pace diagnose: failing (--fail-on): {', '.join(named)}", file=sys.stderr)
        return 1
    return 0


def _diagnose(
    run_dirs: str | Sequence[str], cfg: DiagnosisConfig, ranks: Sequence[int]
) -> tuple[RunLines, Diagnosis, RunDigest | None]:
    """The run's lines (its per-rank numbers are read a block of steps at a time, never whole), its
    diagnosis and the digest of its numbers."""
    from pace_strategy.diagnose.findings import diagnose_run
    from pace_strategy.telemetry.arrays import load_timeline_lines, timeline_records

    lines = load_timeline_lines(timeline_records([run_dirs] if isinstance(run_dirs, str) else run_dirs))
    return lines, *diagnose_run(lines, cfg, project_ranks=ranks)


def _report_parent(arrays: RunLines) -> Path:
    """Where the report goes by default: beside the record, or for a timeline of several records the
    directory that holds them all (e.g. ``lightning_logs``)."""
    if not arrays.segments:
        return arrays.path.parent
    return Path(os.path.commonpath([Path(s["path"]).parent for s in arrays.segments]))


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=100, initial_indent="   ", subsequent_indent="   ")


def _text(result: Diagnosis) -> str:
    """The findings as the terminal shows them (notes first, the projection's assumption last)."""
    from pace_strategy.diagnose.result import projection_text

    lines = [f"  note: {note}" for note in result.notes]
    lines.append("")
    for i, f in enumerate(result.findings, start=1):
        where = f" — ranks {', '.join(map(str, f.ranks))}" if f.ranks and len(f.ranks) <= 16 else ""
        lines.append(
            f"{i}. {f.mode}{where} (confidence {f.confidence:.2f}, ~{f.lost_step_fraction:.1%} of step time)"
        )
        lines.append(_wrap(f.evidence))
        lines.append(_wrap("action: " + f.action))
        if f.projection:
            lines.append(_wrap("at scale: " + projection_text(f.projection)))
    p = result.projection
    if p:
        text = (
            f"projection: simulated ({p['simulated_steps']} steps per size, calibrated on "
            f"{p['calibration_steps']:,} recorded steps; at the recorded size it gives "
            f"{p['simulated_lost_fraction']:.1%} waiting against {p['measured_lost_fraction']:.1%} "
            f"measured), assuming {p['assumption']}"
        )
        lines += ["", textwrap.fill(text, width=100, subsequent_indent="   ")]
    return "\n".join(lines)


def _compare(args: argparse.Namespace, cfg: DiagnosisConfig) -> int:
    from pace_strategy.diagnose.compare import compare_dict, compare_text

    arrays_a, a, _ = _diagnose(args.compare[0], cfg, args.project_ranks)
    arrays_b, b, _ = _diagnose(args.compare[1], cfg, args.project_ranks)
    if args.json:
        payload: dict[str, Any] = compare_dict(str(arrays_a.path), a, str(arrays_b.path), b)
        print(json.dumps(payload, indent=2))
    else:
        print(compare_text(str(arrays_a.path), a, str(arrays_b.path), b))
    return 0
