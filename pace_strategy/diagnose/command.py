"""``pace diagnose RUN_DIR [--json]``: the terminal report, report.html and plots beside the run."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.telemetry.run_record import RunRecordError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pace diagnose",
        description="Say which failure mode a run shows (straggler, locality, amplification, fabric, data), "
        "where, and with what evidence; write report.html and PNG plots beside the run.",
    )
    p.add_argument("run_dir", help="a directory holding pace_run.jsonl (or a parent holding exactly one)")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    p.add_argument("--out", default=None, help="report directory (default: RUN_DIR/pace_report)")
    p.add_argument("--no-report", action="store_true", help="skip the HTML/Markdown report and plots")
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override a diagnosis threshold"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pace_strategy.diagnose.arrays import load_arrays
    from pace_strategy.diagnose.config import DiagnosisConfig
    from pace_strategy.diagnose.findings import diagnose
    from pace_strategy.settings import load_mapping

    try:
        cfg = DiagnosisConfig.from_dict(load_mapping(None, args.set))
        started = time.monotonic()
        arrays = load_arrays(args.run_dir)
        result = diagnose(arrays, cfg)
    except (RunRecordError, PacingConfigError, ValueError) as error:
        print(f"pace diagnose: error: {error}", file=sys.stderr)
        return 2
    paths = {}
    if not args.no_report:
        from pace_strategy.diagnose.report import render_report

        out_dir = Path(args.out) if args.out else arrays.path.parent / "pace_report"
        paths = render_report(arrays, result, out_dir, cfg)
    if args.json:
        payload = result.to_dict()
        payload["run_record"] = str(arrays.path)
        payload["report"] = {k: str(v) for k, v in paths.items()}
        print(json.dumps(payload, indent=2))
        return 0
    print(f"pace diagnose: {arrays.path}")
    print(
        f"  {arrays.world_size} ranks, {arrays.steps:,} usable steps of {arrays.total_steps:,}, "
        f"analysed in {time.monotonic() - started:.1f} s"
    )
    for note in result.notes:
        print(f"  note: {note}")
    print()
    for i, f in enumerate(result.findings, start=1):
        where = f" — ranks {', '.join(map(str, f.ranks))}" if f.ranks and len(f.ranks) <= 16 else ""
        print(
            f"{i}. {f.mode}{where} (confidence {f.confidence:.2f}, ~{f.lost_step_fraction:.1%} of step time)"
        )
        print(textwrap.fill(f.evidence, width=100, initial_indent="   ", subsequent_indent="   "))
        print(textwrap.fill("action: " + f.action, width=100, initial_indent="   ", subsequent_indent="   "))
    if paths:
        print(f"\nreport: {paths['html']}  (plots and report.md beside it)")
    return 0
