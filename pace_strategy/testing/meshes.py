"""A small network on a device mesh, as the mesh tests and the GPU check train it: HSDP over
``dp_replicate`` x ``dp_shard``, or FSDP x tensor parallelism over ``dp_shard`` x ``tp`` (the up
projection column-wise, the down projection row-wise, as Lightning's and torchtitan's examples do).
An :class:`~pace_strategy.testing.slow.InjectionPoint` after the first layer makes one rank slow in
its forward or at the very end of its backward."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from pace_strategy.testing.slow import InjectionPoint

__all__ = ["LAYOUTS", "MeshNet", "build_on_mesh", "shard", "shard_tensor_parallel"]

#: layout -> the mesh's dimension names
LAYOUTS = {"hsdp": ("dp_replicate", "dp_shard"), "tp": ("dp_shard", "tp")}


class MeshNet(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.first = nn.Linear(16, width)
        self.point = InjectionPoint()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.point(self.first(x))
        return self.head(self.down(torch.relu(self.up(x))))


def shard(net: MeshNet, mesh: DeviceMesh) -> MeshNet:
    """FSDP over ``mesh`` (2-D: HSDP): each projection a group, the network the root."""
    fully_shard(net.up, mesh=mesh)
    fully_shard(net.down, mesh=mesh)
    fully_shard(net, mesh=mesh)  # shards in place; the module is the same object
    return net


def shard_tensor_parallel(net: MeshNet, tp: DeviceMesh, dp: DeviceMesh) -> MeshNet:
    """The projections over ``tp`` (``up`` column-wise, ``down`` row-wise), then FSDP over ``dp``."""
    parallelize_module(net, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return shard(net, dp)


def build_on_mesh(layout: str, mesh: DeviceMesh, device: torch.device | str = "cpu") -> MeshNet:
    """The network with the same initial weights on every rank (seed 0), on ``mesh`` as ``layout``
    (a key of :data:`LAYOUTS`) lays it out."""
    torch.manual_seed(0)
    net = MeshNet().to(device)
    if layout == "hsdp":
        return shard(net, mesh)
    return shard_tensor_parallel(net, mesh["tp"], mesh["dp_shard"])
