"""The emulated two-rack test bed: bring-up, tear-down, shaping and refusal. (The slow-path
attribution on the 2-node fabric is in test_diagnose.py; see docs/testbed.md for the 4-node bed.)"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from pace_strategy import testbed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _require_root() -> None:
    try:
        testbed.check_environment()
    except testbed.TestbedError as error:
        pytest.skip(str(error))


def _prefix() -> str:
    return f"pt{uuid.uuid4().hex[:6]}"


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return sorted(name for name in out.split() if name.startswith(f"{prefix}-"))


def _tcp_ok(src: str, address: str) -> bool:
    """A TCP connection from namespace ``src`` to a listener on ``address`` (in its own namespace)."""
    code = f"import socket; socket.create_connection(({address!r}, 1), timeout=3)"
    done = subprocess.run(
        ["ip", "netns", "exec", src, sys.executable, "-c", code], capture_output=True, text=True, timeout=30
    )
    return "ConnectionRefused" in done.stderr  # the host answered (RST): it is reachable


def test_up_down_are_idempotent_and_shape_the_uplink():
    _require_root()
    prefix = _prefix()
    spec = testbed.FabricSpec(
        nodes=4, racks=2, uplink_mbit=40, slow_nodes=(3,), cpu_quota={2: 0.5}, prefix=prefix
    )
    try:
        fabric = testbed.up(spec)
        testbed.up(spec)  # a second up replaces the first: same state, no error
        assert _namespaces(prefix) == [f"{prefix}-fabric", *(f"{prefix}-n{i}" for i in range(4))]
        assert [n.rack for n in fabric.nodes] == [0, 0, 1, 1]
        qdisc = subprocess.run(
            ["tc", "-n", f"{prefix}-fabric", "qdisc", "show", "dev", "tb-u1a"], capture_output=True, text=True
        ).stdout
        assert "tbf" in qdisc and "40Mbit" in qdisc, qdisc
        slow = subprocess.run(
            ["tc", "-n", f"{prefix}-n3", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        )
        assert "20Mbit" in slow.stdout
        assert fabric.nodes[2].cgroup is not None and os.path.isdir(fabric.nodes[2].cgroup)
        assert _tcp_ok(f"{prefix}-n0", fabric.nodes[3].address)  # across the uplink
        assert testbed.status(prefix)["spec"]["uplink_mbit"] == 40
    finally:
        testbed.down(prefix)
    assert _namespaces(prefix) == [] and testbed.status(prefix) is None
    assert not os.path.exists(fabric.nodes[2].cgroup)
    assert testbed.down(prefix) == []  # nothing left: safe to repeat


def test_refuses_without_root_and_rejects_bad_specs():
    if os.geteuid() == 0:
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
             "pace_strategy.cli", "testbed", "up", "--prefix", _prefix()],
            capture_output=True, text=True, timeout=60, cwd="/",
        )  # fmt: skip
        assert done.returncode == 2 and "needs root" in done.stderr, done.stderr
    with pytest.raises(ValueError, match="racks=3"):
        testbed.FabricSpec(nodes=2, racks=3)
    with pytest.raises(ValueError, match="node 7"):
        testbed.FabricSpec(nodes=4, slow_nodes=(7,))
