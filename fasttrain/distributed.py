"""Process group from torchrun's environment, start-up broadcast, small collectives, DDP and SyncBN.

torchrun (`torchrun --nproc_per_node=N -m fasttrain ...`, or `python -m torch.distributed.run`) sets
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process; a plain
`python -m fasttrain` sets none of them and runs as one process without a process group. With CUDA
each process drives the device LOCAL_RANK and the backend is NCCL; on the CPU it is gloo.

Gradient averaging: fasttrain's own buckets (GradBuckets, in fasttrain/buckets.py) all-reduce a SUM and
the optimizer multiplies by 1/world_size; torch DDP (`wrap_ddp`, --grad_sync ddp) averages by itself,
so the trainer passes grad_scale without the 1/world_size factor there.

BatchNorm statistics stay per rank by default, as in the seeds (each tower normalised with its own
batch); `maybe_sync_bn` converts to SyncBatchNorm (CUDA only) for --sync_bn.
"""

from __future__ import annotations

import inspect
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from fasttrain.buckets import GradBuckets, GradSyncError
from fasttrain.dist_info import DistInfo
from fasttrain.errors import SettingError

__all__ = [
    "DistInfo",
    "init_distributed",
    "total_over_ranks",
    "cleanup",
    "broadcast_module",
    "all_reduce_flag",
    "check_graph_capture_env",
    "all_reduce_sum",
    "rank0_error",
    "from_rank0",
    "first_rank_error",
    "per_rank_batch",
    "wrap_ddp",
    "maybe_sync_bn",
    "GradBuckets",
    "GradSyncError",
]

_TORCHRUN_HINT = "launch with torchrun (python -m torch.distributed.run), which sets it"


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise SettingError(
            f"environment variable {name}={text!r} is not an integer; {_TORCHRUN_HINT}"
        ) from None


def _pick_device(device: str, local_rank: int, distributed: bool) -> torch.device:
    if device not in ("auto", "cuda", "cpu"):
        raise SettingError(f"device {device!r} is not one of auto, cuda, cpu", settings=("device",))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise SettingError(
            "CUDA was requested but no CUDA device is visible (check CUDA_VISIBLE_DEVICES "
            "and the driver), or run on the CPU"
        )
    if not distributed:
        return torch.device("cuda", torch.cuda.current_device())
    if local_rank >= count:
        raise SettingError(
            f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible on this "
            f"node: start torchrun with --nproc_per_node={count} or fewer"
        )
    return torch.device("cuda", local_rank)


def init_distributed(device: str = "auto", timeout_s: float | None = None) -> DistInfo:
    """Join the process group described by torchrun's environment (or run as a single process).

    device: 'auto' (CUDA if available, else CPU), 'cuda' or 'cpu'. With CUDA this sets the current
    device to LOCAL_RANK and uses NCCL (the communicator is created now, bound to that device, so that
    a later CUDA graph capture never has to create one); on the CPU it uses gloo.
    """
    world_size = _env_int("WORLD_SIZE")
    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
    if world_size is None:
        if rank is not None or local_rank is not None:
            raise SettingError(f"RANK or LOCAL_RANK is set but WORLD_SIZE is not; {_TORCHRUN_HINT}")
        dev = _pick_device(device, 0, distributed=False)
        return DistInfo(rank=0, world_size=1, local_rank=0, device=dev, backend="none", is_main=True)
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
        if value is None:
            raise SettingError(f"WORLD_SIZE is set but {name} is not; {_TORCHRUN_HINT}")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise SettingError(f"{name} is not set; {_TORCHRUN_HINT}, or set it to rank 0's address/port")
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise SettingError(
            f"inconsistent torchrun environment: RANK={rank}, LOCAL_RANK={local_rank}, "
            f"WORLD_SIZE={world_size}"
        )
    dev = _pick_device(device, local_rank, distributed=True)
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    kwargs["store"] = _attempt_store(rank, world_size, timeout_s)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=dev, **kwargs)
        backend = "nccl"
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, **kwargs)
        backend = "gloo"
    return DistInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=dev,
        backend=backend,
        is_main=rank == 0,
    )


