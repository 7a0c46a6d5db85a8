"""MFU's two halves: the device's measured matmul rate and training FLOPs per image.

    matmul_rate(device):   bf16 (n x n) @ (n x n), 2 n^3 FLOP per product; n = 8192 on CUDA, 512 on
                           the CPU. The denominator of MFU (a measured rate, not the data sheet's).
    training_flops(model, size): forward + backward FLOPs per image, counted by
                           torch.utils.flop_counter on the meta device (matmuls and convolutions,
                           2 FLOP per multiply-add), and DESIGN.md's nominal figures scaled by area:

        ResNet-50 24.5 GFLOP, ResNet-101 46.8 GFLOP at 224 px; Inception v3 34.3 GFLOP at 299 px
        nominal(size) = nominal * (size / base)^2

MFU = images/s x FLOP per image / matmul rate, with the nominal figure where there is one and the
count otherwise (the smoke run's ResNet-18 at 16 channels). Both are recorded.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from bench.common import timed
from fasttrain.models import create_model

NOMINAL_GFLOP = {"resnet50": (24.5, 224), "resnet101": (46.8, 224), "inception_v3": (34.3, 299)}


def matmul_rate(device: torch.device, n: int | None = None, calls: int | None = None) -> dict:
    """Measured bf16 matmul TFLOP/s (median of 3 windows)."""
    n = n or (8192 if device.type == "cuda" else 512)
    calls = calls or (20 if device.type == "cuda" else 3)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    fn = lambda: torch.mm(a, b, out=out)
    timed(fn, 3, device)  # warm-up: cuBLAS heuristics, clocks
    seconds = statistics.median(timed(fn, calls, device) for _ in range(3)) / calls
    return dict(dtype="bfloat16", n=n, tflop_per_s=2 * n**3 / seconds / 1e12)


def counted_training_flops(model_name: str, image_size: int, base_channels: int = 64) -> float:
    """Forward + backward FLOPs per image of a training step (aux head included), counted."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = create_model(model_name, 1000, base_channels=base_channels).train()
        x = torch.empty(2, 3, image_size, image_size)
        y = torch.zeros(2, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        out = model(x)
        logits, aux = out if isinstance(out, tuple) else (out, None)
        loss = F.cross_entropy(logits, y)
        if aux is not None:
            loss = loss + F.cross_entropy(aux, y)
        loss.backward()
    return counter.get_total_flops() / 2


def training_flops(model_name: str, image_size: int, base_channels: int = 64) -> dict:
    """{'counted': FLOP, 'nominal': FLOP or None, 'used': FLOP, 'source': str} per image."""
    counted = counted_training_flops(model_name, image_size, base_channels)
    nominal = None
    if model_name in NOMINAL_GFLOP and base_channels == 64:
        gflop, base = NOMINAL_GFLOP[model_name]
        nominal = gflop * 1e9 * (image_size / base) ** 2
    return dict(
        counted=counted,
        nominal=nominal,
        used=nominal if nominal is not None else counted,
        source="DESIGN.md nominal, scaled by area" if nominal is not None else "counted (flop_counter)",
    )
