"""``pace diagnose --fail-on MODE[,MODE]``: the exit status a CI job or a scheduler reads."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from pace_strategy.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def gc_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("gc") / "run"
    run.mkdir()
    (run / "pace_run.jsonl").write_bytes((FIXTURES / "gc_pauses_2ranks.jsonl").read_bytes())
    return run


def diagnose(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["diagnose", "--project-ranks", "", *argv])  # no projection: not what is tested
        except SystemExit as exit_:  # argparse's usage errors
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_the_status_is_1_only_when_a_named_mode_is_found(gc_run):
    code, out, _ = diagnose(str(gc_run), "--no-report", "--json")
    modes = [f["mode"] for f in json.loads(out)["findings"]]
    assert code == 0 and "gc_pauses" in modes, modes
    code, out, err = diagnose(str(gc_run), "--no-report", "--fail-on", "fabric_contention,gc_pauses")
    assert code == 1 and "failing (--fail-on): gc_pauses" in err and "gc_pauses" in out  # printed as usual
    assert diagnose(str(gc_run), "--no-report", "--fail-on", "any")[0] == 1
    absent = next(m for m in ("fabric_contention", "data_stall", "locality") if m not in modes)
    assert diagnose(str(gc_run), "--no-report", "--fail-on", absent)[0] == 0
    assert diagnose(str(gc_run), "--no-report", "--json", "--fail-on", "gc_pauses")[0] == 1


def test_an_unknown_mode_is_a_usage_error_listing_the_modes(gc_run):
    code, _, err = diagnose(str(gc_run), "--fail-on", "gc_pause")
    assert code == 2 and "gc_pause is no mode" in err and "gc_pauses" in err
