"""The framework's own collectives are timed on the training thread only, once each, blocking calls
only, never pace_strategy's side group; and unwrapped at the end (a 1-rank gloo group, real calls)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.records import Field
from pace_strategy.hooks.framework_sync import COLLECTIVES, time_framework_syncs

pytestmark = pytest.mark.timeout(60)


def test_only_the_training_thread_s_blocking_collectives_outside_the_side_group_are_timed():
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        side = dist.new_group([0], backend="gloo")
        pacer = Pacer(PacingConfig(), side, 0, 1)
        restore = time_framework_syncs(pacer, side)
        timed = pacer._pending_syncs  # before any step: each goes to the next step's gap
        value = torch.ones(2)
        dist.all_reduce(value)
        assert len(timed) == 1
        dist.all_reduce(value, async_op=True).wait()  # asynchronous: whoever waits is not seen
        dist.all_reduce(value, group=side)  # pace_strategy's own exchange
        assert len(timed) == 1
        objects: list[object] = [None]
        dist.all_gather_object(objects, {"labels": 3})  # calls all_gather inside: timed once
        assert len(timed) == 2 and objects == [{"labels": 3}]
        other = threading.Thread(target=dist.broadcast, args=(value, 0))
        other.start()
        other.join()
        assert len(timed) == 2  # another thread (a user's, or the watchdog's)
        pacer.begin_step(0)  # the two before it are the step's, from its gap
        dist.barrier()  # in the step, before the first gradient: taken out of its compute
        where = [w for _, _, w in pacer._open.framework_syncs]
        assert where == [Field.GAP_MS, Field.GAP_MS, Field.COMPUTE_MS] and not pacer._pending_syncs
        restore()
        restore()  # idempotent
        assert all(getattr(dist, name) is fn for name, fn in originals.items())
        dist.all_reduce(value)
        assert len(pacer._open.framework_syncs) == 3
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        dist.destroy_process_group()
