"""Zero-code pacing's parts: attach_pacing taking over the automatic attach, the prepare hook's choice
of model and optimizer, `pace launch` choosing the bootstrap, the launcher rewriting accelerate's
parsed arguments, and the worker running a script or a module as `python` would. The multi-process
runs are in tests/integration/test_zero_code.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.integrations.accelerate import attach_pacing, bootstrap, launch

pytestmark = pytest.mark.timeout(60)


def automatic(accelerator, model):
    handle = attach_pacing(accelerator, model)
    handle._automatic = True  # as zero_code marks the attach it makes
    return handle


def test_explicit_attach_takes_over_the_automatic_one():
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    first = automatic(accelerator, model)
    assert attach_pacing(accelerator, model) is first  # no arguments: the same attach, adopted
    with pytest.raises(PacingConfigError, match="already paced"):
        attach_pacing(accelerator, model)  # adopted: it is the script's own now
    first.detach()
    first = automatic(accelerator, model)
    replaced = attach_pacing(accelerator, model, PacingConfig(mode="monitor"))  # arguments: replaced
    assert replaced is not first and replaced.attached and not first.attached
    assert replaced.config.mode == "monitor"
    replaced.detach()


def test_pace_launch_runs_the_bootstrap_only_with_a_pacing_config_section(tmp_path, monkeypatch):
    commands = []
    monkeypatch.setattr(launch, "run_forwarding_signals", lambda cmd, env: commands.append(cmd) or 0)
    plain, paced = tmp_path / "plain.yaml", tmp_path / "paced.yaml"
    plain.write_text("num_processes: 2\n")
    paced.write_text("num_processes: 2\npacing_config: {}\n")
    assert launch.main(["--config_file", str(plain), "train.py", "--lr", "1"]) == 0
    assert launch.main(["--config_file", str(paced), "train.py", "--lr", "1"]) == 0
    assert commands[0][1:3] == ["-m", "accelerate.commands.launch"]
    assert commands[1][1:4] == ["-m", bootstrap.MODULE, bootstrap.LAUNCHER_FLAG]
    assert commands[1][-3:] == ["train.py", "--lr", "1"]


@pytest.mark.parametrize(
    ("argv", "script", "script_args", "module"),
    [
        (
            ["--num_processes", "2", "train.py", "--lr", "1"],
            bootstrap.MODULE,
            ["train.py", "--lr", "1"],
            True,
        ),
        (["-m", "pkg.train", "--lr", "1"], bootstrap.MODULE, ["-m", "pkg.train", "--lr", "1"], True),
        (["--no_python", "run.sh", "x"], "run.sh", ["x"], False),  # not Python: as it is
    ],
)
def test_the_launcher_starts_every_worker_through_the_bootstrap(
    argv, script, script_args, module, monkeypatch
):
    import accelerate.commands.launch as accelerate_launch

    seen = []
    monkeypatch.setattr(accelerate_launch, "launch_command", seen.append)
    bootstrap.launch_workers(argv)
    (args,) = seen
    assert (args.training_script, args.training_script_args, bool(args.module)) == (
        script,
        script_args,
        module,
    )


# (Whether accelerate gets hooked once imported: tests/integration/test_zero_code.py, which imports it.)
REPORT = """
import json, sys
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                  "main": sys.modules["__main__"].__dict__ is globals(),
                  "accelerate": "accelerate" in sys.modules}))
"""


def test_the_worker_runs_a_script_or_a_module_as_python_does(tmp_path):
    (tmp_path / "train.py").write_text(REPORT)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(REPORT)
    worker = [sys.executable, "-m", bootstrap.MODULE]
    runs = [
        ([*worker, str(tmp_path / "train.py"), "--lr", "1"], "/"),
        ([*worker, "-m", "pkg.train", "x"], tmp_path),
    ]
    script, module = (
        json.loads(
            subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60, check=True).stdout
        )
        for cmd, cwd in runs
    )
    assert script == {
        "name": "__main__",
        "argv": [str(tmp_path / "train.py"), "--lr", "1"],
        "path0": str(tmp_path),  # the script's directory, as `python train.py` has it
        "main": True,  # pickling by `__main__.name` finds the script's objects
        "accelerate": False,  # the hooks wait for the script to import it
    }
    assert module["name"] == "__main__" and module["argv"] == [str(tmp_path / "pkg" / "train.py"), "x"]
    assert module["main"] and module["path0"] == str(tmp_path)  # `python -m`: the current directory


def test_a_failing_script_keeps_its_exit_status(tmp_path):
    (tmp_path / "fail.py").write_text(textwrap.dedent("import sys\nsys.exit(3)\n"))
    out = subprocess.run([sys.executable, "-m", bootstrap.MODULE, str(tmp_path / "fail.py")], timeout=60)
    assert out.returncode == 3


@pytest.fixture
def hooks(monkeypatch):
    """zero_code's prepare hook with fresh state, stand-in models (Model), and its attach recorded
    instead of made."""
    from pace_strategy.integrations.accelerate import attach, zero_code

    monkeypatch.setattr(zero_code, "_STATE", zero_code._ZeroCode())
    monkeypatch.setattr(attach, "is_paceable", lambda o: isinstance(o, Model))
    attached = []

    def attach_pacing(accelerator, model, optimizer):
        attached.append((model, optimizer))
        return SimpleNamespace()

    monkeypatch.setattr(attach, "attach_pacing", attach_pacing)
    return zero_code, attached


class Model:
    """A prepared DDP model as the prepare hook sees it."""


class Accelerated:
    """An Accelerator as the prepare hook sees it (a weak reference is kept, as to the real one)."""

    def __init__(self, processes=2, optimizers=()):
        self.num_processes, self._optimizers = processes, list(optimizers)


def optimizer():
    from accelerate.optimizer import AcceleratedOptimizer

    return object.__new__(AcceleratedOptimizer)  # only its class matters here


def test_the_prepare_hook_attaches_once_with_the_optimizer_of_the_same_or_the_next_call(hooks):
    zero_code, attached = hooks
    accelerator = Accelerated()
    model, opt = Model(), optimizer()
    zero_code._after_prepare(accelerator, [model, "loader"])  # no optimizer yet: waits
    zero_code._after_prepare(accelerator, ["loader"])
    assert not attached
    zero_code._after_prepare(accelerator, [opt])  # made from the prepared parameters, prepared next
    zero_code._after_prepare(accelerator, [Model(), opt])  # once per process
    assert attached == [(model, opt)]


def test_the_prepare_hook_takes_an_earlier_optimizer_and_leaves_ambiguity_alone(hooks, caplog):
    zero_code, attached = hooks
    model = Model()
    zero_code._after_prepare(Accelerated(optimizers=["o"]), [model])
    assert attached == [(model, None)]  # attach_pacing takes the one prepared before
    zero_code._STATE.attached = False
    attached.clear()
    with caplog.at_level(logging.WARNING):
        zero_code._after_prepare(Accelerated(), [Model(), Model(), optimizer()])
    zero_code._after_prepare(Accelerated(), [Model(), optimizer()])
    assert not attached and "2 models and 1 optimizers: not paced" in caplog.text
    zero_code._STATE.attached = False
    trainer_owned = Accelerated()
    zero_code._STATE.trainer_accelerators.add(trainer_owned)
    zero_code._after_prepare(trainer_owned, [Model(), optimizer()])  # its PacingCallback attaches
    zero_code._after_prepare(Accelerated(processes=1), [Model(), optimizer()])
    assert not attached
