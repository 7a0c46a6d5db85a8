"""On-device normalisation of uint8 NHWC batches into the model's (N, C, H, W) input.

    inception: y = x / 127.5 - 1                     (the seed's [-1, 1] scaling, as x * (1/127.5) - 1)
    resnet:    y = x - mean_c,  mean = (123.68, 116.78, 103.94)   (TF ResNet's _CHANNEL_MEANS, no std)
    vgg:       y = x / 255 - mean_c / 255   (the ResNet seed's vgg_preprocessing: means on the [0, 1] scale)

The NHWC tensor is permuted, not copied, to (N, C, H, W): the result is in torch.channels_last memory
format (the layout the convolutions want) with no layout round trip. The arithmetic is done in float32
and rounded once to `dtype` (uint8 -> bf16 directly would round the scaled value twice).
"""

from __future__ import annotations

import functools

import torch

RESNET_CHANNEL_MEANS = (123.68, 116.78, 103.94)


@functools.cache
def _affine(preprocess: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Cached per device: building the constants every step would be a host-to-device copy each time.
    if preprocess == "inception":
        scale, bias = [1 / 127.5] * 3, [-1.0] * 3
    elif preprocess == "resnet":
        scale, bias = [1.0] * 3, [-m for m in RESNET_CHANNEL_MEANS]
    elif preprocess == "vgg":
        scale, bias = [1 / 255] * 3, [-m / 255 for m in RESNET_CHANNEL_MEANS]
    else:
        raise ValueError(f"unknown preprocess {preprocess!r}; use inception, resnet or vgg")
    shape = (1, 3, 1, 1)
    return (
        torch.tensor(scale, dtype=torch.float32, device=device).view(shape),
        torch.tensor(bias, dtype=torch.float32, device=device).view(shape),
    )


def normalize_images(
    images: torch.Tensor,
    preprocess: str,
    dtype: torch.dtype = torch.float32,
    channels_last: bool = True,
    channels: int = 3,
) -> torch.Tensor:
    """(N, H, W, 3) uint8 on any device -> (N, 3, H, W) `dtype`, channels_last unless told otherwise.

    channels=4: (N, 4, H, W), the fourth channel zero (--pad_stem, fasttrain.models.stem); the first
    three are the 3-channel result's, bit for bit."""
    if images.dim() != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected (N, H, W, 3) images, got shape {tuple(images.shape)}")
    scale, bias = _affine(preprocess, images.device)
    x = images.permute(0, 3, 1, 2)  # (N, C, H, W) view of NHWC memory: channels_last strides
    # Elementwise ops keep the input's channels_last layout (TensorIterator follows the strides).
    if channels != 3:  # the fp32 result rounded once, by the copy into the padded batch
        return pad_channels(torch.addcmul(bias, x.float(), scale), channels, channels_last, dtype)
    y = torch.addcmul(bias, x.float(), scale).to(dtype)
    if not channels_last:
        y = y.contiguous()
    return y


def pad_channels(
    x: torch.Tensor, channels: int, channels_last: bool = True, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """(N, 3, H, W) -> (N, channels, H, W) `dtype` (default x's) with zeros after the 3 (4: --pad_stem),
    in channels_last unless told otherwise: one pass over the batch (at batch 256 and 224 px, 103 MB
    written in bf16; in the whole step on an H200 the 4-channel stem gained nothing, so it is off by
    default: fasttrain.models.stem)."""
    if channels < x.shape[1]:
        raise ValueError(f"cannot pad {x.shape[1]} channels to {channels}")
    n, c, h, w = x.shape
    layout = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((n, channels, h, w), dtype=dtype or x.dtype, device=x.device, memory_format=layout)
    out[:, c:].zero_()
    out[:, :c].copy_(x)
    return out
