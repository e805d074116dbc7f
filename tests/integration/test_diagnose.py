"""`pace diagnose` on real recorded runs (multi-process, gloo), one per failure mode."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pace_strategy.diagnose.findings import diagnose
from pace_strategy.telemetry import read_run_record
from pace_strategy.telemetry.arrays import load_arrays, load_lines
from tests.integration.helpers import (
    diagnose_json,
    free_port,
    only_version_dir,
    pace_diagnose,
    run_demo,
    why_failed,
)
from tests.integration.preloaded import PreloadedJob, run_python

pytestmark = [pytest.mark.integration, pytest.mark.alone, pytest.mark.timeout(240)]

#: the ranks forked from the demo's launcher, which has imported Lightning already (a rank started
#: as a new process imports it again: about 9 s of each run); the popen start of ``paced_ddp`` is
#: tested in test_lightning.py
PACING = ("--strategy", "paced_ddp_fork", "--pacing", "mode=monitor", "--pacing", "exchange_every_steps=8")


def modes(result: dict) -> list[str]:
    return [f["mode"] for f in result["findings"]]


def record(tmp_path: Path, name: str, *args: str) -> Path:
    """A demo run (its own diagnosis left out: the test runs ``pace diagnose``), its run directory."""
    out = run_demo(
        tmp_path, "--quiet", "--no-diagnosis", "--name", name, "--compute-ms", "10", *PACING, *args
    )
    assert out.returncode == 0, why_failed(out.stderr, 3000)
    return only_version_dir(tmp_path, name)


def test_persistent_straggler(tmp_path):
    run = record(tmp_path, "slow", "--devices", "4", "--steps", "50", "--straggler", "2:30")
    result = diagnose_json(run)
    top = result["findings"][0]
    assert top["mode"] == "persistent_straggler" and top["ranks"] == [2], result["findings"]
    assert "rank 2" in top["evidence"] and top["lost_step_fraction"] > 0.1
    # projected to scale: one slow rank in four stays as common at every size
    assert [p["ranks"] for p in top["projection"]] == [8, 64, 512, 1024]
    assert all(p["lost_fraction"] > 0.05 for p in top["projection"]), top["projection"]
    # the report renders and holds the plots
    html = Path(result["report"]["html"]).read_text()
    assert html.count("data:image/png;base64,") == 6 and "at scale" in html
    for plot in ("skew", "lead_heatmap", "stragglers", "step_time", "delays", "projection"):
        assert Path(result["report"][plot]).stat().st_size > 1000


@pytest.mark.parametrize("inject_after", [1, 2])
def test_a_rank_slow_in_backward_is_a_persistent_straggler_late_by_its_delay(tmp_path, inject_after):
    """Real compute (no sleep before the forward), rank 1's backward 16 ms longer after hidden block 1
    (the end of backward) or 2 (just after the first gradients): the first gradient is on time, the
    arrival is not. A first-gradient arrival read this run as healthy."""
    run = record(
        tmp_path, "backward", "--devices", "2", "--steps", "60", "--compute-ms", "0", "--straggler", "1:16",
        "--straggler-phase", "backward", "--inject-after", str(inject_after),
    )  # fmt: skip
    top = diagnose_json(run)["findings"][0]
    assert top["mode"] == "persistent_straggler" and top["ranks"] == [1], top
    # at least the injection (a sleep is never shorter than asked), at most half again (a loaded
    # machine overshoots it: 17.7 ms for 16 once), so not the 0 a first-gradient arrival reads
    assert 0.9 * 16.0 <= top["details"]["late_ms"] <= 1.5 * 16.0, top["details"]
    assert top["details"]["compute_late_ms"] >= 0.9 * 16.0, top["details"]  # its own compute


def test_a_rank_slow_in_forward_and_backward_by_real_cpu_work(tmp_path):
    """Rank 1 does 24 ms more CPU work per step, half in its forward and half in its backward."""
    run = record(
        tmp_path, "spin", "--devices", "2", "--steps", "60", "--compute-ms", "0", "--straggler", "1:24",
        "--straggler-phase", "forward_backward", "--spin",
    )  # fmt: skip
    top = diagnose_json(run)["findings"][0]
    assert top["mode"] == "persistent_straggler" and top["ranks"] == [1], top
    assert 0.9 * 24.0 <= top["details"]["late_ms"] <= 1.5 * 24.0, top["details"]  # as the sleep above


def test_transient_stragglers_are_sync_amplification(tmp_path):
    # two ranks: with more ranks than this machine's two cores the host is oversubscribed, which
    # takes precedence (see test_more_ranks_than_cores_is_host_oversubscription)
    run = record(
        tmp_path, "transient", "--devices", "2", "--steps", "80", "--straggler", "0:30:0.15,1:30:0.15"
    )
    result = diagnose_json(run)
    assert modes(result)[0] == "sync_amplification", result["findings"]
    projected = [p["lost_fraction"] for p in result["findings"][0]["projection"]]
    assert projected[-1] > result["findings"][0]["lost_step_fraction"], projected  # worse with more ranks


def crowded_run(tmp_path: Path, straggler: str, steps: int) -> dict:
    """Three single-threaded ranks on two cores (their affinity says so in the header), diagnosed."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    demo = ["--root", str(tmp_path / "runs"), "--quiet", "--no-diagnosis", "--name", "crowded"]
    demo += ["--compute-ms", "10", *PACING, "--devices", "3", "--steps", str(steps), "--straggler", straggler]
    out = run_python(["-m", "pace_strategy", "demo", *demo], cwd=tmp_path, env=env, timeout=150, cpus=cores)
    assert out.returncode == 0, why_failed(out.stderr, 3000)
    return diagnose_json(only_version_dir(tmp_path, "crowded"))


