"""The process group of the training actors (`ray.train_workers` > 1): torch.distributed inside
the resident policy actors, opened for one training and closed after it.

Rank 0's actor names a rendezvous (`rendezvous`: its node's address and a free port); every
training actor then joins (`joined`) with its rank, on NCCL when its backbone is on a GPU, gloo
otherwise, and trains its part of each optimizer step (`cast_core.data_parallel`). The group
lives for one call: a group that outlived its training would tie the actors together across the
rollouts between (where they work alone) and break whenever Ray restarts one of them; joining
costs a TCP rendezvous per iteration, small beside a training.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch

from cast_core.data_parallel import Shard

# how long a rank waits for the others (to join, or inside a collective) before it fails: a lost
# peer is seen at once by gloo, only after this by NCCL
TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class Group:
    """Where the group meets (tcp://host:port of rank 0's actor) and this actor's place in it."""

    address: str
    rank: int
    world: int


def rendezvous() -> str:
    """An address for the group on this actor's node: its IP and a port free now."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


@contextmanager
def joined(group: Group, device: torch.device) -> Iterator[Shard]:
    """This actor in the group for the duration of the block (NCCL on a CUDA `device`, else
    gloo) -> its Shard; the group is destroyed after, also on failure."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.index is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=group.address, rank=group.rank,
                            world_size=group.world, timeout=TIMEOUT)
    try:
        yield Shard(group.rank, group.world)
    finally:
        dist.destroy_process_group()
