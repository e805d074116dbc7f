"""``pace launch``: ``accelerate launch`` with a ``pacing_config:`` section in the accelerate config.

The section is read and validated here, before any worker starts, then stripped: the cleaned config
goes to a temporary file that accelerate's own launcher reads, and the pacing fields travel to the
workers as ``PACE_*`` environment variables (``env.py``; ``attach_pacing`` reads them). With the
section, every worker runs the script through ``bootstrap`` (zero-code pacing: the script needs no
attach call); without it, this is accelerate launch as it is, and says so. Without ``--config_file``
the config is accelerate's default one (:func:`default_config_file`), as for accelerate launch. The
scheduler's signals reach accelerate's launcher through this process (:data:`FORWARDED`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.integrations.accelerate.bootstrap import LAUNCHER_FLAG, MODULE
from pace_strategy.integrations.env import config_to_env

__all__ = ["FORWARDED", "default_config_file", "main", "prepare_launch", "run_forwarding_signals"]

SECTION = "pacing_config"


def _config_arg(argv: list[str]) -> tuple[int, str] | None:
    """Index and value of ``--config_file``/``--config-file`` in accelerate launch arguments."""
    for i, arg in enumerate(argv):
        for flag in ("--config_file", "--config-file"):
            if arg == flag and i + 1 < len(argv):
                return i + 1, argv[i + 1]
            if arg.startswith(flag + "="):
                return i, arg.split("=", 1)[1]
    return None


def default_config_file(environ: Mapping[str, str] | None = None) -> Path:
    """Where ``accelerate launch`` reads its config when given none: accelerate's own rule
    (``$HF_HOME``, else ``$XDG_CACHE_HOME/huggingface``, else ``~/.cache/huggingface``, then
    ``accelerate/default_config.yaml``), written out so that ``pace launch`` starts without importing
    accelerate."""
    environ = os.environ if environ is None else environ
    cache = environ.get("XDG_CACHE_HOME", "~/.cache")
    home = os.path.expanduser(environ.get("HF_HOME", os.path.join(cache, "huggingface")))
    return Path(home) / "accelerate" / "default_config.yaml"


def _count(data: dict[Any, Any], key: str, path: str) -> int:
    """An integer setting of the accelerate config (absent or null: 1)."""
    value = data.get(key)
    if value is None:
        return 1
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: .inf
        raise PacingConfigError(
            f"{path}: {key}={value!r} is invalid: expected an integer (accelerate's own setting)"
        ) from None


def prepare_launch(argv: Sequence[str]) -> tuple[list[str], dict[str, str], Path | None]:
    """The accelerate launch arguments, the extra environment and the temporary config to delete."""
    import yaml

    args = list(argv)
    found = _config_arg(args)
    if found is None:  # accelerate's default config, where accelerate itself would read it
        default = default_config_file()
        if not default.is_file():
            return args, {}, None
        args = ["--config_file", str(default), *args]
        found = (1, str(default))
    index, path = found
    try:
        data: Any = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except OSError as error:
        raise PacingConfigError(f"cannot read accelerate config {path}: {error}") from error
    except (yaml.YAMLError, ValueError) as error:  # ValueError: not UTF-8, or a value YAML cannot build
        reason = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
        raise PacingConfigError(f"{path}: the accelerate config is not valid YAML: {reason}") from error
    if not isinstance(data, dict):
        raise PacingConfigError(f"{path}: expected a mapping at the top level of the accelerate config")
    section = data.pop(SECTION, None)
    if section is None:
        return args, {}, None
    if not isinstance(section, dict):
        raise PacingConfigError(f"{path}: {SECTION} must be a mapping of PacingConfig fields (or empty)")
    try:
        env = config_to_env(section)
    except PacingConfigError as error:
        raise PacingConfigError(f"{path}: {SECTION}: {error}") from None
    env["PACE_CONFIG_SOURCE"] = str(path)
    single_machine = (_count(data, "num_machines", path) or 1) == 1
    if (
        data.get("distributed_type") == "MULTI_CPU"
        and _count(data, "num_processes", path) > 1
        and single_machine
    ):
        # accelerate 1.x starts a single process for MULTI_CPU on one machine; its multi-process
        # launcher runs CPU workers when told to use the CPU.
        data["distributed_type"] = "MULTI_GPU"
        data["use_cpu"] = True
        env["ACCELERATE_USE_CPU"] = "1"
    fd, tmp = tempfile.mkstemp(prefix="pace-accelerate-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(data, f)
    if args[index].startswith("--config"):
        args[index] = f"--config_file={tmp}"
    else:
        args[index] = tmp
    return args, env, Path(tmp)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: pace launch [accelerate launch arguments] SCRIPT [script arguments]\n\n"
            "Runs `accelerate launch`, first reading the `pacing_config:` section of --config_file\n"
            "(validated; a bad field fails here, before any worker starts) and exporting it as PACE_*\n"
            "variables. With the section, pacing attaches to the model accelerator.prepare returns\n"
            "(and to every transformers Trainer) without any change to the script. Every accelerate\n"
            "launch argument passes through."
        )
        return 0 if argv else 2
    try:
        args, env, tmp = prepare_launch(argv)
    except PacingConfigError as error:
        print(f"pace launch: error: {error}", file=sys.stderr)
        return 2
    if not env:
        where = _config_arg(list(argv))
        print(
            f"pace launch: no {SECTION}: section in "
            + (where[1] if where else f"the default accelerate config ({default_config_file()})")
            + "; running plain accelerate launch (pacing attaches only where the script calls "
            "attach_pacing)",
            file=sys.stderr,
        )
    try:
        # bootstrap runs accelerate's own launcher, which starts each worker through bootstrap
        launcher = [MODULE, LAUNCHER_FLAG] if env else ["accelerate.commands.launch"]
        cmd = [sys.executable, "-m", *launcher, *args]
        return run_forwarding_signals(cmd, {**os.environ, **env})
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


#: what a scheduler sends a job's launcher to end or checkpoint it: passed on to accelerate's launcher
#: (which passes them on to its workers), so that `pace launch` can stand where `accelerate launch`
#: did. Not SIGINT: a terminal's Ctrl-C reaches the whole foreground group, accelerate's launcher
#: included, and a second copy would cut its clean-up short; `pace launch` then waits for it.
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def run_forwarding_signals(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``cmd`` and return its exit status (128 + N when signal N ended it, as a shell says),
    passing every signal of :data:`FORWARDED` this process receives on to it meanwhile."""
    child = subprocess.Popen(list(cmd), env=dict(env))  # handlers set after: the child keeps defaults

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, lambda _s, _f: None)
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code
