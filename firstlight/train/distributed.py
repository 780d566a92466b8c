"""torch.distributed setup for data-parallel training launched by `torchrun --nproc_per_node N`.

gloo on CPU, NCCL on CUDA. A plain `python` launch (no RANK in the environment) is world size 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    backend: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> DistInfo:
    """Join the process group torchrun describes in the environment (no-op when not launched by it)."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return DistInfo()
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), backend)


def shutdown_distributed(info: DistInfo) -> None:
    if info.world_size > 1:
        import torch.distributed as dist

        # every rank reaches teardown before any destroys the group: a rank that tore gloo down while its
        # peer was still saving aborted that peer at exit ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_mean(value: float, info: DistInfo) -> float:
    if info.world_size == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / info.world_size