def test_more_ranks_than_cores_is_host_oversubscription(tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:2]
    result = crowded_run(tmp_path, "", 40)
    assert modes(result)[0] == "host_oversubscription", result["findings"]
    assert "sync_amplification" not in modes(result) and "fabric_contention" not in modes(result)
    top = result["findings"][0]
    assert top["ranks"] == [0, 1, 2] and top["details"]["busy_threads"] == 3
    assert f"3 busy threads on {len(cores)} usable cores" in top["evidence"], top["evidence"]
    assert "1 intra-op thread each (OMP_NUM_THREADS=1)" in top["evidence"]


def test_slow_data_loader(tmp_path):
    run = record(
        tmp_path, "data", "--devices", "2", "--steps", "50", "--straggler", "", "--data-delay", "1:30"
    )
    result = diagnose_json(run)
    top = result["findings"][0]
    assert top["mode"] == "data_stall" and top["ranks"] == [1], result["findings"]


def test_healthy_run(tmp_path):
    run = record(tmp_path, "healthy", "--devices", "2", "--steps", "50", "--straggler", "")
    result = diagnose_json(run)
    assert modes(result) == ["healthy"], result["findings"]


def launch_nodes(tmp_path: Path, name: str, nodes: list[tuple[dict, list[str]]], *demo_args: str) -> None:
    """Start one demo process per node, as a multi-node launcher would (NODE_RANK, MASTER_* set).

    ``nodes``: per node, extra environment and a command prefix (e.g. ``ip netns exec NS``).
    """
    port = str(free_port())
    procs = []
    for node_rank, (extra_env, prefix) in enumerate(nodes):
        env = dict(os.environ, OMP_NUM_THREADS="1", NODE_RANK=str(node_rank), MASTER_PORT=port, **extra_env)
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "pace_strategy",
            "demo",
            "--root",
            str(tmp_path / "runs"),
            "--name",
            name,
            "--quiet",
            "--no-diagnosis",
            "--compute-ms",
            "10",
            *PACING,
            "--num-nodes",
            str(len(nodes)),
            "--straggler",
            "",
            *demo_args,
        ]
        if prefix:  # a command into a network namespace: a new interpreter there
            procs.append(
                subprocess.Popen(
                    cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        else:
            procs.append(PreloadedJob(cmd[1:], cwd=tmp_path, env=env))
    try:
        outs = [(p.communicate(timeout=180)[1] or "", p.returncode) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(code == 0 for _, code in outs), [err[-2000:] for err, _ in outs]


def test_slow_local_rank_on_every_node_is_locality(tmp_path):
    """Two node groups on one machine, local rank 1 slow on both."""
    nodes = [({"PACE_HOSTNAME": "node-a"}, []), ({"PACE_HOSTNAME": "node-b"}, [])]
    # the window exchange through the node leaders, each writing its node's rows of the record: the
    # diagnosis reads the same
    launch_nodes(
        tmp_path, "local", nodes, "--devices", "2", "--steps", "50", "--straggler-local", "1:30",
        "--pacing", "exchange_topology=node_leaders", "--pacing", "record_format=arrow",
    )  # fmt: skip
    run = only_version_dir(tmp_path, "local")
    record = read_run_record(run)
    assert record.end["exchange"] == {"topology": "node_leaders", "nodes": [[0, 1], [2, 3]]}
    shards = [s["file"] for s in record.header["rank_columns"]["shards"]]
    assert shards == ["pace_run.ranks.node0.arrow", "pace_run.ranks.node1.arrow"]
    assert all((run / shard).is_file() for shard in shards) and len(record.steps) == 50
    result = diagnose_json(run)
    top = result["findings"][0]
    assert top["mode"] == "locality" and top["ranks"] == [1, 3], result["findings"]
    assert top["hosts"] == ["node-a", "node-b"]
    # pace diagnose read the shards a block of steps at a time: as the record loaded whole gives it
    streamed, loaded = diagnose(load_lines(run)).to_dict(), diagnose(load_arrays(run)).to_dict()
    for d in (streamed, loaded):
        d["projection"].pop("seconds")
    assert streamed == loaded


def test_the_console_command_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pace_strategy.cli", "diagnose", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "pace diagnose: error:" in out.stderr


def test_unreadable_records_fail_clearly(tmp_path):
    def run(path):
        code, _, err = pace_diagnose(str(path), "--json")
        return subprocess.CompletedProcess([], code, "", err)

    missing = run(tmp_path / "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "pace_run.jsonl").write_text("")
    empty = run(tmp_path / "empty")
    assert empty.returncode == 2 and "empty" in empty.stderr
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "pace_run.jsonl").write_text("garbage\n{}\n")
    bad = run(tmp_path / "bad")
    assert bad.returncode == 2 and "not valid JSON" in bad.stderr
    for d in ("a", "b"):
        (tmp_path / "two" / d).mkdir(parents=True)
        (tmp_path / "two" / d / "pace_run.jsonl").write_text("{}\n")
    two = run(tmp_path / "two")
    assert two.returncode == 2 and "pass one of these" in two.stderr


@pytest.mark.long
def test_rate_limited_uplink_is_fabric_contention(tmp_path):
    """Two nodes in network namespaces; node b's uplink shaped to 40 Mbit/s (a slow, shared path)."""
    from tests.integration.netns import two_node_fabric

    with two_node_fabric(slow_rate_mbit=40) as (a, b):
        nodes = [
            (
                {"PACE_HOSTNAME": n.host, "GLOO_SOCKET_IFNAME": n.ifname, "MASTER_ADDR": a.address},
                ["ip", "netns", "exec", n.netns],
            )
            for n in (a, b)
        ]
        launch_nodes(tmp_path, "fabric", nodes, "--devices", "1", "--steps", "40")
        # The same fabric with pacing forced on: node a's rank leads by waits but not by compute, so
        # the controller must never delay it for lateness the network caused.
        launch_nodes(tmp_path, "forced", nodes, "--devices", "1", "--steps", "40", "--pacing", "mode=forced")
    forced = read_run_record(only_version_dir(tmp_path, "forced"))
    leads = [s["ranks"]["lead_ms"][0] for s in forced.steps if not s["warmup"]]
    assert statistics.median(leads) > 10.0  # rank 0 does wait for rank 1 at every step...
    assert all(s["delay_ms_max"] == 0.0 for s in forced.steps)  # ...and is never paced for it
    result = diagnose_json(only_version_dir(tmp_path, "fabric"))
    # Node b's rank finishes each collective late, so it starts late and arrives last although its
    # compute is normal: the diagnosis must blame its network path, not the rank.
    assert modes(result)[0] == "fabric_contention", result["findings"]
    late = [f for f in result["findings"] if f["mode"] == "fabric_contention" and f["ranks"] == [1]]
    assert late, result["findings"]
    assert late[0]["hosts"] == ["rack-b"] and "own work was normal" in late[0]["evidence"]
    # the late start is in the framework's loop between steps (Lightning's per-step broadcast from
    # rank 0 completes late behind the slow egress), not in its own optimizer step or input
    details = late[0]["details"]
    assert details["loop_late_ms"] > 10.0 and abs(details["own_between_steps_late_ms"]) < 2.0, details
    assert "persistent_straggler" not in modes(result)
