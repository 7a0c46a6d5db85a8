"""The first convolution of every model, which takes its 3-channel images with a fourth, zero channel
as well (--pad_stem).

A channels_last image batch with 3 channels leaves the first convolution's innermost dimension at 3
(6 bytes a pixel in bf16), which cuDNN's tensor-core kernels must round up or cannot take; with a
fourth channel of zeros each pixel is 8 bytes and the convolution runs on those kernels (NVIDIA's
MLPerf ResNet-50 feeds its stem the same way). Measured on ResNet-50's conv1 alone, forward and
backward, bf16, batch 256, channels_last, on an H200: 6.147 ms with 3 channels, 4.705 ms with 4
(bench/bench_stem.py, bench/results/2026-11-27-h200-second-run/); but that backward computed the
images' gradient, which no training step does, and in the whole step it gained nothing (ResNet-50
bf16 batch 256 6,705 img/s with it, 6,708 without; bench/results/2026-11-28-h200-third-run/). So
--pad_stem is off by default; this module is what it runs when asked for.

`StemConv2d` is an `nn.Conv2d` with 3 input channels: its weight, its state_dict key and the TF
checkpoint it maps to stay (out, 3, kh, kw). Given 4 channels, it convolves with its weight padded by
a zero input channel (a (out, 4, kh, kw) tensor made in the forward, so the gradient of the real
weight is the padded one's first 3 channels); the fourth channel of the input must be zero, and then
the output is the 3-channel convolution's, up to the order of the summation. The step and the
evaluator build that input (fasttrain.step.model_input: fasttrain.data.normalize.normalize_images
with channels=4); the model still takes 3 channels as before (export, a caller's own batches).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_CHANNELS = 3
PADDED_CHANNELS = 4


class StemConv2d(nn.Conv2d):
    """nn.Conv2d over 3 image channels that also takes them as 4, the fourth zero (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = x.shape[1] - self.in_channels
        if extra == 0:
            return super().forward(x)
        if extra != PADDED_CHANNELS - IMAGE_CHANNELS or self.groups != 1:
            raise ValueError(
                f"the first convolution takes {self.in_channels} channels, or {self.in_channels + 1} with "
                f"the last one zero; got {x.shape[1]}"
            )
        # F.pad's last pair pads dim 1 (input channels) of (out, in, kh, kw); it keeps channels_last.
        weight = F.pad(self.weight, (0, 0, 0, 0, 0, 1))
        return self._conv_forward(x, weight, self.bias)
