"""What ``import pace_strategy`` and the CLI commands load: no framework until one is used, and the
strategies registered whichever of pace_strategy and Lightning is imported first."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from subprocess import PIPE

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


#: (what is imported, in order; ``probe:X`` only asks importlib.util.find_spec, as Lightning does to see
#: which packages exist) -> the registry that must then hold the paced names, and their adapter module
REGISTRATION_CASES = {
    "pace_strategy first": (
        ["pace_strategy", "lightning.pytorch"],
        ("lightning.pytorch.strategies", "StrategyRegistry", "pace_strategy.integrations.lightning"),
    ),
    "a probe before the import": (
        ["pace_strategy", "probe:pytorch_lightning", "pytorch_lightning"],
        ("pytorch_lightning.strategies", "StrategyRegistry", "pace_strategy.integrations.pytorch_lightning"),
    ),
    "Fabric first": (  # also loads lightning.pytorch: the already-imported path of both adapters
        ["lightning.fabric", "pace_strategy"],
        ("lightning.fabric.strategies", "STRATEGY_REGISTRY", "pace_strategy.integrations.fabric"),
    ),
    "pace_strategy before Fabric": (
        ["pace_strategy", "lightning.fabric"],
        ("lightning.fabric.strategies", "STRATEGY_REGISTRY", "pace_strategy.integrations.fabric"),
    ),
}

REGISTERED = """
import importlib, importlib.util, json, sys
for name in {order!r}:
    if name.startswith("probe:"):
        assert importlib.util.find_spec(name[6:]) is not None and name[6:] not in sys.modules
    else:
        importlib.import_module(name)
registry = getattr(importlib.import_module({registry_module!r}), {registry!r})
names = [n for n in ("paced_ddp", "paced_ddp_spawn", "paced_ddp_fork", "paced_fsdp") if n in registry]
print(json.dumps({{n: registry[n]["strategy"].__module__ for n in names}}))
"""


@pytest.mark.long
def test_strategies_are_registered_whichever_is_imported_first_and_a_probe_does_not_use_it_up():
    if importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("pytorch_lightning is not installed")
    runs = {}
    for case, (order, (registry_module, registry, _)) in REGISTRATION_CASES.items():
        code = REGISTERED.format(order=order, registry_module=registry_module, registry=registry)
        # Fresh interpreters, all at once: each import order must start from nothing imported.
        runs[case] = subprocess.Popen([sys.executable, "-c", code], stdout=PIPE, stderr=PIPE, text=True)
    for case, run in runs.items():
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, (case, stderr)
        names = json.loads(stdout.strip().splitlines()[-1])
        adapter = REGISTRATION_CASES[case][1][2]
        expected = (
            ("paced_ddp", "paced_ddp_spawn", "paced_ddp_fork")
            if "fabric" in adapter
            else ("paced_ddp", "paced_ddp_spawn", "paced_ddp_fork", "paced_fsdp")
        )
        assert names == dict.fromkeys(expected, adapter), (case, names)


def test_public_names_load_on_first_use_and_resolve_to_their_declaring_module():
    resolved = _run(
        textwrap.dedent(
            """
            import importlib, json, sys
            import pace_strategy, pace_strategy.core as core
            assert sorted(dir(pace_strategy)) == sorted(pace_strategy.__all__)
            config = pace_strategy.PacingConfig(max_delay_ms=5)
            assert config.max_delay_ms == 5 and "lightning" not in sys.modules
            out = {}
            for package in (pace_strategy, core):
                names = set(package.__all__) - {"__version__"}
                assert names == set(package._WHERE), names ^ set(package._WHERE)
                for name in sorted(names):
                    declared = getattr(importlib.import_module(package._WHERE[name]), name)
                    assert getattr(package, name) is declared, name
                    out[f"{package.__name__}.{name}"] = package._WHERE[name]
            out["lightning loaded by PacedDDPStrategy"] = "lightning" in sys.modules
            print(json.dumps(out))
            """
        )
    )
    assert resolved.pop("lightning loaded by PacedDDPStrategy") is True
    assert len(resolved) > 40
    assert all(module.startswith("pace_strategy.") for module in resolved.values()), resolved
