"""``pace config``: every setting of :class:`~pace_strategy.PacingConfig`, its default, the environment
variable that sets it and what it means, for an operator who configures a job without reading code."""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "settings"]


def settings() -> list[dict[str, Any]]:
    """Every setting (``name`` or ``group.name``, in declaration order) with its ``default``, its
    ``variable`` (``PACE_*``), the YAML ``key`` under ``pacing_config:`` and its ``doc``."""
    from pace_strategy.core.config import SWITCHED_GROUPS, PacingConfig
    from pace_strategy.integrations.env import env_name

    defaults = PacingConfig().dotted_values()
    out = []
    for name, field in PacingConfig.dotted_fields().items():
        group, _, leaf = name.rpartition(".")
        default = defaults[name]
        variable = env_name(name)
        if group in SWITCHED_GROUPS and leaf == "enabled":
            variable += f" or {env_name(group)}"  # a group's bare switch: PACE_REBALANCE=1
        doc = field.metadata.get("doc", "")
        out.append({"name": name, "default": default, "variable": variable, "doc": doc})
    return out


def _text(rows: Sequence[dict[str, Any]], width: int = 100) -> str:
    lines = [
        "Every pacing setting: its default and the variable that sets it. The same names go in",
        "Trainer(strategy=PacedDDPStrategy(pacing={...})), pacing={...} of the other adapters, the",
        "pacing_config: section of an accelerate config (a group as a nested mapping) and a recipe.",
        "",
    ]
    for row in rows:
        lines.append(f"{row['name']} = {json.dumps(row['default'])}    [{row['variable']}]")
        lines += textwrap.wrap(row["doc"], width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pace config",
        description="Every pacing setting: its default, its PACE_* environment variable and its meaning "
        "(`pace env` shows the values in force here).",
    )
    p.add_argument("--json", action="store_true", help="print one JSON list")
    p.add_argument("name", nargs="*", help="only these settings (a group's name selects its settings)")
    args = p.parse_args(argv)
    rows = settings()
    if args.name:
        known = {row["name"] for row in rows} | {row["name"].split(".")[0] for row in rows}
        from pace_strategy.core.config import check_known_keys
        from pace_strategy.core.errors import PacingConfigError

        try:
            check_known_keys(args.name, sorted(known), "setting")
        except PacingConfigError as error:
            p.error(str(error))  # exit status 2, naming the nearest setting
        rows = [r for r in rows if r["name"] in args.name or r["name"].split(".")[0] in args.name]
    print(json.dumps(rows, indent=2) if args.json else _text(rows))
    return 0
