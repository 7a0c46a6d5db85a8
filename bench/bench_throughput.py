"""Training-step time of rows (a), (b), (c) of bench/row_steps.py under pytest-benchmark.

    python -m pytest bench/bench_throughput.py --benchmark-only   # --benchmark-json=... keeps numbers

The same step functions `python -m bench.run` measures (fasttrain's TrainStep; eager PyTorch with foreach
optimizer and EMA; plain fp32 NCHW), one step per round after untimed warm-up steps (graph capture on
CUDA), synchronised inside the timed function on CUDA. Defaults are tiny so the CPU runs in seconds:
ResNet-18 at 16 channels, 32 px, batch 4. FASTTRAIN_BENCH_MODEL / _SIZE / _BATCH override them (e.g.
resnet50 / 224 / 256 on a GPU, where base_channels is the standard 64). `extra_info` holds the
environment, the row's setting and images/s (batch / mean step time).
"""

import os

import pytest
import torch

from bench.common import synchronize
from bench.row_steps import RowSpec, build_row
from bench.throughput import input_stream

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MODEL = os.environ.get("FASTTRAIN_BENCH_MODEL", "resnet18")
SIZE = int(os.environ.get("FASTTRAIN_BENCH_SIZE", "32"))
BATCH = int(os.environ.get("FASTTRAIN_BENCH_BATCH", "4"))
WIDTH = 16 if MODEL == "resnet18" and "FASTTRAIN_BENCH_MODEL" not in os.environ else 64


@pytest.mark.parametrize("row", ["a", "b", "c"])
def test_training_step(benchmark, env_info, row):
    spec = RowSpec(row, MODEL, BATCH, SIZE, WIDTH)
    next_batch = input_stream(spec, DEVICE)
    trainer = build_row(spec, DEVICE)

    def step():
        trainer.step(*next_batch())
        synchronize(DEVICE)  # time the device work, not the launch

    for _ in range(2 + trainer.extra_warmup):  # untimed: autotuning, CUDA-graph capture
        step()
    benchmark.pedantic(step, rounds=3 if DEVICE.type == "cpu" else 20, iterations=1)
    benchmark.extra_info.update(env_info)
    benchmark.extra_info.update(trainer.setting, model=MODEL, image_size=SIZE, batch=BATCH)
    benchmark.extra_info["images_per_s"] = BATCH / benchmark.stats.stats.mean
