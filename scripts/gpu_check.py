#!/usr/bin/env python
"""Exercise every CUDA path of pace_strategy on one GPU in a few minutes; one line per check.

    python scripts/gpu_check.py [--out DIR] [--steps N]

Prints ``PASS name: what was seen``, ``FAIL name: why`` or ``SKIP name: why`` for each check and exits 1
when any check failed. Without CUDA every check is skipped, saying why, and the exit status is 0 (so
that it can run anywhere). Each group of checks runs in its own process, so one crash or hang fails
only its own checks:

- ``paced_ddp_nccl``: Lightning ``paced_ddp`` on one GPU, NCCL, CUDA-event timing, run record written;
- ``paced_fsdp``: Lightning ``paced_fsdp`` (FSDP2) on one GPU;
- ``device_delay``: the pacing delay is a device-side spin: the stream waits, the host does not;
- ``measured_delay``: a forced delay inside paced steps on a busy stream is recorded as measured, within
  10% of the requested one, and the host is not blocked for it;
- ``terminate_pending_mark``: ``terminate()`` returns promptly while the last steps' events sit behind a
  30-second device spin (as behind a collective a dead peer never joins), and counts them;
- ``gloo_ranks_share_gpu``: two gloo ranks on the same GPU, timed with CUDA events, pacing forced on;
- ``parity_with_ddp``: those ranks end with bit-identical weights paced and with plain DDP;
- ``run_record_and_diagnosis``: their run record reads back, summarizes and is diagnosed;
- ``nccl_ddp_grad_ready`` / ``nccl_ddp_comm_hook``: DDP over NCCL (a one-rank group) on a GPU-heavy
  model (4096x4096 layers) in each monitor mode: the recorded step times add up to the synchronized
  host wall time within 10%, compute > 0, wait >= 0;
- ``nccl_hook_delay``: a forced delay inside the NCCL comm hook is measured within 10% of the
  request while the host is not held for it;
- ``fsdp_stream_marks``: the FSDP2 wrappers on a side stream with an inner collective that spins a
  known time: the step's wait is what the compute stream waited (the spin less the compute that
  overlapped it), not the side stream's call (docs/telemetry.md, "FSDP on a device");
- ``nccl_pair_straggler`` / ``nccl_pair_decisions``: two processes on one GPU, each with its own
  one-rank NCCL group for DDP, the gloo side group and the watchdog spanning both, rank 1 slow per
  sample on the device: rank 1 named, pacing and rebalancing decisions taken;
- ``multi_gpu_parity``: with 2+ GPUs, an N-rank NCCL job (3 where there are 3) paced in both monitor
  modes and FSDP2, DDP bit-identical to plain DDP (SKIP on one GPU);
- ``nccl_hsdp_parity`` / ``nccl_tp_parity``: with 4+ GPUs, the CPU mesh tests over NCCL: HSDP (2
  replicas x 2 shards) and FSDP x tensor parallelism (2 x 2), rank 1 slow in backward, forced
  pacing bit-identical to the same layout unpaced, every rank's mesh coordinates recorded, every
  step timed (SKIP with fewer GPUs).

The jobs are the project's own: the recipe job (``pace_strategy.apps.recipes``) and its model and data
(``pace_strategy.apps.job``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: check -> the child job that runs it, in the order they are printed
CHECKS: dict[str, str] = {
    "paced_ddp_nccl": "lightning_ddp",
    "paced_fsdp": "lightning_fsdp",
    "device_delay": "device_delay",
    "measured_delay": "shutdown",
    "terminate_pending_mark": "shutdown",
    "gloo_ranks_share_gpu": "gloo_ranks",
    "parity_with_ddp": "gloo_ranks",
    "run_record_and_diagnosis": "gloo_ranks",
    "nccl_ddp_grad_ready": "nccl_ddp",
    "nccl_ddp_comm_hook": "nccl_ddp",
    "nccl_hook_delay": "nccl_ddp",
    "fsdp_stream_marks": "fsdp_streams",
    "nccl_pair_straggler": "nccl_pair",
    "nccl_pair_decisions": "nccl_pair",
    "multi_gpu_parity": "multi_gpu",
    "nccl_hsdp_parity": "meshes",
    "nccl_tp_parity": "meshes",
}
JOB_TIMEOUT_S = 120.0  #: most one child job may take
TOTAL_BUDGET_S = 290.0  #: all jobs together: the script ends within 5 minutes, failing what did not run
GLOO_RANKS = 2
#: ``--rehearse-on-cpu`` (hidden; for developing this script without a GPU) runs the jobs on the CPU:
#: the CUDA-specific expectations then fail, but every other line of the jobs runs
REHEARSE_ENV = "PACE_GPU_CHECK_ON_CPU"


def _on_cpu() -> bool:
    return os.environ.get(REHEARSE_ENV) == "1"


Result = dict[str, tuple[str, str]]  #: check -> ("PASS" | "FAIL" | "SKIP", detail)


def _check(results: Result, name: str, ok: bool, detail: str) -> None:
    results[name] = ("PASS" if ok else "FAIL", detail)


# ------------------------------------------------------------------------------------- Lightning
def _lightning(strategy: str, out: Path, steps: int) -> Result:
    from pace_strategy.apps.recipe_schema import TrainRecipe
    from pace_strategy.apps.recipes import one_thread_per_rank, run_lightning
    from pace_strategy.integrations.env import RUN_DIR_ENV
    from pace_strategy.settings import build
    from pace_strategy.telemetry.run_record import read_run_record

    one_thread_per_rank()
    # one process has no skew to monitor: the strategy writes a record only when asked to (it goes
    # to the logger's log_dir, which comes first)
    os.environ[RUN_DIR_ENV] = str(out)
    recipe = build(
        TrainRecipe,
        {
            "trainer": {
                "accelerator": "cpu" if _on_cpu() else "gpu",
                "devices": 1,
                "strategy": strategy,
                "max_steps": steps,
            },
            "model": {"compute_ms": 0.0},
            "output": {"root": str(out), "name": strategy},
            "pacing": {"exchange_every_steps": 8, "warmup_steps": 2},
        },
    )
    trainer = run_lightning(recipe, quiet=True)
    record = read_run_record(trainer.logger.log_dir)
    timed = [s for s in record.steps if s["valid"] and not s["warmup"]]
    device = record.header["topology"][0]["device"]
    name = "paced_ddp_nccl" if strategy == "paced_ddp" else "paced_fsdp"
    seen = f"{trainer.global_step} steps on {device}, {len(record.steps)} in the record, {len(timed)} timed"
    if strategy == "paced_ddp":
        backend = getattr(trainer.strategy, "process_group_backend", None)
        ok = device.startswith("cuda") and backend == "nccl" and len(timed) >= steps - 4
        detail = f"{seen}, backend {backend}"
    else:
        # On one process FSDP2 may issue no collective (on CPU it issues none): then no sync point is
        # timed and this check shows that the strategy trains and records on CUDA. Its collectives
        # are timed with two or more ranks, which NCCL does not allow on one GPU.
        ok = device.startswith("cuda") and len(record.steps) == steps
        detail = seen if timed else f"{seen} (one process: no FSDP collective was timed)"
    if timed:
        detail += f", median step {sorted(s['step_ms'] or 0.0 for s in timed)[len(timed) // 2]:.2f} ms"
    return {name: ("PASS" if ok else "FAIL", detail)}


# ------------------------------------------------------------------------------------- device delay
def _device_delay(out: Path, steps: int) -> Result:
    import torch

    from pace_strategy.core.clock import CudaEventClock

    if _on_cpu():
        return {"device_delay": ("FAIL", "rehearsal on CPU: no device stream to delay")}
    clock = CudaEventClock(torch.device("cuda", 0))
    clock.delay(1.0)  # calibrates the spin kernel once
    torch.cuda.synchronize()
    want_ms = 50.0
    started = time.perf_counter()
    a = clock.mark()
    clock.delay(want_ms)
    b = clock.mark()
    host_ms = (time.perf_counter() - started) * 1e3
    stream_ms = clock.elapsed_ms(a, b)
    # loose bounds: a spin calibrated once, on a device that may be shared; what matters is that the
    # stream waited about that long while the host did not
    ok = 0.5 * want_ms <= stream_ms <= 2 * want_ms and host_ms < want_ms / 2
    detail = (
        f"{want_ms:g} ms delay: the stream waited {stream_ms:.1f} ms, the host call took {host_ms:.2f} ms"
    )
    return {"device_delay": ("PASS" if ok else "FAIL", detail)}


# ------------------------------------------------------------------------------------- shutdown
def _paced_steps(session: Any, steps: int, work: Any) -> float:
    """``steps`` paced steps of GPU matmuls (forward, then "backward" after the first gradient);
    returns the host milliseconds per step."""
    pacer = session.pacer
    started = time.perf_counter()
    for step in range(steps):
        pacer.begin_step(step)
        work()
        pacer.enter_sync(bucketed=False)  # the first gradient: the delay is enqueued here
        work()
        pacer.arrive()
        pacer.sync_done()
        session.end_step()
    return (time.perf_counter() - started) * 1e3 / steps


def _shutdown(out: Path, steps: int) -> Result:
    import torch

    from pace_strategy.core.config import PacingConfig
    from pace_strategy.session import PacingSession
    from pace_strategy.telemetry.run_record import read_run_record

    if _on_cpu():
        why = "rehearsal on CPU: no device stream to delay or to block"
        return {"measured_delay": ("FAIL", why), "terminate_pending_mark": ("FAIL", why)}
    device = torch.device("cuda", 0)
    x = torch.randn(4096, 4096, device=device)

    def work() -> None:
        for _ in range(3):
            torch.mm(x, x)

    def session(path: Path) -> Any:
        cfg = PacingConfig(mode="forced", exchange_every_steps=4, warmup_steps=0)
        return PacingSession.start(
            cfg, rank=0, world_size=1, device=device, group=None, framework="gpu_check", log_dir=path
        )

    results: Result = {}
    want_ms = 20.0
    timed = session(out / "delay")
    timed.pacer._delay_ms = want_ms  # one rank has no lead to pace: force a delay directly
    host_ms = _paced_steps(timed, 12, work)
    timed.finish()
    record = read_run_record(out / "delay")
    # the first window's steps (one rank has no lead: after its first decision the delay is 0 again)
    paced = [s for s in record.steps if s["ranks"]["delay_ms"][0]]
    delays = sorted(s["ranks"]["delay_ms"][0] for s in paced)
    median = delays[len(delays) // 2] if delays else 0.0
    step_ms = sorted(s["step_ms"] or 0.0 for s in paced)[len(paced) // 2] if paced else 0.0
    _check(
        results,
        "measured_delay",
        bool(delays)
        and abs(median - want_ms) <= 0.1 * want_ms
        and step_ms > want_ms
        and host_ms < want_ms / 2,
        f"{want_ms:g} ms requested: measured {median:.2f} ms (median of {len(delays)}), device step "
        f"{step_ms:.1f} ms, host {host_ms:.2f} ms per step",
    )
    stuck = session(out / "terminate")
    _paced_steps(stuck, 5, work)
    torch.cuda.synchronize()
    clock = stuck.pacer.clock
    torch.cuda._sleep(int(30_000 * clock.calibrate()))  # 30 s: what a collective with a dead peer does
    _paced_steps(stuck, 3, work)  # their events sit behind the spin
    started = time.perf_counter()
    stuck.terminate("SIGTERM (gpu_check)")
    took_s = time.perf_counter() - started
    end = read_run_record(out / "terminate").end or {}
    _check(
        results,
        "terminate_pending_mark",
        took_s < 5.0 and end.get("status") == "terminated" and end.get("unresolved_steps_dropped", 0) >= 1,
        f"terminate() took {took_s:.2f} s with the stream 30 s behind; end status {end.get('status')}, "
        f"{end.get('unresolved_steps_dropped', 0)} unresolved steps dropped",
    )
    return results  # the child leaves with os._exit: nothing waits for the spin


# ------------------------------------------------------------------------------------- gloo ranks
def _gloo_rank(rank: int, world: int, out: str, steps: int) -> None:
    """One rank: the example model trained with plain DDP, then paced (forced), both on cuda:0 over gloo."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pace_strategy import PacingConfig, attach_paced_ddp
    from pace_strategy.apps.job import build_net, make_dataset
    from pace_strategy.apps.recipe_schema import TrainRecipe
    from pace_strategy.apps.recipes import one_thread_per_rank
    from pace_strategy.session import PacingSession
    from pace_strategy.settings import build

    one_thread_per_rank()
    device = torch.device("cpu") if _on_cpu() else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(os.path.join(out, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    recipe = build(
        TrainRecipe, {"trainer": {"max_steps": steps, "devices": world}, "model": {"compute_ms": 0}}
    )
    x_all, y_all = make_dataset(recipe, world).tensors
    batch = recipe.data.batch_size
    weights: dict[str, dict[str, torch.Tensor]] = {}
    clock = ""
    for arm in ("plain", "paced"):
        torch.manual_seed(recipe.seed)
        model = DDP(build_net(recipe.model).to(device), device_ids=[0] if device.type == "cuda" else None)
        session = None
        if arm == "paced":
            config = PacingConfig(
                mode="forced",
                exchange_every_steps=4,
                warmup_steps=1,
                max_delay_step_fraction=0.5,
                persist_fraction=0.5,
            )
            session = PacingSession.with_side_group(
                config, rank=rank, world_size=world, device=device, framework="torch", log_dir=out
            )
            attach_paced_ddp(model, session.pacer)
            clock = type(session.pacer.clock).__name__
        opt = torch.optim.SGD(model.parameters(), lr=recipe.model.lr)
        for step in range(steps):
            first = (step * world + rank) * batch
            x, y = x_all[first : first + batch].to(device), y_all[first : first + batch].to(device)
            if session is not None:
                session.pacer.begin_step(step)
            if rank == world - 1:
                time.sleep(0.01)  # a 10 ms straggler: the other ranks lead, and are paced
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if session is not None:
                session.end_step()
        if session is not None:
            session.finish()
        weights[arm] = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
    if rank == 0:
        saved = {"weights": weights, "clock": clock, "device": str(device)}
        torch.save(saved, os.path.join(out, "gloo_rank0.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _gloo_ranks(out: Path, steps: int) -> Result:
    import torch
    import torch.multiprocessing as mp

    from pace_strategy.diagnose import diagnose, load_arrays
    from pace_strategy.telemetry.run_record import read_run_record, summarize

    mp.start_processes(
        _gloo_rank, args=(GLOO_RANKS, str(out), steps), nprocs=GLOO_RANKS, start_method="spawn"
    )
    saved = torch.load(out / "gloo_rank0.pt")
    record = read_run_record(out)
    timed = [s for s in record.steps if s["valid"] and not s["warmup"]]
    delayed = max((s["delay_ms_max"] or 0.0 for s in timed), default=0.0)
    results: Result = {}
    _check(
        results,
        "gloo_ranks_share_gpu",
        saved["clock"] == "CudaEventClock" and len(timed) >= steps - 4,
        f"{GLOO_RANKS} gloo ranks on {saved['device']}, clock {saved['clock']}, {len(timed)} timed steps, "
        f"largest delay {delayed:.2f} ms",
    )
    plain, paced = saved["weights"]["plain"], saved["weights"]["paced"]
    differ = [k for k in plain if not torch.equal(plain[k], paced[k])]
    _check(
        results,
        "parity_with_ddp",
        not differ and delayed > 0,
        f"{len(plain)} tensors bit-identical after {steps} steps with delays up to {delayed:.2f} ms"
        if not differ and delayed > 0
        else f"tensors differ: {differ}"
        if differ
        else "no delay was applied: parity under pacing not shown",
    )
    summary = summarize(record)
    diagnosis = diagnose(load_arrays(out), project_ranks=None)
    _check(
        results,
        "run_record_and_diagnosis",
        record.end is not None and record.end["status"] == "completed" and summary.steps > 0,
        f"record {record.path.name}: {len(record.steps)} steps, status "
        f"{(record.end or {}).get('status')}; diagnosis: {diagnosis.summary}",
    )
    return results


# ------------------------------------------------------------------------------------- NCCL, one rank
HEAVY_WIDTH = 4096  #: the GPU-heavy model's layer width: each step keeps the stream busy with matmuls
REHEARSAL_WIDTH = 256  #: the same model on the CPU rehearsal (a 4096 layer would take seconds there)


def _device() -> Any:
    import torch

    return torch.device("cpu") if _on_cpu() else torch.device("cuda", 0)


def _backend() -> str:
    return "gloo" if _on_cpu() else "nccl"


def _heavy_net(device: Any) -> Any:
    import torch

    width = REHEARSAL_WIDTH if _on_cpu() else HEAVY_WIDTH
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(4)]
    return torch.nn.Sequential(*layers).to(device)


def _sync() -> None:
    import torch

    if not _on_cpu():
        torch.cuda.synchronize()


def _nccl_ddp(out: Path, steps: int) -> Result:
    """DDP over a one-rank NCCL group on the GPU-heavy model, in each monitor mode; then a forced delay
    inside the comm hook."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pace_strategy import attach_paced_ddp
    from pace_strategy.core.config import PacingConfig
    from pace_strategy.session import PacingSession
    from pace_strategy.telemetry.run_record import read_run_record

    device = _device()
    dist.init_process_group(_backend(), store=dist.HashStore(), rank=0, world_size=1)
    width = REHEARSAL_WIDTH if _on_cpu() else HEAVY_WIDTH
    x = torch.randn(256, width, device=device)
    results: Result = {}
    warm, measured = 5, max(steps // 2, 8)
    for monitor in ("grad_ready", "comm_hook"):
        model = DDP(_heavy_net(device), device_ids=None if _on_cpu() else [0])
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        config = PacingConfig(mode="monitor", ddp_monitor=monitor, exchange_every_steps=4, warmup_steps=0)
        path = out / monitor
        session = PacingSession.start(
            config, rank=0, world_size=1, device=device, group=None, framework="gpu_check", log_dir=path
        )
        attach_paced_ddp(model, session.pacer)
        wall_ms = 0.0
        for step in range(warm + measured):
            if step == warm:
                _sync()
                started = time.perf_counter()
            session.pacer.begin_step(step)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            session.end_step()
        _sync()
        wall_ms = (time.perf_counter() - started) * 1e3
        session.finish()
        record = read_run_record(path)
        timed = [s for s in record.steps if warm <= s["step"] < warm + measured and s["valid"]]
        recorded_ms = sum(s["step_ms"] or 0.0 for s in timed)
        compute = [s["ranks"]["compute_ms"][0] for s in timed]
        wait = [s["ranks"]["wait_ms"][0] for s in timed]
        _check(
            results,
            f"nccl_ddp_{monitor}",
            len(timed) == measured
            and abs(recorded_ms - wall_ms) <= 0.1 * wall_ms
            and min(compute, default=0.0) > 0.0
            and min(wait, default=-1.0) >= 0.0,
            f"{dist.get_backend()} DDP, {len(timed)}/{measured} timed steps: recorded {recorded_ms:.1f} ms "
            f"against {wall_ms:.1f} ms synchronized host wall time; compute "
            f"{min(compute, default=0):.2f}..{max(compute, default=0):.2f} ms, wait "
            f"{min(wait, default=0):.2f}..{max(wait, default=0):.2f} ms",
        )
    # a forced delay inside the NCCL comm hook: on the stream, not on the host
    model = DDP(_heavy_net(device), device_ids=None if _on_cpu() else [0])
    config = PacingConfig(mode="forced", ddp_monitor="comm_hook", exchange_every_steps=4, warmup_steps=0)
    session = PacingSession.start(
        config, rank=0, world_size=1, device=device, group=None, framework="gpu_check", log_dir=out / "delay"
    )
    attach_paced_ddp(model, session.pacer)
    want_ms, host_ms = 20.0, []
    for step in range(8):
        session.pacer._delay_ms = want_ms  # one rank has no lead to pace: force a delay directly
        session.pacer.begin_step(step)
        loss = model(x).square().mean()
        started = time.perf_counter()
        loss.backward()  # the hook spins the delay on the stream, then hands the bucket to NCCL
        host_ms.append((time.perf_counter() - started) * 1e3)
        session.end_step()
    session.finish()
    steps_ = [s for s in read_run_record(out / "delay").steps if s["valid"]]
    delays = sorted(s["ranks"]["delay_ms"][0] for s in steps_)
    median = delays[len(delays) // 2] if delays else 0.0
    backward_ms = sorted(host_ms)[len(host_ms) // 2]
    _check(
        results,
        "nccl_hook_delay",
        bool(delays) and abs(median - want_ms) <= 0.1 * want_ms and backward_ms < want_ms / 2,
        f"{want_ms:g} ms requested in the comm hook: measured {median:.2f} ms (median of {len(delays)}); "
        f"the host's backward call took {backward_ms:.2f} ms (median)",
    )
    dist.destroy_process_group()
    return results


# ------------------------------------------------------------------------------------- FSDP streams
SPIN_MS = 30.0  #: the inner collective's known time, spun on the side stream


def _fsdp_streams(out: Path, steps: int) -> Result:
    """The FSDP2 all-gather wrapper called inside ``torch.cuda.stream(side)`` as FSDP calls it, with an
    inner collective that spins SPIN_MS there, compute overlapping it on the compute stream, and FSDP's
    wait bracketed as the wrappers bracket ``wait_for_unshard``."""
    import torch

    from pace_strategy.core.clock import CudaEventClock
    from pace_strategy.core.config import PacingConfig
    from pace_strategy.core.pacer import Pacer
    from pace_strategy.core.summary import StepSummarizer
    from pace_strategy.hooks.fsdp import PacedAllGather

    if _on_cpu():
        return {"fsdp_stream_marks": ("FAIL", "rehearsal on CPU: no streams")}
    device = torch.device("cuda", 0)
    clock = CudaEventClock(device)
    cycles = clock.calibrate()
    pacer = Pacer(PacingConfig(mode="monitor", exchange_every_steps=4, warmup_steps=0), None, 0, 1, clock)

    class Spin:
        """An inner all-gather that takes SPIN_MS on the stream it is issued on."""

        def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output: Any, input_: Any, group: Any, async_op: bool = False) -> None:
            torch.cuda._sleep(int(SPIN_MS * cycles))

    gather = PacedAllGather(pacer, Spin())
    side = torch.cuda.Stream(device)
    x = torch.randn(HEAVY_WIDTH, HEAVY_WIDTH, device=device)
    before: list[tuple[Any, Any]] = []
    windows = []
    for step in range(12):
        pacer.begin_step(step)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            gather(None, None, None)
        a = clock.mark()
        for _ in range(2):
            torch.mm(x, x)  # compute on the compute stream while the side stream spins
        b = clock.mark()
        wait = pacer.enter_wait()
        torch.cuda.current_stream(device).wait_stream(side)
        pacer.exit_wait(wait)
        torch.mm(x, x)
        before.append((a, b))
        result = pacer.end_step()
        if result is not None:
            windows.append(result)
    windows += pacer.flush()
    _sync()
    summaries = [s for w in windows for s in StepSummarizer(8).summarize(w.gathered)][2:]
    overlap = [clock.elapsed_ms(a, b) for a, b in before][2:]
    expected = [max(SPIN_MS - o, 0.0) for o in overlap]
    waits = [s.wait_ms[0] for s in summaries]
    worst = max(abs(w - e) for w, e in zip(waits, expected, strict=True))
    ok = worst <= 0.15 * SPIN_MS and min(s.compute_ms[0] for s in summaries) > 0.0
    return {
        "fsdp_stream_marks": (
            "PASS" if ok else "FAIL",
            f"{SPIN_MS:g} ms spun on the side stream, {sum(overlap) / len(overlap):.1f} ms of compute "
            f"overlapping it: the compute stream waited {sum(waits) / len(waits):.1f} ms per step "
            f"(expected {sum(expected) / len(expected):.1f}, worst step off by {worst:.2f} ms); compute "
            f"{min(s.compute_ms[0] for s in summaries):.1f} ms at least (the side stream's own call would "
            f"have read {SPIN_MS:g} ms of waiting)",
        )
    }


# ------------------------------------------------------------------------------------- NCCL pair
PAIR_MS_PER_SAMPLE = 0.25  #: rank 1's extra device time per sample (a spin in its forward)
PAIR_STEPS = 64  #: 16 windows of 4: room for a rebalancing trial and its verdict, then pacing


def _pair_rank(rank: int, world: int, out: str, steps: int) -> None:
    """One of two processes on cuda:0: DDP on its own one-rank NCCL group (NCCL refuses two ranks of one
    communicator on one GPU), the pacing side group and the watchdog on the gloo world group."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import pace_strategy

    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(os.path.join(out, "pair_store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=90))
    own = [dist.new_group([r], backend=_backend()) for r in range(world)][rank]  # every rank makes each
    net = _heavy_net(device)
    width = net[0].in_features
    cycles = None
    if device.type == "cuda":
        from pace_strategy.core.clock import CudaEventClock

        cycles = CudaEventClock(device).calibrate()

    class SlowPerSample(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            if rank == 1:
                ms = PAIR_MS_PER_SAMPLE * len(x)
                if cycles is not None:
                    torch.cuda._sleep(int(ms * cycles))  # device time, as a slower GPU would take
                else:
                    time.sleep(ms / 1e3)
            return x

    model = DDP(
        torch.nn.Sequential(SlowPerSample(), net),
        process_group=own,
        device_ids=None if cycles is None else [0],
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(steps * 64 * world, width))
    loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data, shuffle=False))
    pacing = {
        "mode": "adaptive",  # unpaced windows first: rebalancing's A/B baseline, then pacing may start
        "activate_windows": 1,
        "exchange_every_steps": 4,
        "warmup_steps": 2,
        "rebalance": {"enabled": True, "persist_windows": 1},
        "max_delay_step_fraction": 0.5,
    }
    with pace_strategy.attach(model, pacing=pacing, run_dir=Path(out) / "record") as pace:
        for (x,) in pace.dataloader(loader):
            pace.begin_step()
            model(x.to(device)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            pace.end_step(samples=len(x))
    dist.barrier()
    dist.destroy_process_group()


def _nccl_pair(out: Path, steps: int) -> Result:
    import torch.multiprocessing as mp

    from pace_strategy.telemetry.run_record import read_run_record

    steps = max(steps, PAIR_STEPS)
    mp.start_processes(_pair_rank, args=(2, str(out), steps), nprocs=2, start_method="spawn")
    record = read_run_record(out / "record")
    timed = [s for s in record.steps if s["valid"] and not s["warmup"]]
    named = sum(s["straggler_rank"] == 1 for s in timed)
    delays = [d for d in record.decisions if d.get("state") != "monitor" or any(d.get("delays_ms", []))]
    shares = [s for s in record.shares if s.get("state") == "trial"]
    results: Result = {}
    _check(
        results,
        "nccl_pair_straggler",
        record.end is not None
        and record.end["status"] == "completed"
        and timed
        and named >= 0.8 * len(timed),
        f"2 processes on {record.header['topology'][0]['device']}, DDP on one-rank "
        f"{'gloo' if _on_cpu() else 'NCCL'} groups: rank 1 named in {named} of {len(timed)} timed steps; "
        f"end {(record.end or {}).get('status')}",
    )
    _check(
        results,
        "nccl_pair_decisions",
        bool(delays) and bool(shares),
        f"pacing: {len(delays)} windows out of monitoring (delays up to "
        f"{max((max(d['delays_ms']) for d in delays), default=0.0):.2f} ms); rebalancing: "
        + (f"trial {shares[0]['samples']} ({shares[0]['reason'][:80]})" if shares else "no trial"),
    )
    return results


# ------------------------------------------------------------------------------------- several GPUs
def _join_ranks(rank: int, world: int, out: str, store: str) -> Any:
    """One of N ranks, one GPU each (the CPU in the rehearsal): its device, after joining the job's
    process group over a file store named ``store`` in ``out``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    device = torch.device("cpu") if _on_cpu() else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    files = dist.FileStore(os.path.join(out, store), world)
    dist.init_process_group(
        _backend(), store=files, rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    return device


def _multi_rank(rank: int, world: int, out: str, steps: int) -> None:
    """One of N ranks, one GPU each, NCCL: plain DDP, then paced in each monitor mode, then FSDP2."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pace_strategy

    device = _join_ranks(rank, world, out, "multi_store")
    width = REHEARSAL_WIDTH if _on_cpu() else 1024
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(32, width, generator=g).to(device) for _ in range(steps)]
    weights, records = {}, {}
    for arm in ("plain", "grad_ready", "comm_hook", "fsdp"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)]).to(device)
        if arm == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in net:
                fully_shard(layer)
            model: Any = fully_shard(net)
        else:
            model = DDP(net, device_ids=None if device.type == "cpu" else [rank])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        pacing = {"mode": "forced", "ddp_monitor": "comm_hook" if arm == "comm_hook" else "grad_ready"}
        pacing.update(exchange_every_steps=4, warmup_steps=1)
        pace = None if arm == "plain" else pace_strategy.attach(model, pacing=pacing, run_dir=Path(out) / arm)
        for x in batches:
            if pace is not None:
                pace.begin_step()
            if rank == world - 1:
                time.sleep(0.005)  # a late rank: the others lead and are delayed
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if pace is not None:
                pace.end_step(samples=len(x))
        if pace is not None:
            pace.finish()
            records[arm] = str(Path(out) / arm)
        if arm != "fsdp":
            weights[arm] = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
    if rank == 0:
        torch.save({"weights": weights, "records": records, "world": world}, os.path.join(out, "multi.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _multi_gpu(out: Path, steps: int) -> Result:
    import torch
    import torch.multiprocessing as mp

    from pace_strategy.telemetry.run_record import read_run_record

    count = 3 if _on_cpu() else torch.cuda.device_count()
    if count < 2:
        return {"multi_gpu_parity": ("SKIP", f"{count} GPU visible: an N-rank NCCL job needs 2 or more")}
    world = min(count, 3)  # 3 where there are 3: a world size that is not a power of two
    mp.start_processes(_multi_rank, args=(world, str(out), steps), nprocs=world, start_method="spawn")
    saved = torch.load(out / "multi.pt")
    plain = saved["weights"]["plain"]
    differ = {
        arm: [k for k in plain if not torch.equal(plain[k], w[k])]
        for arm, w in saved["weights"].items()
        if arm != "plain"
    }
    timed = {}
    delayed = {}
    for arm, path in saved["records"].items():
        record = read_run_record(path)
        steps_ = [s for s in record.steps if s["valid"] and not s["warmup"]]
        timed[arm] = len(steps_)
        delayed[arm] = max((s["delay_ms_max"] or 0.0 for s in steps_), default=0.0)
    ok = (
        not any(differ.values()) and all(n >= steps - 6 for n in timed.values()) and delayed["grad_ready"] > 0
    )
    return {
        "multi_gpu_parity": (
            "PASS" if ok else "FAIL",
            f"{world} ranks over {_backend()}: DDP paced vs plain "
            + ", ".join(
                f"{arm} {'bit-identical' if not d else 'differs in ' + str(d)}" for arm, d in differ.items()
            )
            + "; timed steps "
            + ", ".join(f"{arm} {n} (delay up to {delayed[arm]:.2f} ms)" for arm, n in timed.items()),
        )
    }


def _mesh_rank(rank: int, world: int, out: str, steps: int) -> None:
    """One of 4 ranks, one GPU each: each mesh layout trained unpaced, then paced (forced), from the
    same weights on the same batches; rank 0 saves both runs' full weights."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import pace_strategy
    from pace_strategy.testing.meshes import LAYOUTS, build_on_mesh

    device = _join_ranks(rank, world, out, "mesh_store")
    saved: dict[str, Any] = {}
    for layout, names in LAYOUTS.items():
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=names)
        dp = rank if layout == "hsdp" else mesh.get_local_rank("dp_shard")
        g = torch.Generator().manual_seed(1)
        xs, ys = torch.randn(steps, world, 8, 16, generator=g), torch.randn(steps, world, 8, 1, generator=g)
        weights = []
        for paced in (False, True):
            net = build_on_mesh(layout, mesh, device)
            opt = torch.optim.SGD(net.parameters(), lr=0.01)
            pacing = {"mode": "forced", "exchange_every_steps": 4, "warmup_steps": 1}
            record = Path(out) / layout
            pace = pace_strategy.attach(net, pacing=pacing, run_dir=record, mesh=mesh) if paced else None
            for s in range(steps):
                if pace is not None:
                    pace.begin_step()
                if rank == 1:
                    net.point.arm(0.0, 10.0)  # 10 ms at the end of its backward
                loss = torch.nn.functional.mse_loss(net(xs[s, dp].to(device)), ys[s, dp].to(device))
                loss.backward()
                opt.step()
                opt.zero_grad()
                if pace is not None:
                    pace.end_step(samples=8)
            if pace is not None:
                pace.finish()
            weights.append({k: p.detach().full_tensor().cpu() for k, p in net.named_parameters()})
        saved[layout] = {"weights": weights, "record": str(record)}
    if rank == 0:
        torch.save(saved, os.path.join(out, "meshes.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _meshes(out: Path, steps: int) -> Result:
    import torch
    import torch.multiprocessing as mp

    from pace_strategy.telemetry.run_record import read_run_record

    count = 4 if _on_cpu() else torch.cuda.device_count()
    if count < 4:
        reason = f"{count} GPU visible: the 2 x 2 meshes need 4"
        return {"nccl_hsdp_parity": ("SKIP", reason), "nccl_tp_parity": ("SKIP", reason)}
    mp.start_processes(_mesh_rank, args=(4, str(out), steps), nprocs=4, start_method="spawn")
    saved = torch.load(out / "meshes.pt")
    results: Result = {}
    for layout, collectives in (("hsdp", 11), ("tp", 8)):  # HSDP: 3 all-reduces beside FSDP's 8
        plain, paced = saved[layout]["weights"]
        differ = [k for k in plain if not torch.equal(plain[k], paced[k])]
        record = read_run_record(saved[layout]["record"])
        names = ("dp_replicate", "dp_shard") if layout == "hsdp" else ("dp_shard", "tp")
        coords = [tuple(t.get(n) for n in names) for t in record.header["topology"]]
        timed = [s for s in record.steps if s["valid"] and not s["warmup"]]
        buckets = {s["buckets"] for s in record.steps}
        ok = not differ and coords == [(0, 0), (0, 1), (1, 0), (1, 1)] and len(timed) >= steps - 6
        ok = ok and buckets == {collectives}
        results[f"nccl_{layout}_parity"] = (
            "PASS" if ok else "FAIL",
            f"4 ranks over {_backend()}: paced vs unpaced "
            f"{'bit-identical' if not differ else f'differ in {differ}'}; "
            f"coordinates {coords}; {len(timed)} timed steps; collectives per step {sorted(buckets)}",
        )
    return results


JOBS: dict[str, Callable[[Path, int], Result]] = {
    "lightning_ddp": lambda out, steps: _lightning("paced_ddp", out, steps),
    "lightning_fsdp": lambda out, steps: _lightning("paced_fsdp", out, steps),
    "device_delay": _device_delay,
    "shutdown": _shutdown,
    "gloo_ranks": _gloo_ranks,
    "nccl_ddp": _nccl_ddp,
    "fsdp_streams": _fsdp_streams,
    "nccl_pair": _nccl_pair,
    "multi_gpu": _multi_gpu,
    "meshes": _meshes,
}


# ------------------------------------------------------------------------------------- driver
def _no_cuda_reason() -> str | None:
    try:
        import torch
    except ImportError as error:
        return f"torch is not importable ({error})"
    if not torch.cuda.is_available():
        build = torch.version.cuda
        why = "this torch is a CPU build" if build is None else f"torch (CUDA {build}) sees no GPU"
        return f"CUDA is not available: {why}"
    return None


def run_in_own_session(cmd: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str] | None:
    """``cmd`` in a session of its own; on timeout its whole process group is killed (a job's own
    children, Lightning's ranks, must not outlive it holding the GPU) and ``None`` is returned."""
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _run_child(job: str, out: Path, steps: int, timeout_s: float) -> Result:
    """Run one job in its own process; its checks fail (with the reason) if it crashes or hangs."""
    names = [name for name, j in CHECKS.items() if j == job]
    result_file = out / f"{job}.json"
    cmd = [sys.executable, __file__, "--child", job, "--out", str(out), "--steps", str(steps)]
    proc = run_in_own_session(cmd, timeout_s)
    if proc is None:
        return {
            name: ("FAIL", f"job {job} did not finish within {timeout_s:.0f} s (its processes killed)")
            for name in names
        }
    if proc.returncode != 0 or not result_file.exists():
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return {name: ("FAIL", f"job {job} exited {proc.returncode}: {tail}") for name in names}
    loaded = json.loads(result_file.read_text())
    missing = ["FAIL", f"job {job} did not report it"]
    return {name: (str(loaded.get(name, missing)[0]), str(loaded.get(name, missing)[1])) for name in names}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", default=None, help="where the jobs write their logs and records (default: a temp dir)"
    )
    p.add_argument("--steps", type=int, default=40, help="training steps per job (default 40)")
    p.add_argument("--child", choices=sorted(JOBS), help=argparse.SUPPRESS)
    p.add_argument("--rehearse-on-cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rehearse_on_cpu:
        os.environ[REHEARSE_ENV] = "1"  # inherited by the child jobs
    if args.child:
        out = Path(args.out)  # one job, in its own process: write its results for the driver
        job_out = out / args.child
        job_out.mkdir(parents=True, exist_ok=True)
        results: dict[str, Any] = JOBS[args.child](job_out, args.steps)
        (out / f"{args.child}.json").write_text(json.dumps(results))
        sys.stdout.flush()
        os._exit(0)  # skip finalization: see pace_strategy.apps.recipes.leave_without_finalization
    reason = None if _on_cpu() else _no_cuda_reason()
    if reason is not None:
        for name in CHECKS:
            print(f"SKIP {name}: {reason}", flush=True)
        _write_lines(args.out, {name: ("SKIP", reason) for name in CHECKS})
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="pace_gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    started, failed, done = time.monotonic(), 0, {}
    for name, job in CHECKS.items():
        if name not in done:
            left_s = TOTAL_BUDGET_S - (time.monotonic() - started)
            done.update(_run_child(job, out, args.steps, min(JOB_TIMEOUT_S, max(left_s, 1.0))))
        status, detail = done[name]
        failed += status == "FAIL"
        print(f"{status} {name}: {detail}", flush=True)
    elapsed = time.monotonic() - started
    _write_lines(out, {name: done[name] for name in CHECKS})
    print(f"gpu_check: {len(CHECKS) - failed}/{len(CHECKS)} passed in {elapsed:.0f} s; logs in {out}")
    return 1 if failed else 0


def _write_lines(out: str | Path | None, results: Result) -> None:
    """``OUT/gpu_check.json``: one ``{"check", "status", "detail"}`` per printed line."""
    if out is None:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    lines = [
        {"check": name, "status": status, "detail": detail} for name, (status, detail) in results.items()
    ]
    (Path(out) / "gpu_check.json").write_text(json.dumps(lines, indent=1))


if __name__ == "__main__":
    sys.exit(main())
