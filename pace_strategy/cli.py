"""The ``pace`` command: dispatches ``demo``, ``diagnose``, ``simulate``, ``launch``, ``testbed``,
``import``, ``env``, ``config`` and ``convert`` to the module that owns each, imported only when that
command runs (``pace --help`` imports none)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from pace_strategy._imports import MissingExtraError, missing_extra, require
from pace_strategy._version import __version__

__all__ = ["COMMANDS", "main"]

#: command -> (module whose ``main(argv) -> int`` runs it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("pace_strategy.apps.demo", "multi-process CPU training with an injected straggler"),
    "diagnose": ("pace_strategy.diagnose.command", "name the failure mode of a recorded run, with plots"),
    "simulate": ("pace_strategy.sim.command", "what-if simulator from 4 to 1,024+ nodes"),
    "launch": (
        "pace_strategy.integrations.accelerate.launch",
        "accelerate launch with a pacing_config: section",
    ),
    "testbed": ("pace_strategy.testbed.command", "emulated two-rack cluster in network namespaces (root)"),
    "import": (
        "pace_strategy.telemetry.importer",
        "turn a per-rank step table recorded elsewhere into a run record",
    ),
    "env": ("pace_strategy.apps.environment", "versions, devices, backends and the configuration in force"),
    "config": ("pace_strategy.apps.config_command", "every setting, its default and its PACE_* variable"),
    "convert": (
        "pace_strategy.telemetry.convert",
        "rewrite a run record as JSON lines or with Arrow columns",
    ),
}

#: command -> the optional packages it cannot start without (the others fail where they are used,
#: with the same message: ``pace diagnose`` without matplotlib writes its report without plots)
NEEDS: dict[str, tuple[str, ...]] = {"demo": ("lightning", "tensorboard"), "launch": ("accelerate",)}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(
            prog="pace", description="pace_strategy: skew monitoring and pacing."
        )
        parser.add_argument("--version", action="version", version=f"pace_strategy {__version__}")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        for name, (_, help_text) in COMMANDS.items():
            sub.add_parser(name, help=help_text, add_help=False)
        parser.parse_args(argv or ["--help"])
        return 2
    _configure_logging(os.environ.get("PACE_LOG_LEVEL", "WARNING").upper())
    try:
        require(f"pace {argv[0]}", *NEEDS.get(argv[0], ()))
        module = importlib.import_module(COMMANDS[argv[0]][0])
        status: int = module.main(argv[1:])
    except ImportError as error:
        missing = error if isinstance(error, MissingExtraError) else missing_extra(error, f"pace {argv[0]}")
        if missing is None:
            raise
        print(f"pace: {missing}", file=sys.stderr)
        return 2
    return status


def _configure_logging(level: str) -> None:
    """Our own logger only: the frameworks keep configuring theirs as they do without us."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("pace_strategy")
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


if __name__ == "__main__":
    sys.exit(main())
