"""What the selfcheck's checks share: the run's Context, Skip, and the trainer's step built small.

Each check takes a Context and returns what it compared and measured, raises Skip(reason) when it
cannot run here, and fails by raising (an AssertionError names the first buffer or figure that
differs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch


class Skip(Exception):  # noqa: N818 (a check's outcome, not an error)
    """Raised by a check that cannot run here; the message is the reason shown in its row."""


@dataclass
class Context:
    device: torch.device
    scratch: Path
    """A temporary directory, removed after the run."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def needs_cuda(ctx: Context, what: str) -> None:
    if not ctx.cuda:
        raise Skip(f"no CUDA device: {what} runs only on a GPU")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # note: host waits for the device (timing and comparisons only)


def batches(n: int, device, batch=4, size=32, classes=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=gen).to(device),
            torch.randint(0, classes, (batch,), generator=gen).to(device),
        )
        for _ in range(n)
    ]


def train_step(
    model, precision, device, impl="auto", dist_info=None, ddp_model=None, cap_mb=0.25, compile_mode=None
):
    """The trainer's TrainStep with momentum SGD (lr 0.05, wd 1e-4), label smoothing 0.1; with
    compile_mode, the model's regions compiled (fasttrain/compile.py)."""
    from fasttrain.buckets import GradBuckets
    from fasttrain.compile import CompiledModel
    from fasttrain.config import make_config
    from fasttrain.optim import FusedMomentum
    from fasttrain.schedule import LRSchedule
    from fasttrain.step import TrainStep, classification_loss

    cfg = make_config(initial_learning_rate=0.05, learning_rate_decay_factor=1.0)
    opt = FusedMomentum(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, impl=impl)
    schedule = LRSchedule(cfg, steps_per_epoch=100, global_batch=4, device=device)
    loss_fn = lambda out, y: classification_loss(out, y, label_smoothing=0.1)  # noqa: E731
    buckets = None
    if dist_info is not None and ddp_model is None:
        buckets = GradBuckets(
            opt.flat, dist_info, bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb / 5, enabled=True
        )
    world = dist_info.world_size if dist_info is not None else 1
    step = TrainStep(
        model,
        optimizer=opt,
        precision=precision,
        device=device,
        schedule=schedule,
        loss_fn=loss_fn,
        preprocess="resnet",
        world_size=world,
        buckets=buckets,
        ddp_model=ddp_model,
        compiled=CompiledModel(model, compile_mode, log=lambda line: None) if compile_mode else None,
    )
    return step


@contextlib.contextmanager
def deterministic():
    """Deterministic cuDNN algorithms and no TF32: a check compares two fp32 computations of the same
    step, and TF32 (on by default for cuDNN convolutions) rounds inputs to 10 mantissa bits, so two
    different algorithms differ by ~1e-3 relative, far above the checks' 1e-5."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    flags = cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32
    cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32 = False, True, False, False
    try:
        yield
    finally:
        cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32 = flags
