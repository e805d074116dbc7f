"""One rank of a bare torch DDP job with a paced session, for the fault tests (test_hang, test_elastic).

``python fault_job.py RUN_DIR [options]``. Under torchrun the rank, world size and store come from the
environment; with ``--store-port`` the ranks rendezvous on the test's own TCPStore (``--rank``,
``--world``), so that a stopped rank does not take the store with it, as under torchrun. Each rank
trains a tiny model for ``--steps`` steps and writes ``RUN_DIR/reached{rank}`` (its pid) after
``--ready-at``.
Faults: ``--sleep-rank`` is blocked at step ``--sleep-at`` (heartbeat live), where ``--sleep-in``
says: ``step`` (a sleep inside its step), ``loader`` (a sleep in its data loader, fetching the step's
batch), ``lock`` (a Python deadlock: acquiring a lock another thread holds);
``--exit-rank`` dies with ``os._exit(1)`` at step ``--exit-at`` on the job's first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0). The tests stop ranks with SIGSTOP themselves.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from pace_strategy import HangConfig, PacingConfig, attach_paced_ddp
from pace_strategy.session import PacingSession
from pace_strategy.shutdown import leave_without_finalization


def _init(args: argparse.Namespace) -> tuple[int, int]:
    # The training group's own timeout is long: only the watchdog may end a hang within a test.
    timeout = timedelta(seconds=60)
    if args.store_port is None:  # torchrun: env://
        dist.init_process_group("gloo", timeout=timeout)
    else:
        store = dist.TCPStore("127.0.0.1", args.store_port, args.world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def batches(steps: int, sleep_at: int):
    """The data loader: one batch per step; at ``sleep_at`` it blocks fetching the batch."""
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for step in range(steps):
        if step == sleep_at:
            time.sleep(600)
        yield x, y


def deadlock() -> None:
    """Acquire a lock that another thread holds and never releases (a Python deadlock)."""
    lock, held = threading.Lock(), threading.Event()

    def hold() -> None:
        lock.acquire()
        held.set()
        threading.Event().wait()

    threading.Thread(target=hold, name="holds-the-lock", daemon=True).start()
    held.wait()
    lock.acquire()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--store-port", type=int, default=None)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--ready-at", type=int, default=6)
    p.add_argument("--sleep-rank", type=int, default=-1)
    p.add_argument("--sleep-at", type=int, default=-1)
    p.add_argument("--sleep-in", choices=("step", "loader", "lock"), default="step")
    p.add_argument("--exit-rank", type=int, default=-1)
    p.add_argument("--exit-at", type=int, default=-1)
    p.add_argument("--hang-timeout", type=float, default=120.0)
    p.add_argument("--hang-action", default="abort")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(1)
    run_dir = Path(args.run_dir)
    rank, world = _init(args)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    config = PacingConfig(
        mode="monitor",
        exchange_every_steps=4,
        warmup_steps=1,
        hang=HangConfig(timeout_s=args.hang_timeout, action=args.hang_action),
    )
    session = PacingSession.with_side_group(
        config,
        rank=rank,
        world_size=world,
        device=torch.device("cpu"),
        framework="torch",
        log_dir=run_dir if rank == 0 else None,
    )
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    attach_paced_ddp(model, session.pacer)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    blocked = rank == args.sleep_rank
    loader_sleeps_at = args.sleep_at if blocked and args.sleep_in == "loader" else -1
    for step, (x, y) in enumerate(batches(args.steps, loader_sleeps_at)):
        session.pacer.begin_step(step)
        time.sleep(0.01)  # stands in for compute: keeps the 2 cores free for the other ranks
        if blocked and step == args.sleep_at and args.sleep_in == "step":
            time.sleep(600)
        if blocked and step == args.sleep_at and args.sleep_in == "lock":
            deadlock()
        if rank == args.exit_rank and step == args.exit_at and first_attempt:
            os._exit(1)  # a rank that dies: torchrun stops the others and restarts the job
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        session.end_step()
        if step + 1 == args.ready_at:
            # whole or not there: a reader that sees the marker reads the pid
            (run_dir / f"reached{rank}.tmp").write_text(str(os.getpid()))
            os.replace(run_dir / f"reached{rank}.tmp", run_dir / f"reached{rank}")
    session.finish()
    dist.destroy_process_group()
    leave_without_finalization(0)


if __name__ == "__main__":
    main()
