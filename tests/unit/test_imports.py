"""What ``import pace_strategy`` and the CLI commands load: no framework until one is used, and the
strategies registered whichever of pace_strategy and Lightning is imported first."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run4_transient.jsonl"
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


LOADED = f"""
import json, sys
print(json.dumps({{name: name in sys.modules for name in {(*FRAMEWORKS, "torch")!r}}}))
"""


def test_import_and_help_load_no_framework_and_no_torch():
    loaded = _run(
        "import pace_strategy, pace_strategy.cli\n"
        "pace_strategy.__version__\n"
        "try:\n    pace_strategy.cli.main(['--help'])\nexcept SystemExit:\n    pass\n" + LOADED
    )
    assert not any(loaded.values()), loaded


@pytest.mark.parametrize("command", ["diagnose", "simulate"])
def test_diagnose_and_simulate_load_no_framework(tmp_path, command):
    (tmp_path / "pace_run.jsonl").write_bytes(FIXTURE.read_bytes())
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "simulate" / "clean.yaml"
    argv = (
        [str(tmp_path), "--json", "--no-report"]
        if command == "diagnose"
        else [str(recipe), "nodes=[4]", "steps=50", "--json"]
    )
    loaded = _run(
        textwrap.dedent(
            f"""
            import contextlib, io
            from pace_strategy.cli import main
            with contextlib.redirect_stdout(io.StringIO()):
                assert main({[command, *argv]!r}) == 0
            """
        )
        + LOADED
    )
    assert not any(loaded[name] for name in FRAMEWORKS), loaded
    if command == "diagnose":  # a run record is read with NumPy alone
        assert not loaded["torch"], loaded


@pytest.mark.parametrize("first", ["pace_strategy", "framework"])
@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_strategies_are_registered_whichever_is_imported_first(first, package):
    if importlib.util.find_spec(package.split(".")[0]) is None:
        pytest.skip(f"{package} is not installed")
    order = ["pace_strategy", package] if first == "pace_strategy" else [package, "pace_strategy"]
    names = _run(
        textwrap.dedent(
            f"""
        import importlib, json
        for name in {order!r}:
            importlib.import_module(name)
        from {package}.strategies import StrategyRegistry
        print(json.dumps({{n: StrategyRegistry[n]["strategy"].__module__ for n in
                          ("paced_ddp", "paced_ddp_spawn", "paced_fsdp")}}))
            """
        )
    )
    assert set(names) == {"paced_ddp", "paced_ddp_spawn", "paced_fsdp"}
    assert all(module.startswith("pace_strategy.integrations.") for module in names.values()), names


@pytest.mark.parametrize("first", ["pace_strategy", "framework"])
def test_fabric_strategies_are_registered_whichever_is_imported_first(first):
    order = ["pace_strategy", "lightning.fabric"]
    order = order if first == "pace_strategy" else order[::-1]
    names = _run(
        textwrap.dedent(
            f"""
        import importlib, json
        for name in {order!r}:
            importlib.import_module(name)
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        names = ("paced_ddp", "paced_ddp_spawn")
        print(json.dumps({{n: STRATEGY_REGISTRY[n]["strategy"].__module__ for n in names}}))
            """
        )
    )
    assert names == dict.fromkeys(("paced_ddp", "paced_ddp_spawn"), "pace_strategy.integrations.fabric")


def test_public_names_load_on_first_use():
    loaded = _run(
        textwrap.dedent(
            """
        import json, sys
        import pace_strategy
        assert sorted(dir(pace_strategy)) == sorted(pace_strategy.__all__)
        config = pace_strategy.PacingConfig(max_delay_ms=5)
        assert "lightning" not in sys.modules
        pace_strategy.PacedDDPStrategy  # the adapter, and with it Lightning
        print(json.dumps({"lightning": "lightning" in sys.modules, "delay": config.max_delay_ms}))
        """
        )
    )
    assert loaded == {"lightning": True, "delay": 5}


def test_every_public_name_resolves_to_where_it_is_declared():
    resolved = _run(
        textwrap.dedent(
            """
            import importlib, json
            import pace_strategy, pace_strategy.core as core
            out = {}
            for package in (pace_strategy, core):
                names = set(package.__all__) - {"__version__"}
                assert names == set(package._WHERE), names ^ set(package._WHERE)
                for name in sorted(names):
                    declared = getattr(importlib.import_module(package._WHERE[name]), name)
                    assert getattr(package, name) is declared, name
                    out[f"{package.__name__}.{name}"] = package._WHERE[name]
            print(json.dumps(out))
            """
        )
    )
    assert len(resolved) > 40
    assert all(module.startswith("pace_strategy.") for module in resolved.values()), resolved


def test_the_library_never_imports_its_apps_test_support_or_tooling():
    import ast

    package = Path(__file__).resolve().parents[2] / "pace_strategy"
    outside = ("pace_strategy.apps", "pace_strategy.testing", "pace_strategy.testbed")
    offenders = []
    for path in sorted(package.rglob("*.py")):
        part = path.relative_to(package).parts[0]
        if part in ("apps", "testing", "testbed", "cli.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.relative_to(package)}: {n}" for n in names if n.startswith(outside)]
    assert not offenders, offenders


def test_a_probe_for_the_framework_does_not_use_up_the_registration():
    # Lightning asks importlib.util.find_spec which packages exist; only the real import registers.
    if importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("pytorch_lightning is not installed")
    registered = _run(
        textwrap.dedent(
            """
            import importlib.util, json, sys
            import pace_strategy
            importlib.util.find_spec("pytorch_lightning")
            assert "pytorch_lightning" not in sys.modules
            import pytorch_lightning
            from pytorch_lightning.strategies import StrategyRegistry
            print(json.dumps({"paced_ddp": "paced_ddp" in StrategyRegistry}))
            """
        )
    )
    assert registered == {"paced_ddp": True}
