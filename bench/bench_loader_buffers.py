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
loader_epoch  the thread loader itself, one epoch of synthetic shards (resnet preprocessing, 2
              threads), ring against fresh tensors dropped by the consumer: ms_per_batch in
              extra_info. Decode dominates, so this shows whether the difference is visible at all.

Knobs: FASTTRAIN_BENCH_BATCH (32), FASTTRAIN_BENCH_SIZE (224), FASTTRAIN_BENCH_ROUNDS (5).
"""

import os

import numpy as np
import pytest
import torch

from fasttrain.config import make_config
from fasttrain.data import build_loader
from fasttrain.data.synthetic import make_synthetic

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
    root = tmp_path_factory.mktemp("bench-buffers")
    per_shard = 2 * BATCH if SMOKE else 8 * BATCH
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=per_shard, classes=10, seed=0)
    return root


@pytest.mark.parametrize("reuse_buffers", [True, False], ids=["ring", "fresh"])
def test_loader_epoch(benchmark, env_info, shards, reuse_buffers):
    cfg = make_config(
        data_dir=str(shards),
        data_cache_dir=str(shards) + "-cache",
        data_backend="torch",
        batch_size=BATCH,
        image_size=SIZE,
        num_classes=10,
        label_offset=-1,
        num_workers=2,
        shuffle_buffer=64,
    )
    loader = build_loader(cfg, "train", training=True, reuse_buffers=reuse_buffers)
    epochs = iter(range(1_000_000))

    def epoch() -> int:
        loader.set_epoch(next(epochs))
        return sum(len(labels) for _, labels in loader)  # each batch dropped once used

    benchmark.pedantic(epoch, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info.update(env_info, batch=BATCH, image_size=SIZE, threads=2, batches=len(loader))
    benchmark.extra_info["ms_per_batch"] = benchmark.stats.stats.median / len(loader) * 1e3
