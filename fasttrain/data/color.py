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
The clip is TF's clip_by_value (max(0, min(1, x)) in float32; NaN stays NaN in both).

`distort_color(x, params, out)` also does the pipeline's last step, out = round(x * 255) as uint8
(clamped; resize_kernels._round's rounding), in its last pass. Cost (one thread, 299 x 299): about 0.6 ms,
of which the saturation and hue arithmetic (3 divisions and a double round trip per pixel, 8 pixels
per vector instruction) is about 0.4 and the float64 sum of ordering 1's means, a chain of dependent
additions kept in the transcription's order, 0.12.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from fasttrain.data import seeding

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
    pcg = getattr(rng, "pcg", None)  # a loader's PCGGenerator (fasttrain.data.seeding): one kernel
    if pcg is not None:
        return ColorParams(*_sample_color(*pcg, _UNIFORM_LO, _UNIFORM_RANGE))
    ordering = int(rng.integers(0, 2))
    # rng.uniform(lo, hi) is lo + (hi - lo) * rng.random() in float64 (numpy's random_uniform): one
    # call for the four doubles draws the same numbers as four uniform calls, at a third of the cost.
    values = (_UNIFORM_LO + _UNIFORM_RANGE * rng.random(4)).astype(_F32).tolist()
    return ColorParams(ordering, *values)


@numba.njit(cache=True)
def _sample_color(words, buffer, lo, span):
    """sample_color's draws from the PCG64 views as the Generator makes them (fasttrain.data.seeding):
    the same numbers, and the GIL kept (rng.random(4) drops it and takes it back, in a loader thread
    one more wait behind the others per image)."""
    ordering = seeding.integers(words, buffer, 2)
    values = np.empty(4, np.float32)
    for i in range(4):
        values[i] = np.float32(lo[i] + span[i] * seeding.next_double(words))
    return ordering, float(values[0]), float(values[1]), float(values[2]), float(values[3])


# brightness, saturation, hue, contrast; the range is hi - lo in float64, as Generator.uniform takes it
_UNIFORM_LO = np.array([-32 / 255, 0.5, -0.2, 0.5])
_UNIFORM_RANGE = np.array([32 / 255 - -32 / 255, 1.5 - 0.5, 0.2 - -0.2, 1.5 - 0.5])


@numba.njit(**_JIT)
def _saturate(r, g, b, factor):
    """AdjustSaturation's per-pixel RGB -> HSV, s *= factor (clamped), HSV -> RGB (the readable
    transcription; _distort runs _saturate_select, tested equal to it bit for bit)."""
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
    """AdjustHue's per-pixel (hue in [0, 6), min, max) conversion, hue += 6 delta, and back (the
    readable transcription; _distort runs _shift_hue_select, tested equal to it bit for bit)."""
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
def _saturate_select(r, g, b, factor):
    """_saturate with every branch computed and selected: the same float operations, and a form the
    compiler vectorises over a row (8 pixels per instruction instead of one)."""
    zero, one = _F32(0), _F32(1)
    gb = b if g < b else g  # std::max / std::min, as TF calls them
    v = gb if r < gb else r
    gb = b if b < g else g
    low = gb if gb < r else r
    spread = v - low
    ratio = spread / v
    s = ratio if v > zero else zero
    norm = one / (_F32(6) * spread)
    h_r = norm * (g - b)
    h_g = _F32(np.float64(norm * (b - r)) + 2.0 / 6.0)
    h_b = _F32(np.float64(norm * (r - g)) + 4.0 / 6.0)
    h = h_r if r == v else (h_g if g == v else h_b)
    h = zero if spread <= zero else h
    h = h + one if h < zero else h
    s = s * factor
    s = s if zero < s else zero
    s = s if s < one else one
    c = s * v
    m = v - c
    dh = h * _F32(6)
    category = np.int32(dh)
    f = dh + _F32(2) if dh <= zero else dh  # TF's two while loops: dh is in [0, 6]
    f = f - _F32(2) if f >= _F32(2) else f
    f = f - _F32(2) if f >= _F32(2) else f
    f = f - _F32(2) if f >= _F32(2) else f
    u = f - one
    x = c * (one - (u if u >= zero else -u))
    is0, is1, is2 = category == 0, category == 1, category == 2
    is3, is4, is5 = category == 3, category == 4, category == 5
    rr = c if (is0 | is5) else (x if (is1 | is4) else zero)
    gg = c if (is1 | is2) else (x if (is0 | is3) else zero)
    bb = c if (is3 | is4) else (x if (is2 | is5) else zero)
    return rr + m, gg + m, bb + m


@numba.njit(**_JIT)
def _shift_hue_select(r, g, b, delta6):
    """_shift_hue with every branch computed and selected (delta6 = delta * 6, as TF computes it)."""
    one, six = _F32(1), _F32(6)
    rg = r < g
    hi = (b if b > g else g) if rg else (b if b > r else r)
    lo = (b if b < r else r) if rg else (b if b < g else g)
    if rg:
        category = np.int32(1) if b < r else (np.int32(3) if b > g else np.int32(2))
        mid = r if b < r else (g if b > g else b)
    else:
        category = np.int32(0) if b < g else (np.int32(4) if b > r else np.int32(5))
        mid = g if b < g else (r if b > r else b)
    ratio = (mid - lo) / (hi - lo)
    h = _F32(category) + (ratio if category % 2 == 0 else one - ratio)
    h = _F32(0) if hi == lo else h
    h += delta6
    h = h + six if h < _F32(0) else h  # TF's while loops: |delta6| <= 1.2, h in [0, 6)
    h = h - six if h >= six else h
    category = np.int32(h)
    ratio = h - _F32(category)
    ratio = ratio if category % 2 == 0 else one - ratio
    mid = lo + ratio * (hi - lo)
    is0, is1, is2 = category == 0, category == 1, category == 2
    is3, is4, is5 = category == 3, category == 4, category >= 5
    r2 = hi if (is0 | is5) else (mid if (is1 | is4) else lo)
    g2 = hi if (is1 | is2) else (mid if (is0 | is3) else lo)
    b2 = hi if (is3 | is4) else (mid if (is5 | is2) else lo)
    return r2, g2, b2


@numba.njit(**_JIT)
def _saturate_row(red, green, blue, factor):
    for i in range(red.shape[0]):
        r, g, b = _saturate_select(red[i], green[i], blue[i], factor)
        red[i] = r
        green[i] = g
        blue[i] = b


@numba.njit(**_JIT)
def _shift_hue_row(red, green, blue, delta6):
    for i in range(red.shape[0]):
        r, g, b = _shift_hue_select(red[i], green[i], blue[i], delta6)
        red[i] = r
        green[i] = g
        blue[i] = b


@numba.njit(**_JIT)
def _round255(v):
    """v * 255 rounded to the nearest uint8 level, clamped to [0, 255] (resize_kernels._round's rounding)."""
    v = min(max(v * _F32(255) + _F32(0.5), _F32(0)), _F32(255.5))
    return np.uint8(min(np.int32(v), 255))


@numba.njit(**_JIT)
def _clip_store(red, green, blue, line, dst):
    """The clip to [0, 1] of the planar row (TF's clip_by_value: max(0, min(1, x)), NaN kept) into
    the interleaved float32 `line`, and, when dst has values, rounded x 255 into dst too (a
    separate function: inlined, its loops grew _distort past the size at which LLVM still inlined
    and vectorised the colour steps, 6x slower)."""
    zero, one = _F32(0), _F32(1)
    for i in range(red.shape[0]):
        r, g, b = red[i], green[i], blue[i]
        r, g, b = (r if zero < r else zero), (g if zero < g else zero), (b if zero < b else zero)
        red[i], green[i], blue[i] = (r if r < one else one), (g if g < one else one), (b if b < one else one)
    for i in range(red.shape[0]):
        line[3 * i], line[3 * i + 1], line[3 * i + 2] = red[i], green[i], blue[i]
    for k in range(dst.shape[0]):  # contiguous: a vector loop (rounding the planar row is slower)
        dst[k] = _round255(line[k])


@numba.njit(**_JIT)
def _distort(x, ordering, brightness, saturation, hue, contrast, uout):
    """The seed's colour steps in `ordering` on (H, W, 3) float32 x, then the clip to [0, 1], into x;
    and, when uout (H * W * 3) uint8 has values, rounded x 255 into uout in the same pass.

    Two passes over the image, each fusing every per-pixel step it can: contrast needs the channel
    means of its input first. Ordering 1: the means of the brightened image (a sum alone), then per
    row brightness, contrast, saturation, hue, clip and store. Ordering 0: per row brightness,
    saturation and hue back into x, summed as they are written; then contrast, clip and store. The
    per-pixel steps run on planar row buffers allocated here, as loops in this body (LLVM vectorises
    them only where it sees that the buffers do not overlap: measured 6x slower as calls); the
    float64 sums keep the transcription's order (pixel order per channel), so the means are those of
    the unfused steps.
    """
    h, w = x.shape[0], x.shape[1]
    n = 3 * w
    red, green, blue = np.empty(w, np.float32), np.empty(w, np.float32), np.empty(w, np.float32)
    delta6 = hue * _F32(6)
    count = h * w
    flat = x.reshape(h, n)
    rounding = uout.shape[0] > 0
    levels = uout.reshape(h, n) if rounding else np.empty((0, n), np.uint8)
    t0 = t1 = t2 = 0.0
    if ordering == 1:  # contrast runs second: its means are those of the brightened image
        for y in range(h):
            line = flat[y]
            for i in range(w):
                t0 += line[3 * i] + brightness
                t1 += line[3 * i + 1] + brightness
                t2 += line[3 * i + 2] + brightness
    m0, m1, m2 = _F32(t0 / count), _F32(t1 / count), _F32(t2 / count)
    t0 = t1 = t2 = 0.0
    for y in range(h):
        line = flat[y]
        for i in range(w):
            red[i] = line[3 * i] + brightness
            green[i] = line[3 * i + 1] + brightness
            blue[i] = line[3 * i + 2] + brightness
        if ordering == 1:
            for i in range(w):
                red[i] = (red[i] - m0) * contrast + m0
                green[i] = (green[i] - m1) * contrast + m1
                blue[i] = (blue[i] - m2) * contrast + m2
        _saturate_row(red, green, blue, saturation)
        _shift_hue_row(red, green, blue, delta6)
        if ordering == 0:  # back into x for the contrast pass, summed in pixel order per channel
            for i in range(w):
                line[3 * i], line[3 * i + 1], line[3 * i + 2] = red[i], green[i], blue[i]
            for i in range(w):
                t0 += red[i]
                t1 += green[i]
                t2 += blue[i]
            continue
        _clip_store(red, green, blue, line, levels[y] if rounding else levels[0:0].reshape(-1))
    if ordering == 0:  # contrast runs last, on the saturated and hue-shifted image
        m0, m1, m2 = _F32(t0 / count), _F32(t1 / count), _F32(t2 / count)
        for y in range(h):
            line = flat[y]
            for i in range(w):
                red[i] = (line[3 * i] - m0) * contrast + m0
                green[i] = (line[3 * i + 1] - m1) * contrast + m1
                blue[i] = (line[3 * i + 2] - m2) * contrast + m2
            _clip_store(red, green, blue, line, levels[y] if rounding else levels[0:0].reshape(-1))


_NO_LEVELS = np.empty(0, np.uint8)


def distort_color(image: np.ndarray, params: ColorParams, out: np.ndarray | None = None) -> np.ndarray:
    """The seed's distort_color on (H, W, 3) float32 RGB in [0, 1], in place; returns it.

    out: an optional C-contiguous (H, W, 3) uint8 array that also receives the result x 255 rounded
    to the nearest level (fused into the last pass); returns out.
    """
    if not image.flags.c_contiguous or image.dtype != np.float32 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"distort_color takes a C-contiguous (H, W, 3) float32 image, got {image.shape}")
    if out is not None and (out.shape != image.shape or out.dtype != np.uint8 or not out.flags.c_contiguous):
        raise ValueError(f"out must be a C-contiguous {image.shape} uint8 array")
    _distort(
        image,
        params.ordering,
        _F32(params.brightness),
        _F32(params.saturation),
        _F32(params.hue),
        _F32(params.contrast),
        _NO_LEVELS if out is None else out.reshape(-1),
    )
    return image if out is None else out


def warm_up() -> None:
    """Compile (or load from numba's disk cache) distort_color's kernels: both orderings, float32 and
    rounded uint8 out."""
    for ordering in (0, 1):
        for out in (None, np.empty((2, 2, 3), np.uint8)):
            distort_color(np.zeros((2, 2, 3), np.float32), ColorParams(ordering, 0.0, 1.0, 0.0, 1.0), out)
