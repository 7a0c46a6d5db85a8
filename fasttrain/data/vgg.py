"""The ResNet seed's `vgg_preprocessing` (ucloud/uai-sdk examples/tensorflow/train/imagenet/code), as
TensorFlow computes it: uint8 (S, S, 3) RGB out, TF's float [0, 1] values times 255, rounded.

The seed (imagenet.py's parser, then vgg_preprocessing.preprocess_image(224, 224, is_training)):

    x = convert_image_dtype(decode_image(jpeg, channels=3), float32)    # u8 * float32(1/255)
    train  side = random_uniform([], 256, 512 + 1, int32)                 # preprocess_for_train
           x = _aspect_preserving_resize(x, side)                         # see below
           top = random_uniform([], 0, H' - 224 + 1), left likewise        # _random_crop
           x = x[top : top + 224, left : left + 224]; random_flip_left_right(x)
    eval   x = _aspect_preserving_resize(x, 256)                           # preprocess_for_eval
           x = x[(H' - 224) // 2 :, (W' - 224) // 2 :][:224, :224]          # _central_crop
    both   x - (123.68, 116.78, 103.94) / 255                              # _mean_image_subtraction

    _aspect_preserving_resize: (H', W') = _smallest_size_at_least(H, W, side): in float32,
        scale = side / W if H > W else side / H;  H' = int(H * scale), W' = int(W * scale)
        (truncated: for side 256, 271 of the short sides 1..2000 become 255; over sides 256..512, 5.5%
        of (short side, side) pairs end one pixel short), then
        resize_bilinear(x, (H', W'), align_corners=False): TF1's kernel (fasttrain.data.resize).
    _central_crop divides (H' - 224) / 2 as float and truncates it in tf.to_int32: (H' - 224) // 2.

The mean subtraction is not done here: the batch leaves as uint8 and normalize.py subtracts the means
on the device (preprocess "vgg": y = x / 255 - mean / 255). For image_size S other than 224 the sides
scale as the resnet preprocess's do: [round(S * 256 / 224), round(S * 512 / 224)], eval round(S * 256 / 224).

Fast path (`train_transform`, `eval_transform`; `window_float` keeps its floats for the tests): TF
decodes the whole image and resizes all of it (up to 512 px on the short side, in float) to keep
224 x 224. Only the output window is computed here, and only the source rows and columns its 2 x 2 taps
read are decoded: TF1's bilinear reads rows floor(y * sy) .. ceil(y * sy) for y in [top, top + S), with
sy = float32(H) / float32(H'). The decode is libjpeg-turbo's cropped decode
(fasttrain.data.jpeg.decode.decode_window_rows, into the thread's reused buffer, read in place), widened by
`_CHROMA_MARGIN` columns on each side: libjpeg upsamples chroma at a cropped region's first and last
column as at an image edge, so those columns may differ from the full decode's (4:2:0 / 4:2:2). One
column is the fewest that keeps them out of the window: the region starts on an MCU boundary, so its
first column is the window's only when the window starts on one (then one more MCU column is decoded),
and likewise at the right (the rows of a cropped decode equal the full decode's). The resample writes
the rounded uint8 straight into the caller's `out`, vertical lerp and rounding in one pass. The fast
path's floats equal the full-image path's (`full_float`) bit for bit (tests/test_vgg_preprocessing.py),
and both are TensorFlow's within float noise.

Cost (bench/bench_vgg_transform.py, the bench photo set, one thread): the cropped decode is most of
it, and it is entropy decoding: libjpeg must Huffman-decode every row above the window across the
whole width to reach it (a decode of an 8-column strip ending at the window's last row costs 0.9 of
the window's decode), and a progressive JPEG's scans are all decoded before any row comes out (about
2 full baseline decodes, whatever the window). The resample is about a sixth of the decode.

Difference from TF: a JPEG truncated below the rows a window reads decodes here and fails in TF
(`python -m fasttrain.data verify --decode` finds such records).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from fasttrain.data.jpeg import fused
from fasttrain.data.jpeg.decode import jpeg_size
from fasttrain.data.jpeg.doctor import decode_window_rows
from fasttrain.data.resize import resize
from fasttrain.data.resize_kernels import _lerp_row  # TF's horizontal lerp of one source row

_F32 = np.float32
_CHROMA_MARGIN = 1  # columns decoded beyond the window on each side: the fewest that are exact
_IN_SCALE = _F32(1 / 255)  # convert_image_dtype's scale, a float32 constant in TF's graph


def resize_sides(image_size: int) -> tuple[int, int, int]:
    """(train min, train max, eval) short sides: the seed's 256, 512 and 256 at image_size 224."""
    lo, hi = round(image_size * 256 / 224), round(image_size * 512 / 224)
    return lo, hi, lo


