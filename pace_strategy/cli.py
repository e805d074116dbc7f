"""The ``pace`` command: ``pace demo``, ``diagnose``, ``simulate``, ``launch`` and ``testbed``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from pace_strategy._version import __version__

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pace", description="pace_strategy: skew monitoring and pacing.")
    parser.add_argument("--version", action="version", version=f"pace_strategy {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("demo", help="multi-process CPU training with an injected straggler", add_help=False)
    sub.add_parser("diagnose", help="name the failure mode of a recorded run, with plots", add_help=False)
    sub.add_parser("simulate", help="what-if simulator from 4 to 1,024+ nodes", add_help=False)
    sub.add_parser("launch", help="accelerate launch with a pacing_config: section", add_help=False)
    sub.add_parser("testbed", help="emulated two-rack cluster in network namespaces (root)", add_help=False)
    if not argv or argv[0] not in ("demo", "diagnose", "simulate", "launch", "testbed"):
        parser.parse_args(argv or ["--help"])
        return 2
    level = os.environ.get("PACE_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pace_strategy").setLevel(level)
    from pace_strategy.core.errors import PacingConfigError

    if argv[0] == "launch":
        from pace_strategy import launch

        return launch.main(argv[1:])
    if argv[0] == "testbed":
        from pace_strategy import testbed

        return testbed.main(argv[1:])
    if argv[0] == "simulate":
        from pace_strategy.sim import command as sim_command

        return sim_command.main(argv[1:])
    if argv[0] == "diagnose":
        from pace_strategy.diagnose import command

        return command.main(argv[1:])
    try:
        from pace_strategy import demo

        return demo.main(argv[1:])
    except PacingConfigError as error:
        print(f"pace {argv[0]}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
