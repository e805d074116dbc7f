"""The comm-hook wrapper on a bare torch DDP loop, two real processes (gloo, file store).

It must compose over a user's hook: paced (with delays forced on) and unpaced runs of DDP with
torch's fp16-compression hook end with bit-identical weights, and the wrapped hook really ran. With
no user hook, the pacing hook's own all-reduce over several buckets gives the bits of DDP's built-in
reduction.
"""

from __future__ import annotations

import faulthandler
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORLD = 2
STEPS = 12


def _train(rank: int, store_path: str, out_dir: str, paced: bool, user_hook: bool) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pace_strategy import Pacer, PacingConfig, register_paced_hook
    from pace_strategy.core.records import Field
    from pace_strategy.session import side_group

    stacks = open(os.path.join(out_dir, f"stacks{rank}.txt"), "w")  # noqa: SIM115 (open for the process)
    faulthandler.dump_traceback_later(60, file=stacks)  # a hang leaves its stack for the test to show
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store_path, WORLD),
            rank=rank,
            world_size=WORLD,
            timeout=timedelta(seconds=60),
        )
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        # 0.5 KB buckets: from the second step (DDP rebuilds its buckets after the first) the layers
        # take two, so the hook's first-bucket and last-bucket paths run on different buckets.
        model = DDP(net, bucket_cap_mb=None if user_hook else 0.0005)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        calls = {"fp16": 0}

        def counting_fp16(state, bucket):
            calls["fp16"] += 1
            return default_hooks.fp16_compress_hook(state, bucket)

        pacer = None
        if paced:
            cfg = PacingConfig(
                exchange_timeout_s=60.0,
                mode="forced",
                exchange_every_steps=2,
                warmup_steps=1,
                max_delay_step_fraction=0.5,
                persist_fraction=0.5,
            )
            pacer = Pacer(cfg, side_group(cfg), rank, WORLD)
            register_paced_hook(model, pacer, counting_fp16 if user_hook else None, None)
        elif user_hook:
            model.register_comm_hook(None, counting_fp16)
        g = torch.Generator().manual_seed(100 + rank)
        delays = []
        buckets = []  # per window: the most buckets any rank's step handed off
        for step in range(STEPS):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            if pacer is not None:
                pacer.begin_step(step)
            if rank == 1:
                time.sleep(0.03)  # rank 1 is 30 ms slower
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if pacer is not None:
                result = pacer.end_step()
                delays.append(pacer.delay_ms)
                if result is not None:
                    buckets.append(int(result.gathered[:, :, Field.BUCKETS].max()))
        if pacer is not None:
            pacer.flush()
        if rank == 0:
            torch.save(
                {
                    "state": model.module.state_dict(),
                    "fp16_calls": calls["fp16"],
                    "delays": delays,
                    "buckets": buckets,
                },
                os.path.join(out_dir, f"{'paced' if paced else 'plain'}.pt"),
            )
        # Drop every reference to DDP and the pacer's side group before tearing the groups down,
        # and tear down together: a gloo group freed while its peer is still using it can block.
        del model, pacer
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _run(tmp_path, paced: bool, user_hook: bool = True) -> dict:
    out = tmp_path / ("paced" if paced else "plain")
    out.mkdir()
    args = (str(out / "store"), str(out), paced, user_hook)
    ctx = mp.start_processes(_train, args=args, nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 90
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                stacks = [p.read_text() for p in sorted(out.glob("stacks*.txt"))]
                raise AssertionError("ranks did not finish within 90 s:\n" + "\n".join(stacks))
    except mp.ProcessRaisedException as error:
        errors = [p.read_text() for p in sorted(out.glob("error*.txt"))]
        raise AssertionError("\n".join(errors) or str(error)) from error
    return torch.load(out / f"{'paced' if paced else 'plain'}.pt")


def test_wrapped_user_hook_runs_and_weights_match_unpaced(tmp_path):
    plain = _run(tmp_path, paced=False)
    paced = _run(tmp_path, paced=True)
    assert paced["fp16_calls"] == plain["fp16_calls"] >= STEPS  # the user's hook ran inside ours
    assert max(paced["delays"]) > 1.0, f"no delay was applied: {paced['delays']}"
    for key, value in plain["state"].items():
        assert torch.equal(value, paced["state"][key]), key


def test_default_all_reduce_over_several_buckets_matches_ddps_own_bits(tmp_path):
    plain = _run(tmp_path, paced=False, user_hook=False)  # DDP's built-in reduction, no hook
    paced = _run(tmp_path, paced=True, user_hook=False)  # the pacing hook's own all-reduce
    assert min(paced["buckets"]) > 1, paced["buckets"]  # really several buckets per step
    assert max(paced["delays"]) > 1.0, f"no delay was applied: {paced['delays']}"
    for key, value in plain["state"].items():
        assert torch.equal(value, paced["state"][key]), key
