"""The Inception seed's colour distortion (image_processing.distort_color) in NumPy.

On an RGB image x in [0, 1] (float32), with the seed's two orderings (thread_id % 2 there, a fair coin
here):

    ordering 0: brightness, saturation, hue, contrast
    ordering 1: brightness, contrast, saturation, hue
    brightness:  x += d,                      d ~ U[-32/255, 32/255]
    saturation:  (h, s, v) = hsv(x);  s = clip(s * f, 0, 1),   f ~ U[0.5, 1.5]
    hue:         (h, s, v) = hsv(x);  h = (h + d) mod 1,         d ~ U[-0.2, 0.2]
    contrast:    x = (x - mean_c) * f + mean_c,  mean over the pixels of each channel, f ~ U[0.5, 1.5]
    finally      x = clip(x, 0, 1)

Saturation and hue are adjacent in both orderings and commute in HSV space, so one RGB->HSV->RGB
round trip does both. One deviation: x is clipped to [0, 1] before the HSV conversion (TensorFlow's HSV
of out-of-range values after the brightness step is not meaningful colour either).
"""

from __future__ import annotations

import numpy as np


def rgb_to_hsv(rgb: np.ndarray) -> np.ndarray:
    """(..., 3) RGB in [0, 1] -> (..., 3) HSV with hue in [0, 1)."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    v = np.maximum(np.maximum(r, g), b)
    chroma = v - np.minimum(np.minimum(r, g), b)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(v > 0, chroma / v, 0)
        inv = np.where(chroma > 0, 1 / chroma, 0)  # grey: hue 0
    # Sextant offsets 0 (red is max), 2 (green), 4 (blue); hue/6 lies in [-1/6, 5/6): wrap the negatives.
    h = np.where(v == r, (g - b) * inv, np.where(v == g, (b - r) * inv + 2, (r - g) * inv + 4))
    h *= 1 / 6
    h += h < 0
    return np.stack([h, s, v], axis=-1).astype(rgb.dtype, copy=False)


def hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
    """(..., 3) HSV (hue in [0, 1)) -> (..., 3) RGB: channel n in (5, 3, 1) for (r, g, b) is
    v - v s clip(min(k, 4 - k), 0, 1) with k = (6 h + n) mod 6."""
    h6, s, v = hsv[..., 0] * 6, hsv[..., 1], hsv[..., 2]
    vs = v * s
    out = np.empty_like(hsv)
    for channel, n in enumerate((5.0, 3.0, 1.0)):
        k = (h6 + n) % 6
        out[..., channel] = v - vs * np.clip(np.minimum(k, 4 - k), 0, 1)
    return out


def _saturation_hue(x: np.ndarray, saturation: float, hue_delta: float) -> np.ndarray:
    hsv = rgb_to_hsv(np.clip(x, 0, 1))
    hsv[..., 1] = np.clip(hsv[..., 1] * saturation, 0, 1)
    hsv[..., 0] += hue_delta  # hsv_to_rgb takes the hue mod 1
    return hsv_to_rgb(hsv)


def _contrast(x: np.ndarray, factor: float) -> np.ndarray:
    mean = x.mean(axis=(0, 1), keepdims=True)
    return (x - mean) * np.float32(factor) + mean


def distort_color(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(H, W, 3) uint8 -> (H, W, 3) uint8 with the seed's random colour distortion."""
    ordering = int(rng.integers(0, 2))
    brightness = np.float32(rng.uniform(-32 / 255, 32 / 255))
    saturation = rng.uniform(0.5, 1.5)
    hue = rng.uniform(-0.2, 0.2)
    contrast = rng.uniform(0.5, 1.5)
    x = image.astype(np.float32) * np.float32(1 / 255) + brightness
    if ordering == 0:
        x = _contrast(_saturation_hue(x, saturation, hue), contrast)
    else:
        x = _saturation_hue(_contrast(x, contrast), saturation, hue)
    return np.rint(np.clip(x, 0, 1) * 255).astype(np.uint8)
