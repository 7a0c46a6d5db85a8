"""fasttrain.data.resize's kernels (fasttrain/data/resize_kernels.py) against a float64 transcription of
TF1's resize_images equations (resize.py's docstring's), on the cases the TensorFlow fixtures do not
cover: odd and tiny sizes, up- and down-scaling, flips, mirrored and strided inputs, grayscale expanded
to RGB (a zero channel stride), float32 inputs, and the uint8 output that rounds inside the kernel. And
the colour distortion's fused rounding store. (tests/test_transforms_tf.py compares the pipelines with
TensorFlow's own images.)

The transcription computes the source positions as TF does, in float32 (which source cells an output
reads is part of the equations), and everything after in float64, as per-axis weight matrices.
"""

import numpy as np
import pytest

from fasttrain.data.color import ColorParams, distort_color
from fasttrain.data.resize import METHODS, resize

F32 = np.float32


def _positions(out_size: int, in_size: int) -> np.ndarray:
    """TF's float32 source coordinate o * scale of each output index o."""
    return np.arange(out_size, dtype=F32) * (F32(in_size) / F32(out_size))


def _weights(method: str, out_size: int, in_size: int) -> np.ndarray:
    """(out_size, in_size) float64 matrix of one axis of TF1's resize (align_corners=False)."""
    w = np.zeros((out_size, in_size))
    scale = F32(in_size) / F32(out_size)
    for o, s in enumerate(_positions(out_size, in_size)):
        s64 = float(s)
        if method == "bilinear":
            lo, hi = max(int(np.floor(s)), 0), min(int(np.ceil(s)), in_size - 1)
            t = s64 - np.floor(s64)
            w[o, lo] += 1 - t
            w[o, hi] += t
        elif method == "nearest":
            w[o, min(int(np.floor(s)), in_size - 1)] = 1
        elif method == "bicubic":  # Keys a = -0.75 at TF's 1/1024-quantised fraction
            base = int(np.floor(s))
            t = int(np.rint(F32(s - F32(base)) * F32(1024))) / 1024
            for k, d in enumerate((1 + t, t, 1 - t, 2 - t)):
                a = -0.75
                d = abs(d)
                c = (
                    ((a + 2) * d - (a + 3)) * d * d + 1
                    if d < 1
                    else ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
                )
                w[o, min(in_size - 1, max(0, base - 1 + k))] += c
        else:  # area: each cell's overlap with [o * scale, (o + 1) * scale), over the scale
            lo, hi = float(s), float(F32(o + 1) * scale)
            for i in range(int(np.floor(lo)), int(np.ceil(hi))):
                w[o, min(in_size - 1, max(0, i))] += (min(i + 1, hi) - max(i, lo)) / float(scale)
    return w


def _reference(image: np.ndarray, out_h: int, out_w: int, method: str, in_scale: float, flip: bool):
    x = image.astype(np.float64) * float(F32(in_scale))
    wy, wx = _weights(method, out_h, image.shape[0]), _weights(method, out_w, image.shape[1])
    out = np.einsum("oh,hwc,pw->opc", wy, x, wx)
    return out[:, ::-1] if flip else out


def _image(rng, kind: str, height: int, width: int) -> np.ndarray:
    """A smooth-plus-noise uint8 image as the pipelines pass it: a crop view, its mirror, grayscale
    broadcast to 3 channels (stride 0), or a float32 copy."""
    base = rng.integers(0, 256, (height + 4, width + 6, 3)).astype(np.uint8)
    crop = base[2 : 2 + height, 3 : 3 + width]
    if kind == "mirrored":
        return crop[:, ::-1]
    if kind == "gray":
        return np.broadcast_to(base[2 : 2 + height, 3 : 3 + width, :1], (height, width, 3))
    if kind == "float32":
        return crop.astype(np.float32) / F32(255)
    return crop


