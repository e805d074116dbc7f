"""How often `pace diagnose` names a problem in a clean run, and whether it still names injected ones.

Not a test; prints what it measured. Records real multi-process CPU runs (`pace demo`, gloo, paced_ddp
with its default settings, no injected straggler) at 2, 3 and 4 ranks x emulated compute of 5, 12, 30
and 60 ms per step (a sleep before the forward) and x real compute only (the MLP at width 256, 32
samples per rank, and width 1024, 128 samples: no sleep at all) x seeds, diagnoses each, and counts
the runs that read anything but `healthy`.
On a machine with fewer cores than ranks (3-4 ranks on this project's 2 cores, one intra-op thread
each) a clean run is oversubscribed, and `host_oversubscription` is then the right reading: those
runs are counted apart (named / any other finding). Then the injected scenarios, which must still be
named (first, with the right ranks; any unexpected extra finding is listed): a persistent straggler,
a slow data loader, rotating transient stragglers, a slow local rank on two "nodes" (locality), a
persistent straggler on an oversubscribed host, rotating transient stragglers on one (named
beside it), two of four ranks slow in their backward (a slow group), one rank slow in its backward
for steps 50-89 only (a straggler episode), and with real compute only: a rank slow in its
backward (a sleep at the injection point after the first block) and one doing real CPU work in its
forward and backward.

    python benchmarks/diagnose_false_alarms.py [--seeds 0,1,2] [--ranks 2,3,4] [--steps 120]
        [--clean emulated,real] [--root DIR] [--reuse] [--no-injected]

``--seed`` seeds the demo's model and data; the timing noise of a real run is not seeded, which is
what repeating a configuration measures. ``--reuse`` diagnoses the runs already recorded under
``--root`` instead of recording them again (to try other thresholds with ``--set``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.findings import diagnose
from pace_strategy.diagnose.hosts import host_loads
from pace_strategy.settings import load_mapping
from pace_strategy.telemetry.arrays import load_arrays

COMPUTE_MS = (5, 12, 30, 60)
#: real-compute clean runs: (MLP width, samples per rank), no emulated compute
REAL_MODELS = ((256, 32), (1024, 128))


@dataclass(frozen=True)
class Scenario:
    name: str
    ranks: int  #: per node
    compute_ms: float
    args: tuple[str, ...] = ()
    nodes: int = 1
    expect: str = "healthy"  #: the mode that must come first
    expect_ranks: tuple[int, ...] = ()  #: and the ranks it must name (empty: any)
    seed: int = 0
    extra_ok: tuple[str, ...] = field(default=())  #: other modes expected beside it (not listed as extra)
    workload: str = ""  #: the clean runs' table row label ("": the emulated compute per step)

    @property
    def label(self) -> str:
        return self.workload or f"{self.compute_ms:g}ms"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record(root: Path, sc: Scenario, steps: int) -> Path:
    """Run the scenario (one demo process per node) unless its record exists; its run directory."""
    found = sorted((root / sc.name).glob("version_*/pace_run.jsonl"))
    if found:
        return found[-1].parent
    base = [
        sys.executable,
        "-m",
        "pace_strategy",
        "demo",
        "--quiet",
        "--no-diagnosis",
        "--root",
        str(root),
        "--name",
        sc.name,
        "--devices",
        str(sc.ranks),
        "--steps",
        str(steps),
        "--compute-ms",
        f"{sc.compute_ms:g}",
        "--seed",
        str(sc.seed),
        "--straggler",
        "",
        *sc.args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if sc.nodes == 1:
        procs = [subprocess.Popen(base, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    else:  # "nodes" on one machine, as a multi-node launcher starts them
        port = str(_free_port())
        procs = []
        for node in range(sc.nodes):
            node_env = dict(
                env,
                NODE_RANK=str(node),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                PACE_HOSTNAME=f"node-{chr(ord('a') + node)}",
            )
            cmd = [*base, "--num-nodes", str(sc.nodes)]
            procs.append(
                subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
    outs = [p.communicate(timeout=900) for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"{sc.name} failed:\n" + "\n".join(o[1][-2000:] for o in outs))
    return sorted((root / sc.name).glob("version_*/pace_run.jsonl"))[-1].parent


def read(run_dir: Path, cfg: DiagnosisConfig) -> dict[str, Any]:
    a = load_arrays(run_dir)
    started = time.monotonic()
    d = diagnose(a, cfg)
    crowded = [h.host for h in host_loads(list(a.header.get("topology", []))) if h.ratio > 1]
    return {
        "modes": [f.mode.value for f in d.findings],
        "ranks": [f.ranks for f in d.findings],
        "lost": d.stats["lost_step_fraction"],
        "floor": d.stats["noise_floor_fraction"],
        "step_ms": d.stats["median_step_ms"],
        "oversubscribed": bool(crowded),
        "seconds": time.monotonic() - started,
        "waiting_at_scale": d.projection.get("waiting", []),
    }


def clean_scenarios(seeds: list[int], ranks: list[int], kinds: list[str]) -> list[Scenario]:
    out = []
    if "emulated" in kinds:
        out += [
            Scenario(f"clean-r{r}-c{c}-s{s}", r, c, seed=s) for r in ranks for c in COMPUTE_MS for s in seeds
        ]
    if "real" in kinds:
        out += [
            Scenario(
                f"clean-real-r{r}-h{h}-b{b}-s{s}",
                r,
                0,
                ("--hidden", str(h), "--batch-size", str(b)),
                seed=s,
                workload=f"real h{h} b{b}",
            )
            for r in ranks
            for h, b in REAL_MODELS
            for s in seeds
        ]
    return out


def injected_scenarios() -> list[Scenario]:
    return [
        Scenario(
            "persistent-r2", 2, 12, ("--straggler", "1:30"), expect="persistent_straggler", expect_ranks=(1,)
        ),
        Scenario("data-stall-r2", 2, 10, ("--data-delay", "1:30"), expect="data_stall", expect_ranks=(1,)),
        Scenario("rotating-r2", 2, 12, ("--straggler", "0:30:0.1,1:30:0.1"), expect="sync_amplification"),
        Scenario(
            "locality-2x2",
            2,
            10,
            ("--straggler-local", "1:30"),
            nodes=2,
            expect="locality",
            expect_ranks=(1, 3),
            extra_ok=("host_oversubscription",),
        ),
        Scenario(
            "rotating-r3-crowded",
            3,
            12,
            ("--straggler", "0:30:0.1,1:30:0.1,2:30:0.1"),
            expect="sync_amplification",
            extra_ok=("host_oversubscription",),
        ),
        Scenario(
            "persistent-r4-crowded",
            4,
            10,
            ("--straggler", "2:30"),
            expect="persistent_straggler",
            expect_ranks=(2,),
            extra_ok=("host_oversubscription",),
        ),
        Scenario(
            "backward-real-r2",
            2,
            0,
            ("--straggler", "1:16", "--straggler-phase", "backward"),
            expect="persistent_straggler",
            expect_ranks=(1,),
        ),
        Scenario(
            "group-backward-r4",
            4,
            10,
            ("--straggler", "1:16,2:16", "--straggler-phase", "backward"),
            expect="persistent_straggler",
            expect_ranks=(1, 2),
            extra_ok=("host_oversubscription",),
        ),
        Scenario(
            "episode-backward-r2",
            2,
            12,
            ("--straggler", "1:30@50-89", "--straggler-phase", "backward"),
            expect="straggler_episode",
            expect_ranks=(1,),
        ),
        Scenario(
            "cpu-fwd-bwd-real-r2",
            2,
            0,
            ("--straggler", "1:24", "--straggler-phase", "forward_backward", "--spin"),
            expect="persistent_straggler",
            expect_ranks=(1,),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--ranks", default="2,3,4", help="rank counts of the clean runs")
    p.add_argument("--no-injected", action="store_true", help="only the clean runs")
    p.add_argument(
        "--clean", default="emulated,real", help="clean workloads: emulated, real (comma-separated)"
    )
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--root", default="/tmp/pace_false_alarms")
    p.add_argument("--reuse", action="store_true", help="only diagnose runs already recorded under --root")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="diagnosis threshold")
    p.add_argument("--json", default=None, help="also write every run's reading here")
    args = p.parse_args(argv)
    cfg = DiagnosisConfig.from_dict(load_mapping(None, args.set))
    root = Path(args.root)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    results: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    ranks = [int(r) for r in args.ranks.split(",") if r]
    kinds = [k for k in args.clean.split(",") if k]
    scenarios = clean_scenarios(seeds, ranks, kinds) + ([] if args.no_injected else injected_scenarios())
    for sc in scenarios:
        if args.reuse and not list((root / sc.name).glob("version_*/pace_run.jsonl")):
            continue
        run_dir = record(root, sc, args.steps)
        results[sc.name] = {**read(run_dir, cfg), "scenario": sc.__dict__}
        r = results[sc.name]
        print(
            f"  {sc.name:<24} {', '.join(r['modes']):<44} lost {r['lost']:6.1%} floor {r['floor']:6.1%} "
            f"({time.monotonic() - started:5.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    print(table(results, args.steps))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def table(results: dict[str, dict[str, Any]], steps: int) -> str:
    lines = [
        f"clean runs ({steps} steps each, paced_ddp defaults):",
        f"{'ranks':>5} {'compute':>14} {'step p50':>9} {'crowded':>8} {'readings':<46} {'false alarms':>12}",
    ]
    clean = {k: v for k, v in results.items() if k.startswith("clean-")}
    totals = Counter[str]()
    labels = list(dict.fromkeys(Scenario(**v["scenario"]).label for v in clean.values()))
    for r in sorted({v["scenario"]["ranks"] for v in clean.values()}):
        for c in labels:
            runs = [
                v
                for v in clean.values()
                if v["scenario"]["ranks"] == r and Scenario(**v["scenario"]).label == c
            ]
            if not runs:
                continue
            crowded = all(v["oversubscribed"] for v in runs)
            readings = Counter(m for v in runs for m in v["modes"])
            expected = {"host_oversubscription"} if crowded else {"healthy"}
            alarms = sum(any(m not in expected for m in v["modes"]) for v in runs)
            key = "crowded" if crowded else "clean"
            totals[f"{key}_runs"] += len(runs)
            totals[f"{key}_alarms"] += alarms
            if crowded:
                totals["crowded_named"] += sum("host_oversubscription" in v["modes"] for v in runs)
            step = sorted(v["step_ms"] for v in runs)[len(runs) // 2]
            lines.append(
                f"{r:>5} {c:>14} {step:>7.1f}ms {'yes' if crowded else 'no':>8} "
                f"{', '.join(f'{m} {n}' for m, n in readings.most_common()):<46} "
                f"{alarms:>5} of {len(runs):<3}"
            )
    if totals["clean_runs"]:
        lines.append(
            f"not oversubscribed: {totals['clean_alarms']} false alarms in {totals['clean_runs']} runs "
            f"({totals['clean_alarms'] / totals['clean_runs']:.0%})"
        )
    if totals["crowded_runs"]:
        lines.append(
            f"oversubscribed (more ranks than cores): host_oversubscription named in "
            f"{totals['crowded_named']} of {totals['crowded_runs']}; another finding beside it in "
            f"{totals['crowded_alarms']} ({totals['crowded_alarms'] / totals['crowded_runs']:.0%})"
        )
    lines.append("\ninjected problems:")
    for name, v in results.items():
        if name.startswith("clean-"):
            continue
        sc = v["scenario"]
        top_ok = bool(v["modes"]) and v["modes"][0] == sc["expect"]
        ranks_ok = not sc["expect_ranks"] or (top_ok and tuple(v["ranks"][0]) == tuple(sc["expect_ranks"]))
        others = [m for m in v["modes"][1:] if m not in sc["extra_ok"]]
        verdict = "named" if top_ok and ranks_ok else "MISSED"
        if others:
            verdict += f" (also: {', '.join(others)})"
        lines.append(f"  {name:<24} expect {sc['expect']:<22} read {', '.join(v['modes']):<44} {verdict}")
    seconds = [v["seconds"] for v in results.values()]
    if seconds:
        lines.append(f"\ndiagnosis (projection included) took {max(seconds):.2f} s at most per run")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
