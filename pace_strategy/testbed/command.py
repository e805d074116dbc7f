"""``pace testbed up|down|status``: the command line of the emulated cluster."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pace_strategy.testbed.cluster import FabricSpec, down, status, up
from pace_strategy.testbed.errors import TestbedError
from pace_strategy.testbed.link import Impairment

__all__ = ["main"]


def _quota(text: str) -> tuple[int, float]:
    node, _, share = text.partition("=")
    try:
        return int(node), float(share)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NODE=SHARE (e.g. 2=0.5), got {text!r}") from None


def _rack_delay(text: str) -> tuple[int, Impairment]:
    rack, _, impairment = text.partition("=")
    try:
        return int(rack), Impairment.parse(impairment)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"expected RACK=MS[:JITTER[:LOSS]] (e.g. 1=5:1:0.001), got {text!r}: {error}"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``pace testbed up|down|status``."""
    p = argparse.ArgumentParser(prog="pace testbed", description="The emulated two-rack cluster (root).")
    sub = p.add_subparsers(dest="action", required=True)
    u = sub.add_parser("up", help="build it (replacing one with the same prefix)")
    u.add_argument("--nodes", type=int, default=4)
    u.add_argument("--racks", type=int, default=2)
    u.add_argument("--uplink-mbit", type=float, default=100.0, help="cross-rack uplink rate")
    u.add_argument("--slow-node", type=int, action="append", default=[], help="shape this node's port")
    u.add_argument("--slow-path-mbit", type=float, default=20.0)
    u.add_argument("--cpu-quota", type=_quota, action="append", default=[], metavar="NODE=SHARE")
    u.add_argument(
        "--rack-delay",
        type=_rack_delay,
        action="append",
        default=[],
        metavar="RACK=MS[:JITTER[:LOSS]]",
        help="delay (ms), jitter (ms, normal sd) and loss share of frames leaving RACK over the uplink",
    )
    u.add_argument("--seed", type=int, default=0, help="seed of the delay elements' schedules")
    for q in (u, sub.add_parser("down", help="remove it (safe to repeat)"), sub.add_parser("status")):
        q.add_argument("--prefix", default="pace-tb", help="name prefix of its namespaces and cgroups")
    args = p.parse_args(argv)
    try:
        if args.action == "up":
            spec = FabricSpec(
                nodes=args.nodes,
                racks=args.racks,
                uplink_mbit=args.uplink_mbit,
                slow_nodes=tuple(args.slow_node),
                slow_path_mbit=args.slow_path_mbit,
                cpu_quota=dict(args.cpu_quota),
                rack_delay=dict(args.rack_delay),
                seed=args.seed,
                prefix=args.prefix,
            )
            fabric = up(spec)
            for node in fabric.nodes:
                extra = f", cgroup {node.cgroup}" if node.cgroup else ""
                print(f"{node.netns:<14} {node.address:<12} rack {node.rack}{extra}")
            delays = "".join(f"; rack {r} egress {imp} (ms:ms:loss)" for r, imp in spec.rack_delay.items())
            print(
                f"uplink {spec.uplink_mbit:g} Mbit/s{delays}; "
                f"remove with: pace testbed down --prefix {spec.prefix}"
            )
        elif args.action == "down":
            removed = down(args.prefix)
            print(f"removed {len(removed)}: {', '.join(removed)}" if removed else "nothing to remove")
        else:
            state = status(args.prefix)
            print(json.dumps(state, indent=2) if state else f"no test bed with prefix {args.prefix!r} is up")
    except TestbedError as error:
        print(f"pace testbed: error: {error}", file=sys.stderr)
        return 2
    return 0