def smallest_size_at_least(height: int, width: int, side: int) -> tuple[int, int]:
    """The seed's _smallest_size_at_least: float32 scale, the new size truncated (tf.to_int32)."""
    h, w, s = _F32(height), _F32(width), _F32(side)
    scale = s / w if h > w else s / h
    return int(h * scale), int(w * scale)


@dataclass(frozen=True)
class VggParams:
    """One image's geometry: the resize side, the crop's offsets in the resized image, the flip."""

    side: int
    top: int
    left: int
    flip: bool = False


def sample_train_params(rng: np.random.Generator, height: int, width: int, image_size: int) -> VggParams:
    """The seed's draws, in its order: side in [lo, hi], top, left (uniform integers), then the flip."""
    lo, hi, _ = resize_sides(image_size)
    side = int(rng.integers(lo, hi + 1))
    new_h, new_w = smallest_size_at_least(height, width, side)
    _check_size(new_h, new_w, image_size, side)
    top = int(rng.integers(0, new_h - image_size + 1))
    left = int(rng.integers(0, new_w - image_size + 1))
    return VggParams(side, top, left, bool(rng.random() < 0.5))


def eval_params(height: int, width: int, image_size: int) -> VggParams:
    """The central crop of the eval resize: offsets ((H' - S) // 2, (W' - S) // 2)."""
    side = resize_sides(image_size)[2]
    new_h, new_w = smallest_size_at_least(height, width, side)
    _check_size(new_h, new_w, image_size, side)
    return VggParams(side, (new_h - image_size) // 2, (new_w - image_size) // 2)


def _check_size(new_h: int, new_w: int, image_size: int, side: int) -> None:
    if new_h < image_size or new_w < image_size:  # only for image sizes below 8 (round(S * 8 / 7) = S)
        raise ValueError(f"image_size {image_size} is larger than the {new_h}x{new_w} resize to side {side}")


def _taps(start: int, count: int, in_size: int, out_size: int) -> tuple[int, int]:
    """First and last source index TF1's bilinear reads for outputs start .. start + count - 1."""
    scale = _F32(in_size) / _F32(out_size)
    first = max(int(math.floor(_F32(start) * scale)), 0)
    last = min(int(math.ceil(_F32(start + count - 1) * scale)), in_size - 1)
    return first, last


def source_window(height: int, width: int, params: VggParams, image_size: int) -> tuple[int, int, int, int]:
    """(top, left, h, w) of the decoded image that the output window reads, plus the chroma margin."""
    new_h, new_w = smallest_size_at_least(height, width, params.side)
    r0, r1 = _taps(params.top, image_size, height, new_h)
    c0, c1 = _taps(params.left, image_size, width, new_w)
    c0, c1 = max(c0 - _CHROMA_MARGIN, 0), min(c1 + _CHROMA_MARGIN, width - 1)
    return r0, c0, r1 - r0 + 1, c1 - c0 + 1


@numba.njit(nogil=True, cache=True)
def _window_bilinear(src, r0, c0, in_h, in_w, full_h, full_w, top, left, flip, out, fout):
    """out (S, S * 3) uint8 = round(255 x) of x = rows top.. and columns left.. of TF1's resize_bilinear
    of the (in_h, in_w) image times 1/255 to (full_h, full_w), mirrored left-right when flip; fout
    (S, S * 3) float32 receives x itself unless it has no rows. src (h, n * 3) uint8 holds the image's
    rows r0.. from column c0 on (any row stride).

    TF's per-pixel arithmetic (resize_bilinear_op.cc, legacy scaler): s = float(o) * scale,
    lo = max(floor(s), 0), hi = min(ceil(s), in - 1), t = s - floor(s);
    top = tl + (tr - tl) * tx, bottom = bl + (br - bl) * tx, out = top + (bottom - top) * ty.
    Each source row's horizontal lerps are computed once and kept while the next output row reads them
    (232 rows per image on the bench set, against 448 row reads); the vertical lerp and the rounding
    store are one pass (no float image in between). Indices are unsigned: numba then skips its
    negative-index fix-up on every load, which halves the horizontal pass.
    """
    size, n = out.shape[0], out.shape[1]
    width = n // 3
    sy, sx = _F32(in_h) / _F32(full_h), _F32(in_w) / _F32(full_w)
    lo = max(int(math.floor(_F32(left) * sx)), 0)  # the first source column any output reads
    hi = min(int(math.ceil(_F32(left + width - 1) * sx)), in_w - 1)
    ia = np.empty(width, np.uint32)  # per output pixel: 3 x its left / right tap's column - lo
    ib = np.empty(width, np.uint32)
    tx = np.empty(width, np.float32)
    for x in range(width):
        s = _F32(x + left) * sx
        f = math.floor(s)
        xo = width - 1 - x if flip else x
        ia[xo] = 3 * (max(int(f), 0) - lo)
        ib[xo] = 3 * (min(int(math.ceil(s)), in_w - 1) - lo)
        tx[xo] = s - _F32(f)
    first, count = 3 * (lo - c0), 3 * (hi - lo + 1)
    conv = np.empty(count, np.float32)
    upper = np.empty(n, np.float32)
    lower = np.empty(n, np.float32)
    keep = fout.shape[0] > 0
    upper_row, lower_row = -1, -1
    for y in range(size):
        s = _F32(y + top) * sy
        f = math.floor(s)
        y0, y1 = max(int(f), 0), min(int(math.ceil(s)), in_h - 1)
        ty = s - _F32(f)
        if y0 != upper_row:
            if y0 == lower_row:  # the previous lower row is this row's upper one
                upper, lower = lower, upper
                upper_row, lower_row = lower_row, upper_row
            else:
                _lerp_row(src[y0 - r0, first : first + count], _IN_SCALE, ia, ib, tx, conv, upper)
                upper_row = y0
        if y1 != lower_row:
            _lerp_row(src[y1 - r0, first : first + count], _IN_SCALE, ia, ib, tx, conv, lower)
            lower_row = y1
        dst = out[y]
        if keep:
            kept = fout[y]
            for k in range(n):
                kept[k] = upper[k] + (lower[k] - upper[k]) * ty
        for k in range(n):
            v = upper[k] + (lower[k] - upper[k]) * ty  # (the same float operations as `kept`)
            dst[k] = _round(v)


@numba.njit(nogil=True, cache=True, inline="always")
def _round(v):
    """round(v * 255) clamped to [0, 255] as uint8 (the bilinear result of [0, 1] values stays in it)."""
    return np.uint8(min(np.int32(min(max(v * _F32(255) + _F32(0.5), _F32(0)), _F32(255.5))), 255))


_NO_FLOATS = np.empty((0, 0), np.float32)


@numba.njit(nogil=True, cache=True)
def _fused(
    fns, handle, data, cp, r0, c0, h, w, in_h, in_w, full_h, full_w, top, left, flip, stream, buf, out
):
    """(status, need, doctored): the source window's decode and `_window_bilinear` into out (S, S * 3)
    uint8 in one call without the GIL (fasttrain.data.jpeg.fused); buf: the decode's buffer."""
    status, need, x, doctored = fused.decode_window(fns, handle, data, cp, r0, c0, h, w, stream, buf)
    if status != fused.DONE:
        return status, need, doctored
    span = w + c0 - x
    rows = buf[: h * span * 3].reshape(h, span * 3)
    no_floats = np.empty((0, 0), np.float32)
    _window_bilinear(rows, r0, x, in_h, in_w, full_h, full_w, top, left, flip, out, no_floats)
    return fused.DONE, 0, doctored


def _window(
    jpeg: bytes,
    size: tuple[int, int],
    params: VggParams,
    image_size: int,
    out,
    fout,
    file,
    offset,
    checkpoints=None,
):
    """The fast path: out (uint8) and, unless fout is _NO_FLOATS, fout (float32), both (S, S * 3), of
    the (height, width) = size JPEG."""
    height, width = size
    new_h, new_w = smallest_size_at_least(height, width, params.side)
    window = source_window(height, width, params, image_size)
    if fout is _NO_FLOATS:  # the decode and the resample in one call without the GIL, where it can
        geometry = (height, width, new_h, new_w, params.top, params.left, bool(params.flip))
        if fused.run(_fused, jpeg, checkpoints, window, geometry, (out,)):
            return
    rows, col = decode_window_rows(jpeg, checkpoints, window, file, offset)
    _window_bilinear(
        rows, window[0], col, height, width, new_h, new_w, params.top, params.left, params.flip, out, fout
    )


def window_float(
    jpeg: bytes, params: VggParams, image_size: int, scratch=None, file="", offset: int = 0
) -> np.ndarray:
    """(S, S, 3) float32 in [0, 1]: the seed's resized, cropped, flipped image before the means, from a
    cropped decode of the rows and columns the window reads (the fast path, as the transforms run it)."""
    out = _scratch(image_size, scratch)
    rounded = np.empty((image_size, image_size * 3), np.uint8)
    _window(
        jpeg,
        jpeg_size(jpeg, file, offset),
        params,
        image_size,
        rounded,
        out.reshape(image_size, image_size * 3),
        file,
        offset,
    )
    return out


def full_float(image: np.ndarray, params: VggParams, image_size: int) -> np.ndarray:
    """(S, S, 3) float32: the seed's steps as written, on the whole decoded (H, W, 3) uint8 image:
    resize all of it to the side, crop, flip (the slow reference the fast path is tested against)."""
    height, width = image.shape[:2]
    resized = np.empty((*smallest_size_at_least(height, width, params.side), 3), np.float32)
    resize(image, resized, "bilinear", in_scale=1 / 255)
    crop = resized[params.top : params.top + image_size, params.left : params.left + image_size]
    return np.ascontiguousarray(crop[:, ::-1] if params.flip else crop)


@numba.njit(nogil=True, cache=True)
def _store(x, out):
    """out = round(x * 255) clamped to [0, 255], as the fast path's fused store rounds."""
    src, dst = x.ravel(), out.ravel()
    for k in range(src.size):
        dst[k] = _round(src[k])


def _output(image_size: int, out) -> np.ndarray:
    if out is None:
        return np.empty((image_size, image_size, 3), np.uint8)
    if out.shape != (image_size, image_size, 3) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous ({image_size}, {image_size}, 3) uint8 array")
    return out


def _scratch(image_size: int, scratch) -> np.ndarray:
    if scratch is None or scratch.shape != (image_size, image_size, 3) or not scratch.flags.c_contiguous:
        return np.empty((image_size, image_size, 3), np.float32)
    return scratch


def train_transform(
    jpeg: bytes,
    rng: np.random.Generator,
    image_size: int,
    file="",
    offset: int = 0,
    out=None,
    scratch=None,
    checkpoints=None,
) -> np.ndarray:
    """(S, S, 3) uint8: the seed's training image (random side, crop and flip) before the means, written
    straight into `out` (no float image in between: `scratch` is accepted for the transforms' common
    signature and not used)."""
    height, width = jpeg_size(jpeg, file, offset)
    params = sample_train_params(rng, height, width, image_size)
    out = _output(image_size, out)
    shape = (height, width)
    _window(
        jpeg, shape, params, image_size, out.reshape(image_size, -1), _NO_FLOATS, file, offset, checkpoints
    )
    return out


def eval_transform(
    jpeg: bytes, image_size: int, file="", offset: int = 0, out=None, scratch=None
) -> np.ndarray:
    """(S, S, 3) uint8: the seed's evaluation image (side 256, central crop) before the means."""
    height, width = jpeg_size(jpeg, file, offset)
    params = eval_params(height, width, image_size)
    out = _output(image_size, out)
    _window(jpeg, (height, width), params, image_size, out.reshape(image_size, -1), _NO_FLOATS, file, offset)
    return out


def apply_eval(image: np.ndarray, image_size: int, out=None) -> np.ndarray:
    """(S, S, 3) uint8 evaluation image of an already decoded (H, W, 3) uint8 image."""
    params = eval_params(*image.shape[:2], image_size)
    out = _output(image_size, out)
    _store(full_float(image, params, image_size), out)
    return out


def warm_up() -> None:
    """Compile (or load from numba's disk cache) this module's kernels in this process."""
    src = np.zeros((2, 6), np.uint8)
    out, floats = np.empty((1, 3), np.uint8), np.empty((1, 3), np.float32)
    for flip in (False, True):
        for fout in (floats, _NO_FLOATS):
            _window_bilinear(src, 0, 0, 2, 2, 2, 2, 0, 0, flip, out, fout)
    if fused.FUSED:  # the decode and the resample in one call (_fused), with and without checkpoints
        jpeg, checkpoints = fused.warm_up_inputs()
        size, levels = jpeg_size(jpeg), np.empty((8, 24), np.uint8)
        for cp in checkpoints:
            _window(jpeg, size, VggParams(9, 0, 0), 8, levels, _NO_FLOATS, "", 0, cp)
    _store(floats.reshape(1, 1, 3), np.empty((1, 1, 3), np.uint8))
