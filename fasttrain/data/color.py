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
    v = rgb.max(axis=-1)
    chroma = v - rgb.min(axis=-1)
    safe = np.where(chroma > 0, chroma, 1)
    s = np.where(v > 0, chroma / np.where(v > 0, v, 1), 0)
    h = np.where(v == r, (g - b) / safe, np.where(v == g, (b - r) / safe + 2, (r - g) / safe + 4))
    h = np.where(chroma > 0, (h / 6) % 1.0, 0)
    return np.stack([h, s, v], axis=-1).astype(rgb.dtype, copy=False)


def hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
    """(..., 3) HSV (hue in [0, 1)) -> (..., 3) RGB."""
    h, s, v = hsv[..., 0], hsv[..., 1], hsv[..., 2]
    h6 = (h % 1.0) * 6
    sector = np.floor(h6).astype(np.int64) % 6
    f = h6 - np.floor(h6)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    # Per sector: (r, g, b) = (v,t,p) (q,v,p) (p,v,t) (p,q,v) (t,p,v) (v,p,q).
    choices = np.stack([v, q, p, p, t, v, t, v, v, q, p, p, p, p, t, v, v, q]).reshape(3, 6, *h.shape)
    rgb = np.take_along_axis(choices, sector[None, None], axis=1)[:, 0]
    return np.moveaxis(rgb, 0, -1)


def _saturation_hue(x: np.ndarray, saturation: float, hue_delta: float) -> np.ndarray:
    hsv = rgb_to_hsv(np.clip(x, 0, 1))
    hsv[..., 1] = np.clip(hsv[..., 1] * saturation, 0, 1)
    hsv[..., 0] = (hsv[..., 0] + hue_delta) % 1.0
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
