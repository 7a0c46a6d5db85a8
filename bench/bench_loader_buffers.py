"""What build_loader's default costs over the trainer's zero-copy ring: a batch the caller owns.

    python -m pytest bench/bench_loader_buffers.py --benchmark-only   (FASTTRAIN_BENCH_SMOKE=1: seconds)

The torch thread loader (fasttrain/data/thread_loader.py) writes each image straight into its row of
a batch buffer. With reuse_buffers=True (the trainer's) the buffers are a ring allocated once per
epoch; by default each batch gets fresh tensors, which the caller may keep. No copy either way: the
default's extra work is the allocation and the first touch of every page (the kernel's page faults,
paid by the writing threads), unless the allocator hands back pages a dropped batch freed.

buffer_fill   the extra work alone, per batch of BATCH x SIZE x SIZE x 3 uint8 (+ int64 labels):
              `ring` writes every image into one reused buffer; `fresh-dropped` allocates the batch,
              writes it and drops it (a caller using each batch once); `fresh-kept` keeps every batch
              (a caller keeping an epoch: its pages are new each time). One thread, one image written
              per row as the transforms write them. extra_info: us_per_batch.
loader_epoch  the thread loader itself, epochs of real photographs (bench.photo_shards; resnet
              preprocessing, 2 threads, no row checkpoints), the ring against fresh tensors that the
              consumer drops, alternating: median wall and CPU ms per batch of each in extra_info.

Knobs: FASTTRAIN_BENCH_BATCH (32), FASTTRAIN_BENCH_SIZE (224), FASTTRAIN_BENCH_ROUNDS (5).
"""

import os
import statistics
import time

import numpy as np
import pytest
import torch

from bench.photo_shards import cached_photo_shards
from fasttrain.config import make_config
from fasttrain.data import build_loader

SMOKE = os.environ.get("FASTTRAIN_BENCH_SMOKE") == "1"
BATCH = int(os.environ.get("FASTTRAIN_BENCH_BATCH", "32"))
SIZE = int(os.environ.get("FASTTRAIN_BENCH_SIZE", "224"))
ROUNDS = int(os.environ.get("FASTTRAIN_BENCH_ROUNDS", "5"))
BATCHES = 2 if SMOKE else 20  # batches per timed round of buffer_fill


def _fill(images: torch.Tensor, labels: torch.Tensor, image: np.ndarray) -> None:
    out, out_labels = images.numpy(), labels.numpy()
    for i in range(len(out)):
        out[i] = image  # one image's row, as a transform writes it
        out_labels[i] = i


@pytest.mark.parametrize("buffers", ["ring", "fresh-dropped", "fresh-kept"])
def test_buffer_fill(benchmark, env_info, buffers):
    image = np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    ring = (torch.empty((BATCH, SIZE, SIZE, 3), dtype=torch.uint8), torch.empty(BATCH, dtype=torch.int64))

    def batches():
        kept = []
        for _ in range(BATCHES):
            if buffers == "ring":
                images, labels = ring
            else:
                images = torch.empty((BATCH, SIZE, SIZE, 3), dtype=torch.uint8)
                labels = torch.empty(BATCH, dtype=torch.int64)
            _fill(images, labels, image)
            if buffers == "fresh-kept":
                kept.append((images, labels))
        return kept  # freed after the timed call (pytest-benchmark times the call only)

    benchmark.pedantic(batches, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info.update(env_info, batch=BATCH, image_size=SIZE, batches=BATCHES)
    benchmark.extra_info["us_per_batch"] = benchmark.stats.stats.median / BATCHES * 1e6


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Real photographs (bench.photo_shards: skimage's, about 400x350 like ImageNet's; no download)."""
    root = tmp_path_factory.mktemp("bench-buffers")
    images = 2 * BATCH if SMOKE else 256
    cached_photo_shards(root, images=images, records=(2 if SMOKE else 24) * BATCH, shards=2, seed=0)
    return root


def test_loader_epoch(benchmark, env_info, shards):
    """One epoch with the ring, one with fresh tensors, alternating which goes first: the medians of
    each one's wall and CPU (process) ms per batch go into extra_info."""
    cfg = make_config(
        data_dir=str(shards),
        data_cache_dir=str(shards) + "-cache",
        data_backend="torch",
        batch_size=BATCH,
        image_size=SIZE,
        num_classes=1000,
        label_offset=-1,
        num_workers=2,
        shuffle_buffer=64,
        row_checkpoints=False,
    )
    loaders = {
        m: build_loader(cfg, "train", training=True, reuse_buffers=m == "ring") for m in ("ring", "fresh")
    }
    times = {m: [] for m in loaders}
    rounds = iter(range(1_000_000))

    def pair() -> None:
        r = next(rounds)
        for mode in ("ring", "fresh") if r % 2 == 0 else ("fresh", "ring"):
            loader = loaders[mode]
            loader.set_epoch(r)
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in loader:  # each batch dropped once used
                pass
            batches = len(loader)
            times[mode].append(
                ((time.perf_counter() - wall) / batches * 1e3, (time.process_time() - cpu) / batches * 1e3)
            )

    benchmark.pedantic(pair, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info.update(
        env_info, batch=BATCH, image_size=SIZE, threads=2, batches=len(loaders["ring"])
    )
    for mode, values in times.items():
        measured = values[1:]  # the warm-up round's first
        benchmark.extra_info[f"{mode}_wall_ms_per_batch"] = statistics.median(v[0] for v in measured)
        benchmark.extra_info[f"{mode}_cpu_ms_per_batch"] = statistics.median(v[1] for v in measured)
