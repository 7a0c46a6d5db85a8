"""Where this process sits in the job (`DistInfo`): rank, world size, device, backend.

Its own module, below both users: fasttrain.distributed makes it (init_distributed) and
fasttrain.buckets, which distributed builds on, takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    """Number of processes in the job (all nodes)."""
    local_rank: int
    """Rank on this node; the CUDA device index it drives."""
    device: torch.device
    """The device this process trains on."""
    backend: str
    """'nccl', 'gloo', or 'none' for a single process without a process group."""
    is_main: bool
    """rank == 0: the process that logs, evaluates into files and writes checkpoints."""

    @property
    def distributed(self) -> bool:
        return self.backend != "none"
