"""Model compute: forward + backward time per image, fp32, so a regression in a model is visible.

    python -m pytest bench/bench_models.py --benchmark-only    # add --benchmark-json=... to keep numbers

Each test times one training-style pass (forward, cross-entropy, backward; no optimizer step) of a
fixed batch, after one untimed warm-up pass (allocator and oneDNN primitive caches). On a CUDA device
the timed function synchronises before returning. `extra_info` records the environment and the
per-image time (mean / batch). Sizes are the demo's scale so the CPU runs in seconds: ResNet-18/50
at 64 px, batch 8, standard widths (base_channels 64) and channels_last off (the CPU default).

FASTTRAIN_BENCH_SIZE / FASTTRAIN_BENCH_BATCH override the image side and batch (e.g. 224 / 64 on a GPU).
"""

import os

import pytest
import torch
import torch.nn.functional as F

from bench.common import synchronize
from fasttrain.models import create_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SIZE = int(os.environ.get("FASTTRAIN_BENCH_SIZE", "64"))
BATCH = int(os.environ.get("FASTTRAIN_BENCH_BATCH", "8"))


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_forward_backward_per_image(benchmark, env_info, name):
    torch.manual_seed(0)
    model = create_model(name, 1000).to(DEVICE).train()
    x = torch.randn(BATCH, 3, SIZE, SIZE, device=DEVICE)
    y = torch.randint(0, 1000, (BATCH,), device=DEVICE)

    def step():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        synchronize(DEVICE)  # time the device work, not the launch

    step()  # warm-up, not timed
    benchmark.pedantic(step, rounds=5, iterations=1)
    benchmark.extra_info.update(env_info, image_size=SIZE, batch=BATCH)
    benchmark.extra_info["ms_per_image"] = 1e3 * benchmark.stats.stats.mean / BATCH
