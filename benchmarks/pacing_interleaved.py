"""Plain DDP, a Python comm hook and paced DDP in the same processes, in turn: pacing's cost, resolved.

Not a test: it prints what it measured. Run-level A/B (``pacing_ab.py``) compares whole runs, and
on a shared 2-core machine two identical runs differ by several percent, so it cannot resolve the
0.5% that matters where pacing cannot help. Here every rank holds three identical DDP models of the
demo's MLP on one gloo group: ``plain`` (stock DDP, its built-in all-reduce, no Python in it),
``hook`` (DDP with torch's own Python ``allreduce_hook``: what any Python comm hook costs, the floor
for a hook-based monitor) and ``paced`` (DDP's built-in reduction under the default grad-ready
monitor and a full :class:`~pace_strategy.session.PacingSession`: window exchange on its own gloo
group, the adaptive controller, and on rank 0 the telemetry thread writing the ``pace/`` tags to a
real TensorBoard event file and the run record). Each step trains all three, in rotating order
(plain hook paced, hook paced plain, paced plain hook, ...), on the same batch with the same injected
sleep, so every arm sees the same minutes of the machine.

A barrier on a separate group closes every step of every arm: the interval between two barriers on
rank 0 is one arm's step, including every rank's work after its all-reduce (the paced arm's window
work, on the straggler too), so nothing one arm does is charged to another. The barrier costs every
arm alike, which dilutes the ratios towards 1 by its share of a step (printed).

Reported per scenario: throughput ratios paced/plain, hook/plain and paced/hook (summed step times
of the measured steps), each with its standard error over ``--blocks`` consecutive blocks, the
share of paced steps with pacing active and the mean delay, the largest weight difference between
the models at the end (pacing never changes the math; 0 means bit-identical), and the ``control``
scenario, where the paced arm is plain DDP too: the ruler's own error. ``--variant no-telemetry``
drops the paced arm's telemetry, ``--variant comm-hook`` times it with the pacing comm hook
(``ddp_monitor: comm_hook``) instead; ``--hook builtin`` makes the middle arm DDP's C++ all-reduce comm
hook, to tell the cost of Python from the cost of the comm-hook path (see ``--help``).

    python benchmarks/pacing_interleaved.py                  # ~10 minutes on 2 cores
    python benchmarks/pacing_interleaved.py --steps 200 --scenarios persistent   # quick look
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import blocked, provenance, transient_spec, write_results

#: name -> (straggler spec of pace_strategy.testing, what it is, candidate arm)
SCENARIOS: dict[str, tuple[str, str, str]] = {
    "control": ("", "candidate is plain DDP too, no injection: the ruler's own error", "plain"),
    "clean": ("", "no injection", "paced"),
    "persistent": ("1:30", "rank 1 +30 ms every step", "paced"),
    "transient": (transient_spec(4), "every rank +30 ms with p=0.1 (seeded)", "paced"),
}


#: The arms every step trains, in rotating order. ``candidate`` is the paced arm (plain in ``control``).
ARMS = ("plain", "hook", "candidate")

#: What the paced arm is (``--variant``), to take its cost apart.
VARIANTS = ("full", "no-telemetry", "comm-hook")

#: What the ``hook`` arm is (``--hook``): torch's Python all-reduce hook or DDP's C++ one.
HOOKS = ("python", "builtin")


@dataclass(frozen=True)
class Job:
    scenario: str
    ranks: int
    steps: int
    skip: int
    compute_ms: float
    store: str
    out: str
    log_dir: str
    variant: str
    hook: str


def _worker(rank: int, job: Job) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.tensorboard import SummaryWriter

    from pace_strategy.apps.job import build_net
    from pace_strategy.apps.recipe_schema import ModelRecipe
    from pace_strategy.core import PacingConfig
    from pace_strategy.hooks.ddp import attach_paced_ddp
    from pace_strategy.session import PacingSession
    from pace_strategy.shutdown import leave_without_finalization
    from pace_strategy.telemetry.run_record import read_run_record
    from pace_strategy.testing import parse_stragglers, sleep_injected

    torch.set_num_threads(1)
    store = dist.FileStore(job.store, job.ranks)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=job.ranks, timeout=timedelta(seconds=60)
    )
    spec, _, candidate = SCENARIOS[job.scenario]
    stragglers = parse_stragglers(spec)
    torch.manual_seed(0)
    base = build_net(ModelRecipe(width=256, depth=2))  # the demo's MLP at its default width
    models = {arm: DDP(copy.deepcopy(base)) for arm in ARMS}
    opts = {arm: torch.optim.SGD(m.parameters(), lr=0.05) for arm, m in models.items()}
    if job.hook == "python":  # the floor of any hook-based monitor: torch's own Python all-reduce hook
        models["hook"].register_comm_hook(None, default_hooks.allreduce_hook)
    else:  # the same all-reduce as a C++ comm hook: the comm-hook path without Python
        models["hook"]._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    session = None
    writer = None
    if candidate == "paced":
        telemetry = job.variant != "no-telemetry"
        sink = None
        if rank == 0 and telemetry:
            writer = SummaryWriter(job.log_dir)

            def sink(metrics: Any, step: int) -> None:
                for tag, value in metrics.items():
                    writer.add_scalar(tag, value, step)

        session = PacingSession.with_side_group(
            # otherwise the defaults: adaptive, grad-ready monitor
            PacingConfig(
                run_record=telemetry, ddp_monitor="comm_hook" if job.variant == "comm-hook" else "grad_ready"
            ),
            rank=rank,
            world_size=job.ranks,
            device=torch.device("cpu"),
            framework="benchmark",
            log_dir=job.log_dir if rank == 0 else None,
            metrics_sink=sink,
        )
        attach_paced_ddp(models["candidate"], session.pacer)
    sync = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(1234 + rank)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    dist.barrier(group=sync)
    last = time.perf_counter()
    for step in range(job.steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        turn = step % len(ARMS)
        for arm in ARMS[turn:] + ARMS[:turn]:
            pacer = session.pacer if session is not None and arm == "candidate" else None
            if pacer is not None:
                pacer.interrupt()  # the other arms' steps ran since this arm's last one
                pacer.begin_step(step)
            sleep_injected(stragglers, rank, step)
            time.sleep(job.compute_ms / 1e3)  # stands in for accelerator time, as in the demo
            loss = torch.nn.functional.cross_entropy(models[arm](x), y)
            opts[arm].zero_grad(set_to_none=True)
            loss.backward()
            opts[arm].step()
            if session is not None and pacer is not None:
                session.end_step()
            dist.barrier(group=sync)
            now = time.perf_counter()
            times[arm].append((now - last) * 1e3)
            last = now
    paced_delay: dict[int, float] = {}  # the largest delay of each paced step, from the run record
    if session is not None:
        session.finish()
        if session.record_path is not None:
            paced_delay = {s["step"]: s["delay_ms_max"] for s in read_run_record(session.record_path).steps}
    if writer is not None:
        writer.close()
    barrier_ms = _barrier_ms(sync)
    diff = max(
        (a - b).abs().max().item()
        for arm in ARMS[1:]
        for a, b in zip(models["plain"].parameters(), models[arm].parameters(), strict=True)
    )
    if rank == 0:
        Path(job.out).write_text(
            json.dumps({"times": times, "paced_delay": paced_delay, "barrier_ms": barrier_ms, "diff": diff})
        )
    dist.destroy_process_group()
    # a spawned worker whose results are on disk: skip finalization (torch's gloo shutdown abort,
    # docs/hazards.md)
    leave_without_finalization(0)


def _barrier_ms(group: Any, n: int = 200) -> float:
    import torch.distributed as dist

    started = time.perf_counter()
    for _ in range(n):
        dist.barrier(group=group)
    return (time.perf_counter() - started) * 1e3 / n


def run(job: Job) -> dict[str, Any]:
    """One scenario: ``job.ranks`` spawned processes; returns what rank 0 wrote."""
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(job,), nprocs=job.ranks, start_method="spawn", join=True)
    return json.loads(Path(job.out).read_text())


def throughput_ratio(base: list[float], arm: list[float], blocks: int) -> tuple[float, float, list[float]]:
    """Throughput of ``arm`` over ``base`` (summed step times), its standard error over ``blocks``
    consecutive blocks, and the block ratios."""
    return blocked(base, arm, blocks, lambda b, a: sum(b) / sum(a))


def summarize(
    name: str, variant: str, hook: str, raw: dict[str, Any], skip: int, blocks: int
) -> dict[str, Any]:
    plain, hooked, cand = (raw["times"][arm][skip:] for arm in ARMS)
    ratio, error, block_ratios = throughput_ratio(plain, cand, blocks)
    hook_ratio, hook_error, _ = throughput_ratio(plain, hooked, blocks)
    over_hook, over_hook_error, _ = throughput_ratio(hooked, cand, blocks)
    delays = [d for step, d in raw["paced_delay"].items() if int(step) >= skip]
    median_plain = statistics.median(plain)
    return {
        "scenario": name,
        "variant": variant,
        "hook": hook,
        "what": SCENARIOS[name][1],
        "candidate": SCENARIOS[name][2],
        "steps_measured": len(plain),
        "throughput_ratio": ratio,
        "standard_error": error,
        "block_ratios": block_ratios,
        "hook_ratio": hook_ratio,
        "hook_standard_error": hook_error,
        "over_hook_ratio": over_hook,
        "over_hook_standard_error": over_hook_error,
        "median_step_plain_ms": median_plain,
        "median_step_hook_ms": statistics.median(hooked),
        "median_step_candidate_ms": statistics.median(cand),
        "pacing_active_share": (sum(d > 0 for d in delays) / len(delays)) if delays else None,
        "mean_delay_ms": statistics.fmean(delays) if delays else None,
        "barrier_share": raw["barrier_ms"] / median_plain,
        "max_weight_difference": raw["diff"],
    }


def markdown(rows: list[dict[str, Any]], header: str, hook: str) -> str:
    label = "Python hook" if hook == "python" else "C++ hook"
    lines = [
        header,
        "",
        f"| scenario | throughput paced/plain | {label}/plain | paced/{label} "
        "| median step plain / hook / paced | pacing active | mean delay | barrier share "
        "| max weight difference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["scenario"] + (" (paced arm is plain DDP)" if r["candidate"] == "plain" else "")
        share = "-" if r["pacing_active_share"] is None else f"{r['pacing_active_share']:.0%}"
        delay = "-" if r["mean_delay_ms"] is None else f"{r['mean_delay_ms']:.2f} ms"
        lines.append(
            f"| {name} | {r['throughput_ratio']:.4f} +/- {r['standard_error']:.4f} "
            f"| {r['hook_ratio']:.4f} +/- {r['hook_standard_error']:.4f} "
            f"| {r['over_hook_ratio']:.4f} +/- {r['over_hook_standard_error']:.4f} "
            f"| {r['median_step_plain_ms']:.2f} / {r['median_step_hook_ms']:.2f} / "
            f"{r['median_step_candidate_ms']:.2f} ms | {share} | {delay} "
            f"| {r['barrier_share']:.2%} | {r['max_weight_difference']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="CPU processes (gloo); default 4")
    p.add_argument("--steps", type=int, default=1000, help="steps per arm (each of three); default 1000")
    p.add_argument("--skip", type=int, default=50, help="warm-up steps of each arm dropped; default 50")
    p.add_argument("--blocks", type=int, default=10, help="blocks for the standard error; default 10")
    p.add_argument("--compute-ms", type=float, default=20.0, help="emulated accelerator time per step")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {list(SCENARIOS)}")
    p.add_argument(
        "--variant",
        choices=VARIANTS,
        default="full",
        help="what the paced arm is: full (default: grad-ready monitor, telemetry); no-telemetry "
        "(no TensorBoard tags, no run record: the pacer and monitor alone); comm-hook (full, timed "
        "by the pacing comm hook)",
    )
    p.add_argument(
        "--hook",
        choices=HOOKS,
        default="python",
        help="what the middle arm is: python (default; torch's allreduce_hook, what any Python comm "
        "hook costs); builtin (DDP's C++ all-reduce comm hook: the comm-hook path without Python)",
    )
    p.add_argument(
        "--log-root",
        default=None,
        help="keep each scenario's TensorBoard logs and run record under LOG_ROOT/SCENARIO (default: "
        "a temporary directory, removed; `pace diagnose LOG_ROOT/SCENARIO` reads a kept one)",
    )
    p.add_argument("--out", default="benchmarks/results/pacing_interleaved.json")
    p.add_argument("--markdown", default="benchmarks/results/pacing_interleaved.md")
    args = p.parse_args()
    chosen = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown:
        p.error(f"unknown scenarios {unknown}; have {list(SCENARIOS)}")
    if args.ranks < 2 or (args.steps - args.skip) < 2 * args.blocks:
        p.error(
            "need --ranks >= 2 and at least 2 measured steps per block (--steps - --skip >= 2 * --blocks)"
        )
    for name in chosen:
        spec = SCENARIOS[name][0]
        if any(int(item.split(":")[0]) >= args.ranks for item in spec.split(",") if item):
            p.error(f"scenario {name} injects on ranks >= --ranks {args.ranks}")
    rows = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pace-interleaved-") as tmp:
        for i, name in enumerate(chosen):
            print(
                f"[{i + 1}/{len(chosen)}] {name}: {args.ranks} ranks x {args.steps} steps x {len(ARMS)} arms",
                flush=True,
            )
            job = Job(
                scenario=name,
                ranks=args.ranks,
                steps=args.steps,
                skip=args.skip,
                compute_ms=args.compute_ms,
                store=f"{tmp}/store-{i}",
                out=f"{tmp}/out-{i}.json",
                log_dir=f"{args.log_root}/{name}" if args.log_root else f"{tmp}/tb-{i}",
                variant=args.variant,
                hook=args.hook,
            )
            row = summarize(name, args.variant, args.hook, run(job), args.skip, args.blocks)
            rows.append(row)
            print(
                f"      paced/plain {row['throughput_ratio']:.4f} +/- {row['standard_error']:.4f}  "
                f"hook/plain {row['hook_ratio']:.4f}  paced/hook {row['over_hook_ratio']:.4f}  "
                f"elapsed {time.monotonic() - t0:5.0f} s",
                flush=True,
            )
    meta = provenance(args)
    header = (
        f"{meta['date']}, {meta['machine']['cpus']} CPUs ({meta['machine']['platform']}), gloo, "
        f"{args.ranks} ranks, {args.steps} steps per arm (first {args.skip} dropped), emulated compute "
        f"{args.compute_ms:g} ms/step, standard error over {args.blocks} blocks, paced arm: {args.variant}, "
        f"hook arm: {args.hook}. "
        f"Command: `{meta['command']}`"
    )
    result = {"benchmark": "pacing_interleaved", **meta, "rows": rows}
    write_results(args.out, args.markdown, markdown(rows, header, args.hook), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