def _attempt_store(rank: int, world_size: int, timeout_s: float | None) -> dist.Store:
    """torchrun's store, with keys private to this restart attempt.

    Under `torchrun --max-restarts`, the agent's store can outlive a restart; the restarted workers
    would then read the dead workers' gloo/NCCL addresses and fail with "connection refused"
    (pytorch/pytorch#167288). A prefix per TORCHELASTIC_RESTART_COUNT keeps every attempt apart.
    """
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else timedelta(minutes=30)
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    return dist.PrefixStore(f"fasttrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def cleanup() -> None:
    """Leave the process group (a no-op for a single process)."""
    if dist.is_available() and dist.is_initialized():
        # gloo's worker threads drop their last references to a finished collective's tensors just
        # after wait() returns, and that needs the GIL. Two ways this goes wrong, both fixed by
        # sleeping (which hands them the GIL): (1) torch 2.7's destroy_process_group joins those
        # threads while holding the GIL, and the process hangs for ever (5 of 30 two-rank runs of
        # a flag all-reduce then cleanup; 0 of 30 with the sleep before it); (2) torch 2.13's leaves
        # them running, and if Python is already finalizing the process aborts ("terminate called
        # without an active exception", pytorch/pytorch#190489; about one 4-rank CPU run in five;
        # none in 30 with the sleep after it). No barrier: cleanup also runs on error paths, where
        # the other ranks may be inside a different collective.
        time.sleep(0.05)
        dist.destroy_process_group()
        time.sleep(0.05)


# torch's names for NCCL's blocking wait, the first taking precedence (ProcessGroupNCCL.hpp), and the
# values its getCvarBool reads as true.
_BLOCKING_WAIT_VARS = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
_TRUE_VALUES = ("y", "yes", "1", "t", "true")


def check_graph_capture_env(info: DistInfo, cuda_graph: bool) -> None:
    """SettingError if the environment stops NCCL collectives from being captured in a CUDA graph.

    With blocking wait on, every NCCL wait() blocks the host until the collective has finished,
    which a stream under capture cannot do: the capture fails, and without this check the user sees
    only "cannot be captured in a CUDA graph".
    """
    if not cuda_graph or info.backend != "nccl":
        return
    name = next((n for n in _BLOCKING_WAIT_VARS if os.environ.get(n) is not None), None)
    if name is not None and os.environ[name].strip().lower() in _TRUE_VALUES:
        raise SettingError(
            f"{name}={os.environ[name]} makes every NCCL wait block the host, which a CUDA graph "
            f"capture cannot contain: unset {name} (or set it to 0), or run with cuda_graph=false",
            settings=("cuda_graph",),
        )


def per_rank_batch(global_batch: int, info: DistInfo) -> int:
    """The per-rank batch for a requested global batch, which must divide evenly over the ranks."""
    if global_batch % info.world_size:
        raise SettingError(
            f"the global batch {global_batch} is not divisible by the world size "
            f"{info.world_size}: choose a multiple of {info.world_size}"
        )
    return global_batch // info.world_size


def broadcast_module(model: nn.Module, src: int = 0) -> None:
    """Copy rank src's parameters and buffers into every rank's model, in place (views stay views)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    tensors = [t for t in (*model.parameters(), *model.buffers())]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    # One collective per dtype and device instead of one per tensor (ResNet-50: ~320 tensors).
    with torch.no_grad():
        for group in by_kind.values():
            packed = torch.cat([t.detach().reshape(-1) for t in group])
            dist.broadcast(packed, src=src)
            offset = 0
            for t in group:
                t.copy_(packed[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def all_reduce_flag(flag: bool, info: DistInfo) -> bool:
    """True on every rank if any rank passed True (e.g. a SIGTERM seen by one rank stops all)."""
    if not info.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())  # note: a host sync; call it at the trainer's check points only


def rank0_error(message: str, info: DistInfo) -> str:
    """Rank 0's error message ('' for none) on every rank: when only rank 0 does something that can
    fail (claiming the run directory, writing a checkpoint), every rank stops with one line instead
    of the others failing later with gloo/NCCL "connection closed" tracebacks."""
    return from_rank0(message, info)  # note: a host sync; once per checkpoint and at start-up


def from_rank0(value, info: DistInfo):
    """Rank 0's `value` (any picklable object) on every rank: a decision that only rank 0 makes and
    every rank must follow (which checkpoint to resume, whether there is one)."""
    if not info.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)  # note: a host sync; at start-up only
    return box[0]


def first_rank_error(message: str, info: DistInfo) -> tuple[int, str] | None:
    """(rank, message) of the lowest rank whose message is not empty, on every rank (None when all are
    empty): when every rank tries something that can fail on some only (reading a file rank 0 chose),
    all stop together with one reason instead of the others waiting in their next collective."""
    if not info.distributed:
        return (0, message) if message else None
    gathered = [""] * info.world_size
    dist.all_gather_object(gathered, message)  # note: a host sync; at start-up and per loaded checkpoint
    return next(((rank, text) for rank, text in enumerate(gathered) if text), None)


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum `tensor` over ranks in place (a no-op for one process); returns it."""
    if info.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def total_over_ranks(value: int, info: DistInfo) -> int:
    """The sum of every rank's `value` (a host count: records skipped), on every rank; a host sync."""
    if not info.distributed:
        return value
    return int(all_reduce_sum(torch.tensor([value], dtype=torch.int64, device=info.device), info).item())


_DDP_DEFAULT_CAP_MB = 25.0  # torch DDP's default bucket_cap_mb


def wrap_ddp(
    model: nn.Module, info: DistInfo, bucket_cap_mb: float = 25.0, stream: torch.cuda.Stream | None = None
) -> nn.Module:
    """torch DistributedDataParallel around model, for grad_sync ddp (averages the gradients).

    No buffer broadcast in forward keeps BatchNorm statistics per rank, as fasttrain's buckets do, so both
    modes train identically. gradient_as_bucket_view stays False: True would re-point every p.grad
    into DDP's own buckets, away from the flat gradient buffer the fused optimizer reads; with False
    DDP copies the averaged gradients back into the existing p.grad views.
    """
    if not info.distributed:
        raise SettingError(
            "grad_sync ddp needs a process group: launch with torchrun", settings=("grad_sync",)
        )
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (which still syncs once at
    # construction: harmless, broadcast_module has done the same).
    ddp = nn.parallel.DistributedDataParallel
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(ddp).parameters
        else {"broadcast_buffers": False}
    )
    # DDP makes its first bucket 1 MiB (as GradBuckets always does) only when bucket_cap_mb is left
    # unset; an explicit 25 would give it one 25 MiB cap for every bucket and a different layout.
    ddp_cap = None if bucket_cap_mb == _DDP_DEFAULT_CAP_MB else bucket_cap_mb
    build = lambda: ddp(
        model,
        device_ids=device_ids,
        bucket_cap_mb=ddp_cap,
        gradient_as_bucket_view=False,
        **no_buffer_sync,
    )
    if info.device.type != "cuda":
        return build()
    # PyTorch's CUDA-graph notes: for a whole-step capture DDP must be constructed on a side stream
    # (`stream`: the one the step's warm-up and capture use, see TrainStep).
    side = stream or torch.cuda.Stream(info.device)
    side.wait_stream(torch.cuda.current_stream(info.device))
    with torch.cuda.stream(side):
        wrapped = build()
    torch.cuda.current_stream(info.device).wait_stream(side)
    return wrapped


def maybe_sync_bn(model: nn.Module, enabled: bool, info: DistInfo | None = None) -> nn.Module:
    """The model with its BatchNorm layers converted to SyncBatchNorm when enabled (sync_bn)."""
    if not enabled:
        return model
    if info is not None and info.distributed and info.device.type != "cuda":
        raise SettingError(
            "sync_bn needs CUDA devices (torch's SyncBatchNorm does not run on the CPU); "
            "drop sync_bn for CPU runs",
            settings=("sync_bn",),
        )
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # A normalisation layer torch does not convert (SlimBatchNorm, a module of its own) would keep its
    # rank's statistics without a word (config_checks refuses the one model that has them; this is
    # the net for any other).
    kept = sorted({type(m).__name__ for m in model.modules() if _keeps_own_statistics(m)})
    if kept:
        raise SettingError(
            f"sync_bn cannot convert this model's {', '.join(kept)} layers (torch's SyncBatchNorm "
            "replaces nn.BatchNorm layers only); drop sync_bn",
            settings=("sync_bn",),
        )
    return model


def _keeps_own_statistics(module: nn.Module) -> bool:
    return isinstance(getattr(module, "running_mean", None), torch.Tensor) and not isinstance(
        module, nn.SyncBatchNorm
    )
