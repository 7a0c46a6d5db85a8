"""What a 4-channel stem would save: ResNet-50's first convolution with its 3 input channels against the
same with a fourth, zero channel (as NVIDIA's MLPerf ResNet-50 feeds it), forward and backward as a
training step runs them: the weight's gradient only (the images need none).

    python -m pytest bench/bench_stem.py --benchmark-only -s      # on the GPU run: in its kernels step
    FASTTRAIN_BENCH_SMOKE=1 python -m pytest bench --benchmark-only   # CI: tiny, a check that it runs

One call = conv1 (7x7, stride 2, padding 3, 64 filters) forward and backward (the weight's gradient;
until 2026-11-28 the input's too, which no step computes: that version measured 6.147 ms with 3
channels against 4.705 with 4 on an H200, while the whole step gained nothing), at batch 256 and
224 px in the trainer's GPU policy: bf16, channels_last, cudnn.benchmark
on. The two contenders run interleaved, round after round (CUDA events around CALLS calls after warm-up
rounds), so drift hits both alike. A 3-channel channels_last input leaves the convolution's inner
dimension at 3, which tensor-core kernels round up or cannot take; 4 aligns it. The input's fourth
channel and the weight's are zeros, so the output is the 3-channel one's (checked below).

Reported in extra_info: each contender's median ms per call, min and max, and c3 / c4, the time a
4-channel stem would save of each step (the step's other work unchanged), beside the step's time in
the GPU run's rows. On the CPU (no tensor cores, no bf16 convolution kernels to speak of) the numbers
say nothing: the smoke run only checks that it runs.
"""

import os
import statistics

import pytest
import torch
import torch.nn.functional as F

from bench.common import synchronize, timed

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMOKE = os.environ.get("FASTTRAIN_BENCH_SMOKE") == "1"
BATCH, SIZE = (2, 32) if SMOKE or DEVICE.type != "cuda" else (256, 224)
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
CALLS = 10 if DEVICE.type == "cuda" else 1
ROUNDS, WARMUP_ROUNDS = (1, 0) if SMOKE else (20, 3)


def _stem(channels: int):
    """conv1 forward + backward on a `channels`-channel channels_last input (channels 3.. are zero)."""
    gen = torch.Generator().manual_seed(0)
    x3 = torch.randn(BATCH, 3, SIZE, SIZE, generator=gen)
    w3 = torch.randn(64, 3, 7, 7, generator=gen) * 0.05
    x = F.pad(x3, (0, 0, 0, 0, 0, channels - 3)).to(DEVICE, DTYPE)
    w = F.pad(w3, (0, 0, 0, 0, 0, channels - 3)).to(DEVICE, DTYPE)
    x = x.contiguous(memory_format=torch.channels_last)  # images: no gradient, as in the step
    w = w.contiguous(memory_format=torch.channels_last).requires_grad_()
    grad = torch.randn(BATCH, 64, SIZE // 2, SIZE // 2, generator=gen).to(DEVICE, DTYPE)
    grad = grad.contiguous(memory_format=torch.channels_last)

    def call():
        out = F.conv2d(x, w, stride=2, padding=3)
        out.backward(grad)
        return out

    return call


def test_stem_3_against_4_channels(benchmark):
    torch.backends.cudnn.benchmark = True
    contenders = {"c3": _stem(3), "c4": _stem(4)}
    outputs = {name: call().detach().float() for name, call in contenders.items()}  # and the algorithm search
    # The zero channel changes nothing but the layout: the same output, to the kernels' rounding.
    scale = outputs["c3"].abs().max().item()
    assert (outputs["c3"] - outputs["c4"]).abs().max().item() <= 2e-2 * scale
    times = {name: [] for name in contenders}
    for r in range(WARMUP_ROUNDS + ROUNDS):
        for name, call in contenders.items():
            seconds = timed(call, CALLS, DEVICE)
            if r >= WARMUP_ROUNDS:
                times[name].append(seconds / CALLS * 1e3)
    synchronize(DEVICE)
    ms = {name: statistics.median(values) for name, values in times.items()}
    spread = {f"{f.__name__}_ms": {k: f(v) for k, v in times.items()} for f in (min, max)}
    benchmark.extra_info.update(
        device=str(DEVICE), batch=BATCH, image_size=SIZE, dtype=str(DTYPE).replace("torch.", ""),
        rounds=ROUNDS, calls=CALLS, ms=ms, **spread, saved_ms=ms["c3"] - ms["c4"],
        c3_over_c4=ms["c3"] / ms["c4"],
    )  # fmt: skip
    line = ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
    print(f"\nstem conv1 fwd+bwd, batch {BATCH}, {SIZE} px, {DTYPE}: {line}")
    benchmark.pedantic(contenders["c4"], rounds=1, iterations=1)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "--benchmark-only", "-s"]))
