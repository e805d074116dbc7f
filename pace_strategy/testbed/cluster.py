"""An emulated two-rack cluster on one Linux machine: network namespaces, bridges, a shaped uplink.

::

      rack 0 (bridge tb-r0)                     rack 1 (bridge tb-r1)
     node0   node1  ...                        node2   node3  ...
       |       |                                 |       |
     [br tb-r0] ===== uplink, tbf rate ========== [br tb-r1]      (in namespace PREFIX-fabric)
                     (+ delay element when delayed)

Each node is a namespace ``PREFIX-nI`` with one interface ``eth0`` (10.198.0.(I+1)/24) whose peer
sits on its rack's bridge in the fabric namespace. Traffic between racks crosses the uplink, shaped
with ``tbf`` in both directions (an oversubscribed spine); a node in ``slow_nodes`` gets its own
port shaped too (a slow path). A node in ``cpu_quota`` runs its ranks in a cgroup with that share
of one CPU (cgroup v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``). Only the namespaces, links and
cgroups created here are touched; ``down`` removes all of them and is safe to repeat. Root and
iproute2 are needed; ``up`` refuses with a message otherwise.

Delay, jitter and loss: this kernel has no ``netem``, so an uplink with a ``rack_delay`` on either
side is built from two TAP devices joined by the user-space delay element
(:mod:`pace_strategy.testbed.link`, one process per such uplink, seeded) instead of a veth pair;
``tbf`` still shapes it. ``rack_delay[R]`` applies to frames leaving rack R over its uplinks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pace_strategy.testbed.errors import TestbedError, TestbedSpecError
from pace_strategy.testbed.link import Impairment

__all__ = [
    "Fabric",
    "FabricSpec",
    "Node",
    "check_environment",
    "down",
    "run_on_nodes",
    "running",
    "status",
    "up",
]

SUBNET = "10.198.0"
STATE_DIR = Path("/run/pace-testbed")
CGROUP_ROOTS = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup"))


@dataclass(frozen=True)
class FabricSpec:
    """What to build. Rates are Mbit/s; ``cpu_quota`` maps a node index to a share of one CPU;
    ``rack_delay`` maps a rack index to the delay, jitter and loss of frames leaving that rack over
    the uplink (seeded with ``seed``)."""

    nodes: int = 4
    racks: int = 2
    uplink_mbit: float = 100.0  #: cross-rack uplink rate, each direction
    slow_nodes: tuple[int, ...] = ()  #: nodes whose own port is shaped to ``slow_path_mbit``
    slow_path_mbit: float = 20.0
    cpu_quota: Mapping[int, float] = field(default_factory=dict)
    #: the quota's cgroup period, ms (``cpu.cfs_period_us``): a node may run ``share x period`` of CPU
    #: time in every period and is throttled for the rest. 100 ms is the kernel's and Kubernetes'
    #: default; a longer period makes the slow steps fewer and longer (bursts)
    cpu_period_ms: float = 100.0
    rack_delay: Mapping[int, Impairment] = field(default_factory=dict)
    seed: int = 0
    prefix: str = "pace-tb"

    def __post_init__(self) -> None:
        if not 2 <= self.nodes <= 32:
            raise TestbedSpecError(f"testbed nodes={self.nodes!r} is invalid: expected 2..32.")
        if not 1 <= self.racks <= self.nodes:
            raise TestbedSpecError(f"testbed racks={self.racks!r} is invalid: expected 1..nodes.")
        if self.uplink_mbit <= 0 or self.slow_path_mbit <= 0:
            raise TestbedSpecError("testbed uplink_mbit and slow_path_mbit must be > 0 Mbit/s.")
        for n in (*self.slow_nodes, *self.cpu_quota):
            if not 0 <= n < self.nodes:
                raise TestbedSpecError(f"testbed node {n!r} is out of range 0..{self.nodes - 1}.")
        for n, share in self.cpu_quota.items():
            if not 0.01 <= share <= 1.0:
                raise TestbedSpecError(f"testbed cpu_quota[{n}]={share!r}: expected a share in 0.01..1.")
        if not 1.0 <= self.cpu_period_ms <= 1000.0:  # the kernel's bounds for cfs_period_us
            raise TestbedSpecError(f"testbed cpu_period_ms={self.cpu_period_ms!r}: expected 1..1000 ms.")
        for r, imp in self.rack_delay.items():
            if not 0 <= r < self.racks:
                raise TestbedSpecError(f"testbed rack_delay rack {r!r} is out of range 0..{self.racks - 1}.")
            if not isinstance(imp, Impairment):
                raise TestbedSpecError(f"testbed rack_delay[{r}] must be an Impairment, got {imp!r}.")
        if self.rack_delay and self.racks < 2:
            raise TestbedSpecError("testbed rack_delay needs racks >= 2: it impairs the cross-rack uplink.")
        if not self.prefix.replace("-", "").isalnum() or len(self.prefix) > 10:
            raise TestbedSpecError(f"testbed prefix={self.prefix!r}: letters, digits and '-', <= 10 chars.")

    def impairment(self, rack: int) -> Impairment:
        return self.rack_delay.get(rack, Impairment())

    def rack_of(self, node: int) -> int:
        """Nodes fill racks in order: with 4 nodes and 2 racks, nodes 0-1 in rack 0, 2-3 in rack 1."""
        return node * self.racks // self.nodes


@dataclass(frozen=True)
class Node:
    index: int
    netns: str
    address: str
    rack: int
    cgroup: str | None = None  #: cgroup directory the node's processes are put in, if CPU-limited

    @property
    def host(self) -> str:
        return f"rack{self.rack}-node{self.index}"


@dataclass(frozen=True)
class Fabric:
    spec: FabricSpec
    nodes: tuple[Node, ...]

    @property
    def master(self) -> Node:
        return self.nodes[0]


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def check_environment() -> None:
    """Raise :class:`TestbedError` unless namespaces can be built here."""
    if os.geteuid() != 0:
        raise TestbedError("the test bed needs root (network namespaces, tc, cgroups): run it as root.")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedError(f"the test bed needs iproute2 ({tool!r} not found): install iproute2.")


def _tbf(netns: str, dev: str, mbit: float) -> None:
    # burst >= 64 KB: with smaller bursts, large offloaded packets stall on this kernel
    _run("tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit",
         "burst", "64kb", "latency", "100ms")  # fmt: skip


def _cgroup_for(prefix: str, node: int, share: float, period_ms: float = 100.0) -> str:
    for root in CGROUP_ROOTS:
        if (root / "cpu.cfs_quota_us").exists() or (root / "cpu.max").exists():
            path = root / f"{prefix}-n{node}"
            path.mkdir(exist_ok=True)
            period = int(period_ms * 1000)
            if (path / "cpu.cfs_quota_us").exists():
                (path / "cpu.cfs_period_us").write_text(str(period))
                (path / "cpu.cfs_quota_us").write_text(str(int(share * period)))
            else:
                (path / "cpu.max").write_text(f"{int(share * period)} {period}")
            return str(path)
    raise TestbedError("no cgroup CPU controller found (cpu.cfs_quota_us or cpu.max): cpu_quota unavailable.")


def up(spec: FabricSpec) -> Fabric:
    """Build the fabric (after removing any left over with the same prefix). On failure, everything
    built so far is removed again and the error says which command failed."""
    check_environment()
    down(spec.prefix)
    fabric_ns = f"{spec.prefix}-fabric"
    nodes: list[Node] = []
    try:
        _run("ip", "netns", "add", fabric_ns)
        _run("ip", "-n", fabric_ns, "link", "set", "lo", "up")
        for r in range(spec.racks):
            _run("ip", "-n", fabric_ns, "link", "add", f"tb-r{r}", "type", "bridge")
            _run("ip", "-n", fabric_ns, "link", "set", f"tb-r{r}", "up")
        for r in range(1, spec.racks):  # a chain of uplinks: rack r-1 <-> rack r, shaped both ways
            a, b = f"tb-u{r}a", f"tb-u{r}b"
            delayed = not (spec.impairment(r - 1).is_identity and spec.impairment(r).is_identity)
            if delayed:  # two TAP devices; the delay element carries frames between them
                for dev in (a, b):
                    _run("ip", "-n", fabric_ns, "tuntap", "add", "dev", dev, "mode", "tap")
            else:
                _run("ip", "-n", fabric_ns, "link", "add", a, "type", "veth", "peer", "name", b)
            for dev, bridge in ((a, f"tb-r{r - 1}"), (b, f"tb-r{r}")):
                _run("ip", "-n", fabric_ns, "link", "set", dev, "master", bridge)
                _run("ip", "-n", fabric_ns, "link", "set", dev, "up")
                _tbf(fabric_ns, dev, spec.uplink_mbit)
            if delayed:
                _start_link(spec, r, fabric_ns, a, b)
        for i in range(spec.nodes):
            ns, rack, port = f"{spec.prefix}-n{i}", spec.rack_of(i), f"tb-p{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run(
                "ip",
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                fabric_ns,
            )
            _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", fabric_ns, "link", "set", port, "master", f"tb-r{rack}")
            _run("ip", "-n", fabric_ns, "link", "set", port, "up")
            if i in spec.slow_nodes:
                _tbf(ns, "eth0", spec.slow_path_mbit)  # the node's uplink...
                _tbf(fabric_ns, port, spec.slow_path_mbit)  # ...and its downlink
            cgroup = (
                _cgroup_for(spec.prefix, i, spec.cpu_quota[i], spec.cpu_period_ms)
                if i in spec.cpu_quota
                else None
            )
            nodes.append(Node(i, ns, f"{SUBNET}.{i + 1}", rack, cgroup))
    except BaseException:
        down(spec.prefix)
        raise
    fabric = Fabric(spec, tuple(nodes))
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    described = {
        **asdict(spec),
        "cpu_quota": dict(spec.cpu_quota),
        "rack_delay": {r: str(imp) for r, imp in spec.rack_delay.items()},
    }
    state = {"spec": described, "nodes": [asdict(n) for n in nodes]}
    (STATE_DIR / f"{spec.prefix}.json").write_text(json.dumps(state, indent=2) + "\n")
    return fabric


def _start_link(spec: FabricSpec, r: int, fabric_ns: str, a: str, b: str) -> None:
    """Start uplink ``r``'s delay element in the fabric namespace; its pid file is written before
    anything can fail, so ``down`` stops it whatever happens next."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    log = STATE_DIR / f"{spec.prefix}-link{r}.log"
    cmd = ["ip", "netns", "exec", fabric_ns, sys.executable, "-m", "pace_strategy.testbed.link", a, b]
    cmd += [f"--a-to-b={spec.impairment(r - 1)}", f"--b-to-a={spec.impairment(r)}", f"--seed={spec.seed + r}"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    (STATE_DIR / f"{spec.prefix}-link{r}.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + 20.0
    while "ready" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise TestbedError(f"the delay element of uplink {r} did not start: {log.read_text().strip()}")
        time.sleep(0.05)


def _stop_links(prefix: str) -> list[str]:
    """Stop the delay elements ``up`` started (only processes that still are one: pids get reused)."""
    stopped: list[str] = []
    for pidfile in sorted(STATE_DIR.glob(f"{prefix}-link*.pid")) if STATE_DIR.exists() else ():
        pid = int(pidfile.read_text())
        try:
            is_ours = b"pace_strategy.testbed.link" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            is_ours = False
        if is_ours:
            os.kill(pid, signal.SIGTERM)
            for _ in range(40):
                if not Path(f"/proc/{pid}").exists() or "State:\tZ" in _proc_status(pid):
                    break
                time.sleep(0.05)
            else:
                os.kill(pid, signal.SIGKILL)
            stopped.append(f"delay element pid {pid}")
        pidfile.unlink(missing_ok=True)
        pidfile.with_suffix(".log").unlink(missing_ok=True)
    return stopped


def _proc_status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""


def down(prefix: str = "pace-tb") -> list[str]:
    """Stop the delay elements and remove every namespace and cgroup named ``PREFIX-*`` and the
    state file; returns what was removed. Safe to call when nothing is there."""
    removed: list[str] = _stop_links(prefix)
    if shutil.which("ip") is None:
        return removed
    listing = _run("ip", "netns", "list", check=False).stdout.split()
    for name in listing:
        if name.startswith(f"{prefix}-"):
            _run("ip", "netns", "del", name, check=False)  # its veth ends (and so the pairs) go too
            removed.append(name)
    for root in CGROUP_ROOTS:
        for path in root.glob(f"{prefix}-n*") if root.exists() else ():
            for _ in range(50):  # a cgroup can only be removed once its processes have exited
                try:
                    path.rmdir()
                    removed.append(str(path))
                    break
                except OSError:
                    time.sleep(0.1)
    (STATE_DIR / f"{prefix}.json").unlink(missing_ok=True)
    return removed


def status(prefix: str = "pace-tb") -> dict[str, object] | None:
    """The state written by ``up``, or ``None`` when no fabric with this prefix is up."""
    path = STATE_DIR / f"{prefix}.json"
    return json.loads(path.read_text()) if path.exists() else None


def run_on_nodes(
    fabric: Fabric, args: Sequence[str], *, env: Mapping[str, str] | None = None, port: int = 29511,
    timeout_s: float = 600.0,
) -> list[subprocess.CompletedProcess[str]]:  # fmt: skip
    """Run ``python -m pace_strategy demo ARGS --num-nodes N`` once per node, in its namespace, as a
    multi-node launcher would (``NODE_RANK``, ``MASTER_ADDR`` = node 0, gloo on ``eth0``); a node with
    a CPU quota runs in its cgroup. Kills every node's processes on timeout or interrupt."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for node in fabric.nodes:
            node_env = dict(os.environ, OMP_NUM_THREADS="1", NODE_RANK=str(node.index))
            node_env.update(MASTER_ADDR=fabric.master.address, MASTER_PORT=str(port))
            node_env.update(GLOO_SOCKET_IFNAME="eth0", PACE_HOSTNAME=node.host, **(env or {}))
            cmd = ["ip", "netns", "exec", node.netns, sys.executable, "-m", "pace_strategy", "demo"]
            cmd += [*args, "--num-nodes", str(len(fabric.nodes))]
            proc = subprocess.Popen(
                cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            if node.cgroup is not None:  # before the demo forks its ranks: they inherit the cgroup
                (Path(node.cgroup) / "cgroup.procs").write_text(str(proc.pid))
            procs.append(proc)
        deadline = time.monotonic() + timeout_s
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out, err)
        for p, (out, err) in zip(procs, outs, strict=True)
    ]


@contextlib.contextmanager
def running(spec: FabricSpec) -> Iterator[Fabric]:
    """``up`` on entry, ``down`` on exit, also on error or interrupt."""
    fabric = up(spec)
    try:
        yield fabric
    finally:
        down(spec.prefix)
