"""Zero-code pacing's processes: accelerate's launcher, and each worker running the unchanged script.

The launcher starts every worker through this module; the worker installs the hooks
(:mod:`.zero_code`) and runs the user's script as ``python`` would.

``pace launch ... train.py ARGS`` (with a ``pacing_config:`` section) runs::

    python -m pace_strategy.integrations.accelerate.bootstrap --pace-launcher [accelerate args] train.py ARGS

which parses the arguments with accelerate's own parser and launcher and makes this module the
training module (``--module``), so that each worker is::

    python -u -m pace_strategy.integrations.accelerate.bootstrap train.py ARGS

and runs ``train.py`` as ``__main__`` with ``sys.argv == ["train.py", *ARGS]`` (``-m pkg.train``
works too). Why not a ``sitecustomize`` on ``PYTHONPATH``: it runs in every Python process that
inherits the variable (the script's subprocesses, tools it starts) and shadows the user's own; nor a
``.pth`` file: it runs in every process of the environment and stays after the run. This module
runs only in the workers ``pace launch`` started, and writes nothing.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

__all__ = ["LAUNCHER_FLAG", "MODULE", "launch_workers", "main", "run_worker"]

MODULE = "pace_strategy.integrations.accelerate.bootstrap"
#: first argument of the launcher process (no script name starts with ``--``)
LAUNCHER_FLAG = "--pace-launcher"


def launch_workers(argv: Sequence[str]) -> None:
    """``accelerate launch ARGV``, every worker started through this module (``--no_python``:
    unchanged, the program is not Python)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(list(argv))
    if args.no_python:
        print(
            "pace launch: --no_python: the program is started as it is and is not paced unless it calls "
            "attach_pacing itself (the PACE_* variables are set)",
            file=sys.stderr,
        )
    else:
        target = ["-m", args.training_script] if args.module else [args.training_script]
        args.training_script_args = [*target, *args.training_script_args]
        args.training_script, args.module = MODULE, True
    launch_command(args)


def run_worker(argv: Sequence[str]) -> None:
    """Run ``SCRIPT ARGS`` (or ``-m MODULE ARGS``) as ``python`` would, with the zero-code hooks.

    A normal end (the script returns, or ``sys.exit(0)``) finishes any pacing still attached
    (collective: every rank gets there); an exception closes the run record as failed, locally.
    """
    from pace_strategy.integrations.accelerate import zero_code

    argv = list(argv)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(f"usage: python -m {MODULE} SCRIPT [ARGS] | -m MODULE [ARGS]")
    zero_code.install()
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # run_module sets argv[0] to the module's file
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` has it
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code in (None, 0):
            zero_code.finish_attached()
        else:
            zero_code.fail_attached(stop)
        raise
    except BaseException as error:
        zero_code.fail_attached(error)
        raise
    zero_code.finish_attached()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [LAUNCHER_FLAG]:
        launch_workers(argv[1:])
    else:
        run_worker(argv)


if __name__ == "__main__":
    main()