# (in_h, in_w, out_h, out_w): tiny, odd, upscaling, downscaling by up to ~13x, mixed
SIZES = [(1, 1, 3, 2), (2, 3, 1, 1), (5, 7, 11, 13), (17, 29, 7, 5), (64, 48, 31, 97), (131, 90, 10, 9)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["crop", "mirrored", "gray", "float32"])
def test_resize_matches_the_float64_transcription(method, kind):
    rng = np.random.default_rng([METHODS.index(method), len(kind)])
    for in_h, in_w, out_h, out_w in SIZES:
        image = _image(rng, kind, in_h, in_w)
        in_scale = 1.0 if kind == "float32" else 1 / 255
        for flip in (False, True):
            ref = _reference(image, out_h, out_w, method, in_scale, flip)
            # float32 arithmetic against float64: a few roundings of values <= ~1.2 per tap and per
            # term (area sums up to ~15 terms per axis here), each at most 2^-24 relative.
            tol = 2e-6 * (1 + in_h / out_h) * (1 + in_w / out_w)
            ours = resize(image, np.empty((out_h, out_w, 3), np.float32), method, in_scale, flip)
            np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)
            levels = resize(
                image, np.empty((out_h, out_w, 3), np.uint8), method, in_scale, flip, multiplier=255
            )
            # the kernel rounds its own float32 value: the nearest level to the exact result, or,
            # within the float error of a half level, the other one
            target = np.clip(ref * 255, 0, 255)
            assert np.abs(levels - target).max() <= 0.5 + 255 * tol, (in_h, in_w, flip)
            exact = np.abs(np.abs(target - np.floor(target)) - 0.5) > 255 * tol
            np.testing.assert_array_equal(levels[exact], np.floor(target[exact] + 0.5))


def test_nearest_is_the_exact_gather():
    rng = np.random.default_rng(5)
    image = rng.integers(0, 256, (23, 37, 3)).astype(np.uint8)
    ours = resize(image, np.empty((50, 9, 3), np.float32), "nearest", 1 / 255, flip=True)
    rows = np.minimum(np.floor(_positions(50, 23)).astype(int), 22)
    cols = np.minimum(np.floor(_positions(9, 37)).astype(int), 36)
    expected = image[rows][:, cols].astype(F32) * F32(1 / 255)
    np.testing.assert_array_equal(ours, expected[:, ::-1])


def test_bilinear_window_of_a_mirrored_image_into_uint8():
    # the ResNet eval window (full_size / offset) and the ResNet train mirror, rounded in the kernel
    rng = np.random.default_rng(6)
    image = rng.integers(0, 256, (45, 61, 3)).astype(np.uint8)[:, ::-1]
    full = _reference(image, 70, 90, "bilinear", 1.0, False)
    levels = resize(image, np.empty((20, 30, 3), np.uint8), "bilinear", full_size=(70, 90), offset=(9, 31))
    window = full[9:29, 31:61]
    assert np.abs(levels - window).max() <= 0.5 + 1e-3  # values <= 255: float32 error < 1e-4


def test_non_contiguous_output_is_written():
    image = np.random.default_rng(7).integers(0, 256, (12, 14, 3)).astype(np.uint8)
    for dtype in (np.float32, np.uint8):
        backing = np.zeros((9, 16, 3), dtype)
        out = backing[:, 2:12]
        expected = resize(image, np.empty((9, 10, 3), dtype), "area")
        resize(image, out, "area")
        np.testing.assert_array_equal(out, expected)
        assert not backing[:, :2].any() and not backing[:, 12:].any()


@pytest.mark.parametrize("ordering", [0, 1])
def test_colour_rounding_store_is_the_float_result_rounded(ordering):
    # distort_color(out=uint8) rounds x 255 in its last pass; the float path's values, rounded here in
    # float64 (a float32 value times 255 is exact in float64 up to the half-level ties float32 rounds).
    rng = np.random.default_rng(8 + ordering)
    for height, width in [(1, 1), (7, 3), (33, 65)]:
        x = rng.uniform(-0.05, 1.05, (height, width, 3)).astype(np.float32)
        params = ColorParams(ordering, 0.07, 1.3, -0.11, 0.6)
        floats = distort_color(x.copy(), params)
        image = x.copy()
        levels = distort_color(image, params, np.empty((height, width, 3), np.uint8))
        np.testing.assert_array_equal(image, floats)  # the image holds the float result too
        target = floats.astype(np.float64) * 255
        assert np.abs(levels - target).max() <= 0.5 + 1e-4
        exact = np.abs(np.abs(target - np.floor(target)) - 0.5) > 1e-4
        np.testing.assert_array_equal(levels[exact], np.floor(target[exact] + 0.5))


def test_distort_color_rejects_a_bad_out():
    x = np.zeros((4, 5, 3), np.float32)
    with pytest.raises(ValueError, match="out must be a C-contiguous"):
        distort_color(x, ColorParams(0, 0.0, 1.0, 0.0, 1.0), np.empty((4, 5, 3), np.float32))


def test_resize_rejects_an_out_it_cannot_write():
    image = np.zeros((4, 5, 3), np.uint8)
    with pytest.raises(ValueError, match="float32 or uint8 out"):
        resize(image, np.empty((2, 2, 3), np.float64))
    with pytest.raises(ValueError, match="float32 or uint8 out"):
        resize(image, np.empty((2, 2), np.float32))
