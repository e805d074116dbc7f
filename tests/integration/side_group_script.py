"""One rank of the side-group interface test: the job's own gloo group is built over the node's
interface (as NCCL would find its way), then GLOO_SOCKET_IFNAME is taken away and pace_strategy's side
group must find the interface by itself. Prints the interface it used and the all-reduced sum."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from pace_strategy import PacingConfig
from pace_strategy.session import side_group

interface = os.environ["GLOO_SOCKET_IFNAME"]
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
del os.environ["GLOO_SOCKET_IFNAME"]  # the job's group is up; the side group must choose alone
try:
    group = side_group(PacingConfig(exchange_timeout_s=15.0))
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    print(f"side group over {os.environ.get('GLOO_SOCKET_IFNAME')} (job: {interface}) sum {value.item():g}")
    dist.destroy_process_group(group)
    code = 0
except Exception as error:
    print(f"FAILED: {error}", flush=True)
    code = 3
dist.destroy_process_group()
sys.stdout.flush()
os._exit(code)
