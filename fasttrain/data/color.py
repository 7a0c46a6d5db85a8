"""The Inception seed's colour distortion (image_processing.distort_color), as TensorFlow computes it.

On the resized float32 image x (RGB, nominally [0, 1]), with parameters drawn from the seed's ranges:

    ordering 0: brightness, saturation, hue, contrast      (the seed: thread_id % 2 == 0)
    ordering 1: brightness, contrast, saturation, hue
    brightness  x += d                                     d ~ U[-32/255, 32/255]   (adjust_brightness)
    saturation  per pixel HSV, s = min(1, max(0, s * f))   f ~ U[0.5, 1.5]          (AdjustSaturation)
    hue         per pixel (hue, min, max), h += 6 d mod 6  d ~ U[-0.2, 0.2]         (AdjustHue)
    contrast    x = (x - m) * f + m, m the channel's mean  f ~ U[0.5, 1.5]          (AdjustContrastv2)
    then        x = clip(x, 0, 1)

No clipping between the steps (TensorFlow has none: brightness may push values past 1 before the HSV
steps). The per-pixel conversions are float32 transcriptions of TensorFlow's CPU kernels
(adjust_saturation_op.cc, adjust_hue_op.cc), including their double-precision constants; the channel
means are accumulated in float64 (TF's float32 reduction order differs by about 1e-7 relative).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

_F32 = np.float32
_JIT = dict(nogil=True, cache=True, error_model="numpy")


@dataclass(frozen=True)
class ColorParams:
    """One draw of the seed's distort_color parameters."""

    ordering: int
    brightness: float
    saturation: float
    hue: float
    contrast: float


def sample_color(rng: np.random.Generator) -> ColorParams:
    """The seed's random_brightness / saturation / hue / contrast draws and its ordering coin."""
    ordering = int(rng.integers(0, 2))
    return ColorParams(
        ordering,
        float(_F32(rng.uniform(-32 / 255, 32 / 255))),
        float(_F32(rng.uniform(0.5, 1.5))),
        float(_F32(rng.uniform(-0.2, 0.2))),
        float(_F32(rng.uniform(0.5, 1.5))),
    )


@numba.njit(**_JIT)
def _saturate(r, g, b, factor):
    """AdjustSaturation's per-pixel RGB -> HSV, s *= factor (clamped), HSV -> RGB."""
    v = max(r, max(g, b))
    spread = v - min(r, min(g, b))
    s = spread / v if v > _F32(0) else _F32(0)
    norm = _F32(1) / (_F32(6) * spread)
    if r == v:
        h = norm * (g - b)
    elif g == v:
        h = _F32(np.float64(norm * (b - r)) + 2.0 / 6.0)
    else:
        h = _F32(np.float64(norm * (r - g)) + 4.0 / 6.0)
    if spread <= _F32(0):
        h = _F32(0)
    if h < _F32(0):
        h = h + _F32(1)
    s = min(_F32(1), max(_F32(0), s * factor))
    c = s * v
    m = v - c
    dh = h * _F32(6)
    category = int(dh)
    fmodu = dh
    while fmodu <= _F32(0):
        fmodu += _F32(2)
    while fmodu >= _F32(2):
        fmodu -= _F32(2)
    x = c * (_F32(1) - abs(fmodu - _F32(1)))
    zero = _F32(0)
    if category == 0:
        rr, gg, bb = c, x, zero
    elif category == 1:
        rr, gg, bb = x, c, zero
    elif category == 2:
        rr, gg, bb = zero, c, x
    elif category == 3:
        rr, gg, bb = zero, x, c
    elif category == 4:
        rr, gg, bb = x, zero, c
    elif category == 5:
        rr, gg, bb = c, zero, x
    else:
        rr, gg, bb = zero, zero, zero
    return rr + m, gg + m, bb + m


@numba.njit(**_JIT)
def _shift_hue(r, g, b, delta):
    """AdjustHue's per-pixel (hue in [0, 6), min, max) conversion, hue += 6 delta, and back."""
    if r < g:
        if b < r:
            hi, mid, lo, category = g, r, b, 1
        elif b > g:
            hi, mid, lo, category = b, g, r, 3
        else:
            hi, mid, lo, category = g, b, r, 2
    else:
        if b < g:
            hi, mid, lo, category = r, g, b, 0
        elif b > r:
            hi, mid, lo, category = b, r, g, 4
        else:
            hi, mid, lo, category = r, b, g, 5
    if hi == lo:
        h = _F32(0)
    else:
        ratio = (mid - lo) / (hi - lo)
        h = _F32(category) + (ratio if category % 2 == 0 else _F32(1) - ratio)
    h += delta * _F32(6)
    while h < _F32(0):
        h += _F32(6)
    while h >= _F32(6):
        h -= _F32(6)
    category = int(h)
    ratio = h - _F32(category)
    if category % 2 != 0:
        ratio = _F32(1) - ratio
    mid = lo + ratio * (hi - lo)
    if category == 0:
        return hi, mid, lo
    if category == 1:
        return mid, hi, lo
    if category == 2:
        return lo, hi, mid
    if category == 3:
        return lo, mid, hi
    if category == 4:
        return mid, lo, hi
    return hi, lo, mid


@numba.njit(**_JIT)
def _channel_means(x, brightness):
    total = np.zeros(3)
    for y in range(x.shape[0]):
        for i in range(x.shape[1]):
            for c in range(3):
                total[c] += x[y, i, c] + brightness
    count = x.shape[0] * x.shape[1]
    return _F32(total[0] / count), _F32(total[1] / count), _F32(total[2] / count)


@numba.njit(**_JIT)
def _distort(x, ordering, brightness, saturation, hue, contrast):
    """In place on (H, W, 3) float32: the seed's colour steps in `ordering`, then clip to [0, 1]."""
    h, w = x.shape[0], x.shape[1]
    if ordering == 1:  # contrast runs second: its means are those of the brightened image
        m0, m1, m2 = _channel_means(x, brightness)
    for y in range(h):
        for i in range(w):
            r, g, b = x[y, i, 0] + brightness, x[y, i, 1] + brightness, x[y, i, 2] + brightness
            if ordering == 1:
                r, g, b = (r - m0) * contrast + m0, (g - m1) * contrast + m1, (b - m2) * contrast + m2
            r, g, b = _saturate(r, g, b, saturation)
            x[y, i, 0], x[y, i, 1], x[y, i, 2] = _shift_hue(r, g, b, hue)
    if ordering == 0:  # contrast runs last, on the saturated and hue-shifted image
        m0, m1, m2 = _channel_means(x, _F32(0))
        for y in range(h):
            for i in range(w):
                x[y, i, 0] = (x[y, i, 0] - m0) * contrast + m0
                x[y, i, 1] = (x[y, i, 1] - m1) * contrast + m1
                x[y, i, 2] = (x[y, i, 2] - m2) * contrast + m2
    for y in range(h):
        for i in range(w):
            for c in range(3):
                x[y, i, c] = min(_F32(1), max(_F32(0), x[y, i, c]))


def distort_color(image: np.ndarray, params: ColorParams) -> np.ndarray:
    """The seed's distort_color on (H, W, 3) float32 RGB in [0, 1], in place; returns it."""
    _distort(
        image,
        params.ordering,
        _F32(params.brightness),
        _F32(params.saturation),
        _F32(params.hue),
        _F32(params.contrast),
    )
    return image
