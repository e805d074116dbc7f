"""A two-"node" emulated fabric for tests: two network namespaces joined by a veth link, rate-limited.

Traffic stays inside the namespaces this helper creates (10.199.N.0/24 on its own veth pair); both
namespaces are deleted on exit, also on error. Needs root and iproute2; tests skip otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Node:
    netns: str
    ifname: str
    address: str
    host: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def skip_unless_netns() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("iproute2 (ip, tc) is not installed")


@contextlib.contextmanager
def two_node_fabric(slow_rate_mbit: int) -> Iterator[tuple[Node, Node]]:
    """Node a and node b; b's egress (its uplink) is shaped to ``slow_rate_mbit`` with tbf."""
    skip_unless_netns()
    tag = uuid.uuid4().hex[:6]
    subnet = 100 + int(tag[:2], 16) % 100
    a = Node(f"pace-{tag}-a", f"pa{tag}", f"10.199.{subnet}.1", "rack-a")
    b = Node(f"pace-{tag}-b", f"pb{tag}", f"10.199.{subnet}.2", "rack-b")
    created: list[str] = []
    try:
        for node in (a, b):
            _ip("netns", "add", node.netns)
            created.append(node.netns)
        _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        for node in (a, b):
            _ip("link", "set", node.ifname, "netns", node.netns)
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            _ip("-n", node.netns, "link", "set", node.ifname, "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        # burst >= 64 KB: with smaller bursts large offloaded packets stall on this kernel
        subprocess.run(
            [
                "tc",
                "-n",
                b.netns,
                "qdisc",
                "add",
                "dev",
                b.ifname,
                "root",
                "tbf",
                "rate",
                f"{slow_rate_mbit}mbit",
                "burst",
                "64kb",
                "latency",
                "100ms",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        yield a, b
    except subprocess.CalledProcessError as error:
        if not created:
            pytest.skip(f"cannot create network namespaces here: {error.stderr.strip()}")
        raise
    finally:
        for ns in created:  # deleting a namespace removes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def run_in_nodes(
    jobs: list[tuple[Node, list[str], dict[str, str]]], timeout_s: float
) -> list[tuple[int, str]]:
    """Start each job's command (argv, environment) in its node's namespace, all at once, and wait for
    them: each job's exit status and output (stdout and stderr). One still running after
    ``timeout_s`` is killed (status negative, its output kept)."""
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", node.netns, *cmd],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node, cmd, env in jobs
    ]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            outs.append(proc.communicate()[0])
    return [(proc.wait(), out) for proc, out in zip(procs, outs, strict=True)]
