"""Input pipeline throughput: DALI (CPU-only mode, and mixed nvJPEG decode on a GPU) vs the torch pipeline.

    python -m pytest bench/bench_dali.py --benchmark-only    # add --benchmark-json=... to keep numbers

Each test times whole training epochs of one rank (train transform: distorted-box crop, resize, flip,
Inception colour distortion for the inception case) after one untimed epoch, and reports images/s in
`extra_info` with the environment. An epoch includes what a real one pays: the DALI pipeline is built
per epoch, the torch DataLoader starts its workers per epoch. Both get the same CPU parallelism:
FASTTRAIN_BENCH_WORKERS DALI threads or DataLoader worker processes (default 2, the CI machine's cores).
On a CUDA device the mixed-decode test synchronises before the timer stops.

Data: a synthetic ImageNet-layout set (48..160 px JPEGs, so far smaller than ImageNet's ~400 x 350
average; per-image costs on real data are several times higher) unless FASTTRAIN_BENCH_DATA points at
real shards. FASTTRAIN_BENCH_SIZE (default 64) and FASTTRAIN_BENCH_BATCH (default 32) set the output
side and batch (224 / 256 for ResNet-50 numbers on a GPU).
"""

import os

import pytest
import torch

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed")

from bench.common import synchronize  # noqa: E402
from fasttrain.config import make_config  # noqa: E402
from fasttrain.data import build_loader  # noqa: E402
from fasttrain.data.dali_pipeline import DaliLoader  # noqa: E402
from fasttrain.data.synthetic import make_synthetic  # noqa: E402

WORKERS = int(os.environ.get("FASTTRAIN_BENCH_WORKERS", "2"))
SIZE = int(os.environ.get("FASTTRAIN_BENCH_SIZE", "64"))
BATCH = int(os.environ.get("FASTTRAIN_BENCH_BATCH", "32"))
RECIPES = {"inception": dict(preprocess="inception", color_distort=True), "resnet": dict(preprocess="resnet")}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    if os.environ.get("FASTTRAIN_BENCH_DATA"):
        return os.environ["FASTTRAIN_BENCH_DATA"]
    root = tmp_path_factory.mktemp("bench-data")
    make_synthetic(root, train_shards=4, val_shards=1, per_shard=96, classes=10, seed=0)
    return str(root)


def _cfg(data_dir, recipe: str, backend: str):
    return make_config(
        data_backend=backend,
        data_dir=data_dir,
        batch_size=BATCH,
        image_size=SIZE,
        num_workers=WORKERS,
        num_classes=1001,
        label_offset=0,
        data_cache_dir=os.path.join(str(data_dir), ".cache")
        if not os.environ.get("FASTTRAIN_BENCH_DATA")
        else "",
        **RECIPES[recipe],
    )


def _measure(benchmark, env_info, loader, device: torch.device) -> None:
    """Time whole epochs of `loader` (one untimed first) and record images per second."""
    epochs = iter(range(1_000_000))

    def epoch() -> int:
        loader.set_epoch(next(epochs))
        images = sum(len(labels) for _, labels in loader)
        synchronize(device)  # the batches' device work is part of the epoch
        return images

    per_epoch = epoch()  # warm-up: page cache, decoder and allocator set-up
    benchmark.pedantic(epoch, rounds=3, iterations=1)
    benchmark.extra_info.update(env_info, workers=WORKERS, image_size=SIZE, batch=BATCH)
    benchmark.extra_info["data"] = os.environ.get("FASTTRAIN_BENCH_DATA", "synthetic")
    benchmark.extra_info["images_per_epoch"] = per_epoch
    benchmark.extra_info["images_per_sec"] = per_epoch / benchmark.stats.stats.mean


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_dali_cpu_train_images_per_second(benchmark, env_info, data_dir, recipe):
    cpu = torch.device("cpu")  # DALI's CPU-only mode
    loader = build_loader(_cfg(data_dir, recipe, "dali"), split="train", training=True, device=cpu)
    _measure(benchmark, env_info, loader, cpu)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_torch_train_images_per_second(benchmark, env_info, data_dir, recipe):
    cpu = torch.device("cpu")
    cfg = _cfg(data_dir, recipe, "torch")
    loader = build_loader(cfg, split="train", training=True, device=cpu, reuse_buffers=True)  # the trainer's
    _measure(benchmark, env_info, loader, cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_dali_mixed_decode_train_images_per_second(benchmark, env_info, data_dir, recipe):
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = _cfg(data_dir, recipe, "dali")
    loader = DaliLoader(cfg, split="train", training=True, device=device, dtype=torch.float16)
    _measure(benchmark, env_info, loader, device)
