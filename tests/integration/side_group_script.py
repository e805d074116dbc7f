"""One rank of the side-group interface test: the job's own gloo group is built over the node's
interface (as NCCL would find its way), then GLOO_SOCKET_IFNAME is taken away and pace_strategy's side
group must find the interface by itself. Prints the interface it used, the all-reduced sum and the
sockets the side group opened when it was built (lazily connected: its listening socket only)."""

import contextlib
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from pace_strategy import PacingConfig
from pace_strategy.core.groups import side_group
from pace_strategy.core.netif import gloo_interface

interface = os.environ["GLOO_SOCKET_IFNAME"]
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
del os.environ["GLOO_SOCKET_IFNAME"]  # the job's group is up; the side group must choose alone


def sockets() -> int:
    """Open sockets of this process."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


try:
    before = sockets()
    group = side_group(PacingConfig(exchange_timeout_s=15.0))
    print(f"side group built with {sockets() - before} sockets")
    # Both ranks have counted before either talks on the side group: the peer's first collective
    # connects to this rank's listening socket (lazily), which would be counted here otherwise.
    dist.barrier()
    # both set only while the group was built: the group keeps its interface (its first connection
    # is made by the collective below, after the variable is gone)
    assert "TORCH_GLOO_LAZY_INIT" not in os.environ and "GLOO_SOCKET_IFNAME" not in os.environ
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    chosen, _ = gloo_interface()
    print(f"side group over {chosen} (job: {interface}) sum {value.item():g}")
    dist.destroy_process_group(group)
    code = 0
except Exception as error:
    print(f"FAILED: {error}", flush=True)
    code = 3
dist.destroy_process_group()
sys.stdout.flush()
os._exit(code)
