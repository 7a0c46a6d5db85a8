"""Input pipelines: one dispatch point (`build_loader`) over the DALI, torch and synthetic backends.

Every loader follows the `Loader` protocol (fasttrain/data/loader.py), so the trainer never asks which
backend it has. Training loaders drop each rank's last partial batch; evaluation loaders see every
record of the split exactly once across ranks and keep partial batches. The batches a loader hands out
are the caller's to keep, unless it was built with reuse_buffers=True (the trainer's zero-copy ring;
see build_loader).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from fasttrain.config import Config
from fasttrain.data.errors import DataError, LabelRangeError
from fasttrain.data.loader import EpochPosition, Loader
from fasttrain.errors import FasttrainError, SettingError
from fasttrain.threads import input_workers, resolve_input

if TYPE_CHECKING:
    from fasttrain.precision import Precision

# The names the package's users import from it (the backends import them from their own modules).
__all__ = [
    "DataError",
    "EpochPosition",
    "LabelRangeError",
    "Loader",
    "SyntheticLoader",
    "build_loader",
    "dali_available",
    "resolve_backend",
]


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def _dali_recent() -> bool:
    """DALI imports and is a release fasttrain's pipeline runs on (dali_pipeline.DALI_MIN_VERSION): "auto"
    chose an older one, which the loader then refused, so the default command failed with it."""
    if not dali_available():
        return False
    import nvidia.dali

    from fasttrain.data.dali_pipeline import check_dali_version

    try:
        check_dali_version(nvidia.dali.__version__)
    except SettingError:
        return False
    return True


def resolve_backend(cfg: Config, device: torch.device | None = None) -> str:
    """The backend a loader for `device` (None: the CPU) uses: cfg.data_backend, or for "auto" DALI
    only where it is the faster path, its GPU (nvJPEG) decode on a CUDA device. On a CPU, DALI's CPU
    mode ran at 0.29x of the torch backend on the bench's photos (683-724 against 2,347-2,493 images/s,
    issue 38), is not TensorFlow's pixels and reads no row checkpoints: "auto" takes torch there (an
    explicit "dali" still runs it). DALI cannot skip a corrupt record: skip_corrupt takes torch too."""
    if cfg.data_backend == "auto":
        cuda = device is not None and torch.device(device).type == "cuda"
        return "dali" if cuda and not cfg.skip_corrupt and _dali_recent() else "torch"
    if cfg.data_backend == "dali" and not dali_available():
        raise SettingError(
            "data_backend=dali needs NVIDIA DALI: pip install 'fasttrain[dali]'", settings=("data_backend",)
        )
    return cfg.data_backend


def startup_workers(cfg: Config) -> int:
    """The input workers a run of cfg keeps busy (fasttrain.threads.input_workers), known before its
    device is set up: for fasttrain.threads.configure of a command line, which calls this once torch
    is imported (torch says whether CUDA is there and so which backend and worker count "auto" take)."""
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    try:
        backend = resolve_backend(cfg, torch.device("cuda") if cuda else None)
    except FasttrainError:  # e.g. dali without DALI: the trainer says so in one line
        backend = cfg.data_backend
    return input_workers(resolve_input(dataclasses.replace(cfg, data_backend=backend), cuda))


def build_loader(
    cfg: Config,
    split: str,
    *,
    training: bool,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | None = None,
    precision: Precision | None = None,
    reuse_buffers: bool = False,
) -> Loader:
    """The loader for `split` ('train' or 'validation') of cfg.data_dir on this rank.

    training=True: shuffled, augmented with the train transform, partial batches dropped.
    training=False: in order, the eval transform, every record exactly once across ranks.
    precision: the run's resolved policy; DALI writes fp16 batches for an fp16 run (fp32 otherwise).
    reuse_buffers: False (the default), every batch handed out is the caller's own and stays what it
        was however long it is kept. True, the torch thread loader (cfg.loader "threads") writes its
        batches into a ring of hold + 2 reused buffers and hands out views of them: a batch is valid
        only until `hold` more have been requested (hold = grad_accum_steps in training, 1 in
        evaluation), and a kept batch would later show other images. The trainer and the evaluator
        use it (they are done with a batch before asking for the next group); other backends always
        hand out the caller's own tensors. What the default costs over the ring, measured on 2 shared
        cores with real photos (bench/results/2026-11-27-cpu-loader-buffers/): 0.7-1.1 CPU ms per
        batch of 32 x 224 x 224 x 3 (+2.6-3.7% of the loader's CPU), the new pages' faults.
    """
    backend = resolve_backend(cfg, device)
    # --num_workers and --loader "auto" for this device and backend (fasttrain.threads says how).
    cfg = resolve_input(cfg, device is not None and torch.device(device).type == "cuda", backend)
    if backend == "synthetic":
        return SyntheticLoader(cfg, training, rank, device or torch.device("cpu"))
    if backend == "dali":
        from fasttrain.data.dali_pipeline import DaliLoader

        # DALI has no bf16 output: bf16 runs take fp32 and autocast casts.
        fp16 = precision is not None and precision.name == "fp16"
        dtype = torch.float16 if fp16 else torch.float32
        return DaliLoader(cfg, split, training, rank, world_size, device, dtype=dtype)
    if cfg.loader == "processes":
        from fasttrain.data.torch_pipeline import TorchLoader

        return TorchLoader(cfg, split, training, rank, world_size)
    from fasttrain.data.thread_loader import ThreadLoader

    # A training batch stays valid while batch_stream holds the step's grad_accum_steps micro-batches.
    hold = cfg.grad_accum_steps if training else 1
    return ThreadLoader(cfg, split, training, rank, world_size, hold=hold, reuse_buffers=reuse_buffers)


class SyntheticLoader(EpochPosition):
    """Random uint8 images made once on the device: for pure compute benchmarks, no input cost."""

    normalized = False
    description = "synthetic"

    def __init__(self, cfg: Config, training: bool, rank: int, device: torch.device, batches: int = 100):
        """batches: the epoch's length (the same batch, made once, handed out that many times)."""
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)  # a different batch on each rank
        shape = (cfg.batch_size, cfg.image_size, cfg.image_size, 3)
        self._images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)
        self._labels = torch.randint(0, cfg.num_classes, (cfg.batch_size,), generator=gen).to(device)
        self._batches = batches
        self.num_records = batches * cfg.batch_size

    def __len__(self) -> int:
        return self._batches

    def __iter__(self):
        start = self._begin_epoch()
        for b in range(start, self._batches):
            self._position = b + 1
            yield self._images, self._labels
