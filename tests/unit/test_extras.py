"""Installed without its extras, pace_strategy's core works and every feature that needs one says which.

One fresh interpreter in which every optional package is made not installed (the path finder does not
find it, as in an environment where it was never installed): the plain-PyTorch adapter, ``pace
diagnose`` and ``pace simulate`` run; ``pace demo``, ``pace launch`` and the framework adapters fail
naming ``pip install 'pace-strategy[EXTRA]'``. (``attach_pacing`` takes an Accelerator, so whoever
calls it has Accelerate.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pace_strategy._imports import EXTRAS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RECIPES = Path(__file__).resolve().parents[2] / "recipes"

SCRIPT = """
import contextlib, importlib.machinery, io, json, shutil, sys
BLOCKED = set(json.loads(sys.argv[1]))
found = importlib.machinery.PathFinder.find_spec

def not_installed(name, path=None, target=None):
    return None if name.split(".")[0] in BLOCKED else found(name, path, target)

importlib.machinery.PathFinder.find_spec = staticmethod(not_installed)

import pace_strategy
from pace_strategy.cli import main

out = {}
def command(*argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()

out["demo"] = command("demo", "--steps", "2")
out["launch"] = command("launch", "train.py")
shutil.copytree(sys.argv[2], sys.argv[3] + "/run")
out["diagnose"] = command("diagnose", sys.argv[3] + "/run")
out["report"] = open(sys.argv[3] + "/run/pace_report/report.md").read()
out["simulate"] = command("simulate", sys.argv[4], "nodes=[4]")
out["env"] = command("env", "--json")
for name in ("PacedDDPStrategy", "PacingCallback"):
    try:
        getattr(pace_strategy, name)
        out[name] = "loaded"
    except ImportError as error:
        out[name] = f"{type(error).__name__}: {error}"
out["attach"] = pace_strategy.attach.__module__
out["modules"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("extras")
    record = tmp / "record"
    record.mkdir()
    (record / "pace_run.jsonl").write_bytes((FIXTURES / "run4_transient.jsonl").read_bytes())
    recipe = RECIPES / "simulate" / "clean.yaml"
    argv = [sys.executable, "-c", SCRIPT, json.dumps(sorted(EXTRAS)), str(record), str(tmp), str(recipe)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_core_runs_without_any_extra(bare):
    assert bare["diagnose"][0] == 0, bare["diagnose"]
    assert bare["simulate"][0] == 0, bare["simulate"]
    assert bare["env"][0] == 0, bare["env"]
    assert bare["attach"] == "pace_strategy.integrations.pytorch"
    assert bare["modules"] == []  # nothing optional was half-imported


def test_the_report_says_where_its_plots_would_be(bare):
    assert "## Findings" in bare["report"] and "![" not in bare["report"]
    expected = "Drawing the plots needs matplotlib, which is not installed: "
    expected += "pip install 'pace-strategy[plots]'"
    assert expected in bare["report"]


@pytest.mark.parametrize(
    ("feature", "extra"),
    [
        ("demo", "[lightning,tensorboard]"),
        ("launch", "[accelerate]"),
        ("PacedDDPStrategy", "[lightning]"),
        ("PacingCallback", "[hf]"),
    ],
)
def test_a_feature_without_its_extra_names_the_extra(bare, feature, extra):
    got = bare[feature]
    if isinstance(got, list):  # a command: exit status 2, the line on stderr
        assert got[0] == 2 and f"pip install 'pace-strategy{extra}'" in got[1], got
    else:
        assert got.startswith("MissingExtraError:") and f"pip install 'pace-strategy{extra}'" in got, got
