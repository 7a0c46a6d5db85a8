"""TensorFlow 1.x `tf.image.resize_images` (align_corners=False), transcribed for NumPy images.

The seeds resize with TF1's kernels, which are not what Pillow, OpenCV or torch compute: no half-pixel
offset, no antialiasing when shrinking. For an output of size (S_h, S_w) from an input of (H, W), per
axis (float32, as TF: `scale = float(H) / float(S_h)`):

    bilinear  src = y * scale; y0 = floor(src); y1 = min(ceil(src), H - 1); t = src - y0
              top = tl + (tr - tl) * tx;  bottom = bl + (br - bl) * tx;  out = top + (bottom - top) * ty
    nearest   out = in[min(floor(y * scale), H - 1)]
    bicubic   Keys cubic with a = -0.75 at src = y * scale; taps floor(src) - 1 .. floor(src) + 2 clamped
              to the image; weights from a 1025-entry table indexed by lrintf(frac * 1024); columns
              interpolated vertically first, then the four column values horizontally
    area      out = sum over input cells of value * overlap(cell, [y * scale, (y + 1) * scale)) per
              axis, times 1 / (scale_h * scale_w); cells past the edge are clamped to it

Every kernel reads uint8 or float32 (H, W, 3) arrays of any strides (a crop is a view, a left-right flip
a view with a negative stride), multiplies each input value by `in_scale` (1/255 reproduces
`convert_image_dtype`, which the Inception seed applies before resizing) and writes float32 into `out`
(S_h, S_w, 3), or, when `out` is uint8, the float32 result times `multiplier` rounded to the nearest level
and clamped to [0, 255] (`_round`, fused into the kernel's last pass: no float image in between). The
arithmetic is float32 in TF's order of operations, so the outputs equal TF's up to the compiler's
choices (tests/test_transforms_tf.py compares them with TensorFlow's own).

The kernels, one per method, are fasttrain/data/resize_kernels.py (how they save work, and what they
cost, in its docstring), compiled by numba on first use (about 1 s each, then cached on disk).
"""

from __future__ import annotations

import numpy as np

from fasttrain.data.resize_kernels import _F32, _area, _bicubic, _bilinear, _nearest

METHODS = ("bilinear", "nearest", "bicubic", "area")
_NO_FLOATS = np.empty((0, 0), np.float32)  # the output a kernel does not write (it has no rows)
_NO_LEVELS = np.empty((0, 0), np.uint8)


def _flat_rows(image: np.ndarray) -> tuple[np.ndarray, bool]:
    """(rows, mirrored): `image` as (H, W * 3) rows, read right to left when mirrored. No copy for a
    crop of a C-contiguous image or its left-right flip (what the pipelines pass): the rows then keep
    the image's row stride."""
    mirrored = image.strides[1] < 0
    if mirrored:
        image = image[:, ::-1]
    if image.strides[2] != image.itemsize or image.strides[1] != 3 * image.itemsize:
        image = np.ascontiguousarray(image)
    return image.reshape(image.shape[0], -1), mirrored


_KERNELS = {"nearest": _nearest, "bicubic": _bicubic, "area": _area}


def resize(
    image: np.ndarray,
    out: np.ndarray,
    method: str = "bilinear",
    in_scale: float = 1.0,
    flip: bool = False,
    full_size: tuple[int, int] | None = None,
    offset: tuple[int, int] = (0, 0),
    multiplier: float = 1.0,
) -> np.ndarray:
    """TF1 resize_images(image * in_scale, out.shape[:2], method, align_corners=False) into `out`.

    flip: write the result mirrored left-right (flip_left_right after the resize, at no cost).
    image: (H, W, 3) uint8 or float32, any strides; out: (S_h, S_w, 3) float32, or uint8 to receive
    the float32 result times `multiplier` rounded to the nearest level (clamped to [0, 255]).
    full_size / offset (bilinear only): compute just the out-sized window at `offset` (top, left) of
    the resize to full_size, the same pixels as resizing to full_size and slicing.
    """
    if image.ndim != 3 or image.shape[2] != 3 or image.shape[0] < 1 or image.shape[1] < 1:
        raise ValueError(f"resize takes a non-empty (H, W, 3) image, got shape {image.shape}")
    if method != "bilinear" and full_size is not None:
        raise ValueError(f"a window of the resize is implemented for bilinear only, not {method}")
    if out.ndim != 3 or out.shape[2] != 3 or out.dtype not in (np.float32, np.uint8):
        raise ValueError(f"resize writes an (S_h, S_w, 3) float32 or uint8 out, got {out.dtype} {out.shape}")
    target = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
    flat = target.reshape(out.shape[0], -1)
    fout, uout = (_NO_FLOATS, flat) if out.dtype == np.uint8 else (flat, _NO_LEVELS)
    rows, mirrored = _flat_rows(image)
    if method == "bilinear":
        full_h, full_w = full_size or out.shape[:2]
        _bilinear(
            rows, mirrored, _F32(in_scale), fout, uout, _F32(multiplier), bool(flip), full_h, full_w, *offset
        )
    else:
        _KERNELS[method](rows, mirrored, _F32(in_scale), fout, uout, _F32(multiplier), bool(flip))
    if target is not out:
        out[...] = target
    return out


def warm_up(methods: tuple[str, ...] = METHODS) -> None:
    """Compile (or load from numba's cache) every kernel of `methods` for the input and output types the
    pipelines use (uint8 or float32 images; float32 or rounded uint8 out)."""
    for dtype in (np.uint8, np.float32):
        image = np.zeros((3, 4, 3), dtype)
        for out in (np.empty((2, 2, 3), np.float32), np.empty((2, 2, 3), np.uint8)):
            for method in methods:
                resize(image, out, method)  # C-contiguous rows
                resize(image[:, 1:], out, method)  # a crop's rows (any row stride)
