"""The seeds' image preprocessing on the CPU, as TensorFlow computes it: uint8 (S, S, 3) RGB out.

Train, random parameters drawn by `sample_train_params` (crop, resize method, flip, colour), applied by
`apply_train`:

    crop     (top, left, h, w) = sample_distorted_bounding_box(image size, record boxes,
             min_object_covered 0.1, aspect [0.75, 1.33], area [0.05, 1.0], 100 attempts; the whole
             image when there is no box or no attempt succeeds)
    resnet   (TF official imagenet_preprocessing) decode_and_crop_jpeg(crop) -> flip left-right with
             probability 1/2 -> resize_images(S, S, bilinear)
    inception (the seed's image_processing.distort_image) decode_jpeg -> x / 255 (convert_image_dtype)
             -> slice(crop) -> resize_images(S, S, method) with method bilinear, nearest, bicubic or area
             (the seed's thread_id % 4, here a uniform draw) -> flip with probability 1/2 ->
             distort_color when asked (fasttrain.data.color) -> x * 255; only the crop's pixels are
             decoded (decode_full_window_rows: the whole decode's pixels, at about 0.7 of its cost)

Eval (`eval_transform`):

    inception  central_crop(0.875): start = int((H - 0.875 H) / 2) per axis, size = H - 2 start;
               resize_bilinear(S, S) of x / 255
    resnet     aspect-preserving resize so the short side is R = round(S * 256 / 224) (TF official's
               _RESIZE_MIN = 256 at its S = 224), the new size in float32 and truncated
               (_smallest_size_at_least: a 332 x 500 image becomes 255 x 385), bilinear, then the
               central S x S at ((H' - S) // 2, (W' - S) // 2); only that window is computed

vgg (the ResNet seed's vgg_preprocessing: scale jitter, random crop, flip) is fasttrain.data.vgg.

Decoding and resizing are TensorFlow's (fasttrain.data.jpeg.decode, fasttrain.data.resize), so the uint8
outputs are TensorFlow's float results rounded to the nearest level (tests/test_transforms_tf.py). The
ResNet seed flips the crop before resizing; TF1's resize is not mirror-symmetric (source = x * scale),
so the order is kept. Inception flips after the resize: the resize writes its columns mirrored, and
the colour steps (per pixel, and channel means) do not care.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from fasttrain.data import seeding, vgg
from fasttrain.data.color import ColorParams, distort_color, sample_color
from fasttrain.data.color import warm_up as color_warm_up
from fasttrain.data.jpeg.decode import decode_jpeg, jpeg_size
from fasttrain.data.jpeg.doctor import decode_full_window_rows, decode_window_rows
from fasttrain.data.jpeg.fused import crop_resize, crop_resize_inception
from fasttrain.data.jpeg.fused import warm_up as fused_warm_up
from fasttrain.data.resize import METHODS, resize
from fasttrain.data.resize import warm_up as resize_warm_up

_F32 = np.float32


def _generate_random_crop(rng, width, height, min_area_frac, max_area_frac, aspect):
    """TF's GenerateRandomCrop (sample_distorted_bounding_box_op.cc), in float32 like the C++.

    The float32 arithmetic runs in the numba helpers (_height_range, _crop_size: NumPy scalar
    arithmetic cost about 10 us a call); the draws stay on the NumPy generator, in TF's order.
    """
    h, max_h = _height_range(width, height, _F32(min_area_frac), _F32(max_area_frac), aspect)
    if h < max_h:
        h += int(rng.integers(0, max_h - h + 1))
    h, w = _crop_size(h, aspect, width, height, _F32(min_area_frac), _F32(max_area_frac))
    if h < 0:
        return None
    y = int(rng.integers(0, height - h)) if h < height else 0
    x = int(rng.integers(0, width - w)) if w < width else 0
    return y, x, h, w


@numba.njit(nogil=True, cache=True)
def _height_range(width, height, min_area_frac, max_area_frac, aspect):
    """GenerateRandomCrop up to its height draw: (smallest height, largest height)."""
    min_area = min_area_frac * _F32(width) * _F32(height)
    max_area = max_area_frac * _F32(width) * _F32(height)
    h = int(np.rint(np.sqrt(min_area / aspect)))  # lrintf: round half to even
    max_h = int(np.rint(np.sqrt(max_area / aspect)))
    if int(np.rint(_F32(max_h) * aspect)) > width:
        # The smallest max_h with round(max_h * aspect) <= width (kEps guards the float division).
        max_h = int((width + 0.5 - 1e-7) / np.float64(aspect))
        if int(np.rint(_F32(max_h) * aspect)) > width:
            max_h -= 1
    max_h = min(max_h, height)
    return min(h, max_h), max_h


@numba.njit(nogil=True, cache=True)
def _crop_size(h, aspect, width, height, min_area_frac, max_area_frac):
    """GenerateRandomCrop after its height draw: (h, w), or (-1, -1) when the crop fails."""
    min_area = min_area_frac * _F32(width) * _F32(height)
    max_area = max_area_frac * _F32(width) * _F32(height)
    w = int(np.rint(_F32(h) * aspect))
    area = _F32(w * h)
    for _ in range(2):  # rounding may leave the area just below the minimum: try 1-2 rows taller
        if area < min_area:
            h += 1
            w = int(np.rint(_F32(h) * aspect))
            area = _F32(w * h)
    if area < min_area or area > max_area or w > width or h > height or w <= 0 or h <= 0:
        return -1, -1
    return h, w


def _covers_an_object(y, x, h, w, pixel_boxes, min_object_covered) -> bool:
    """TF's SatisfiesOverlapConstraints: the crop covers >= min_object_covered of some box's area."""
    if h * w < 1:
        return False
    for y0, x0, y1, x1 in pixel_boxes:
        object_area = (y1 - y0) * (x1 - x0)
        if object_area < 1:
            continue
        ih = max(0, min(y + h, y1) - max(y, y0))
        iw = max(0, min(x + w, x1) - max(x, x0))
        if _F32(ih * iw) / _F32(object_area) >= min_object_covered:
            return True
    return False


def sample_distorted_bounding_box(
    rng: np.random.Generator,
    height: int,
    width: int,
    boxes,
    min_object_covered: float = 0.1,
    aspect_ratio_range=(0.75, 1.33),
    area_range=(0.05, 1.0),
    max_attempts: int = 100,
) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a random crop, following tf.image.sample_distorted_bounding_box.

    boxes: (K, 4) ymin, xmin, ymax, xmax normalised (K may be 0: the whole image is the object, as
    with use_image_if_no_bounding_boxes=True). The area range is relative to the whole image.
    A loader's generator (fasttrain.data.seeding.PCGGenerator) runs the search in one kernel,
    `_sample_box`, with the same draws (about 1 us instead of 15-20 us of Python and NumPy scalars).
    """
    pcg = getattr(rng, "pcg", None)  # a loader's PCGGenerator: the whole search in one kernel
    if pcg is not None and 0 < height < 2**31 and 0 < width < 2**31:
        array = np.asarray(boxes, dtype=np.float32)
        if array.ndim == 2 and array.shape[1] == 4:
            lo, hi = aspect_ratio_range
            y, x, h, w = _sample_box(
                *pcg, height, width, array, min_object_covered, lo, hi, *area_range, max_attempts
            )
            if h > 0:  # (0 if a box is not finite: nothing drawn, the Python path decides)
                return y, x, h, w
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    if len(boxes):
        scale = np.array([height, width, height, width], dtype=np.float32)
        # TF rejects boxes outside [0, 1]; we clip. astype truncates as static_cast<int32> does.
        pixel_boxes = (np.clip(boxes, 0, 1) * scale).astype(np.int32).tolist()
    else:
        pixel_boxes = [(0, 0, height, width)]
    lo, hi = _F32(aspect_ratio_range[0]), _F32(aspect_ratio_range[1])
    for _ in range(max_attempts):
        aspect = _F32(rng.random()) * (hi - lo) + lo
        crop = _generate_random_crop(rng, width, height, area_range[0], area_range[1], aspect)
        if crop is not None and _covers_an_object(*crop, pixel_boxes, min_object_covered):
            return crop
    return 0, 0, height, width


@numba.njit(cache=True)
def _sample_box(words, buffer, height, width, boxes, min_object_covered, lo, hi, area_lo, area_hi, attempts):
    """sample_distorted_bounding_box's search, drawing from the PCG64 views as the Generator would
    (fasttrain.data.seeding), in float32 where it is. (0, 0, 0, 0) before any draw if a box is not
    finite (np.clip and the int32 cast of NaN are left to the Python path)."""
    k = boxes.shape[0]
    pixel_boxes = np.empty((max(k, 1), 4), np.int64)
    if k == 0:
        pixel_boxes[0, 0], pixel_boxes[0, 1], pixel_boxes[0, 2], pixel_boxes[0, 3] = 0, 0, height, width
    scale = (_F32(height), _F32(width), _F32(height), _F32(width))
    for i in range(k):
        for j in range(4):
            v = boxes[i, j]
            if not np.isfinite(v):
                return 0, 0, 0, 0
            pixel_boxes[i, j] = np.int32(min(max(v, _F32(0)), _F32(1)) * scale[j])  # clip, truncate
    lo32, hi32, cover = _F32(lo), _F32(hi), _F32(min_object_covered)  # NumPy 2 compares in float32
    for _ in range(attempts):
        aspect = _F32(seeding.next_double(words)) * (hi32 - lo32) + lo32
        h, max_h = _height_range(width, height, _F32(area_lo), _F32(area_hi), aspect)
        if h < max_h:
            h += seeding.integers(words, buffer, max_h - h + 1)
        h, w = _crop_size(h, aspect, width, height, _F32(area_lo), _F32(area_hi))
        if h < 0:
            continue
        y = seeding.integers(words, buffer, height - h) if h < height else 0
        x = seeding.integers(words, buffer, width - w) if w < width else 0
        if h * w < 1:
            continue
        for i in range(pixel_boxes.shape[0]):
            y0, x0, y1, x1 = pixel_boxes[i, 0], pixel_boxes[i, 1], pixel_boxes[i, 2], pixel_boxes[i, 3]
            object_area = (y1 - y0) * (x1 - x0)
            if object_area < 1:
                continue
            ih = max(0, min(y + h, y1) - max(y, y0))
            iw = max(0, min(x + w, x1) - max(x, x0))
            if _F32(ih * iw) / _F32(object_area) >= cover:
                return y, x, h, w
    return 0, 0, height, width


@dataclass(frozen=True)
class TrainParams:
    """The random choices of one training image (what TensorFlow's random ops would draw)."""

    crop: tuple[int, int, int, int]  # top, left, height, width in the decoded image
    flip: bool
    method: str = "bilinear"  # resize method (the Inception seed varies it)
    color: ColorParams | None = None


def sample_train_params(
    rng: np.random.Generator, height: int, width: int, boxes, preprocess: str, color_distort: bool
) -> TrainParams:
    """Draw crop, resize method, flip and colour for an image of height x width (in this order)."""
    crop = sample_distorted_bounding_box(rng, height, width, boxes)
    method = METHODS[int(rng.integers(0, 4))] if preprocess == "inception" else "bilinear"
    flip = bool(rng.random() < 0.5)
    color = sample_color(rng) if color_distort else None
    return TrainParams(crop, flip, method, color)


def _scratch(image_size: int, scratch) -> np.ndarray:
    if (
        scratch is None
        or scratch.shape != (image_size, image_size, 3)
        or scratch.dtype != np.float32
        or not scratch.flags.c_contiguous
    ):
        scratch = np.empty((image_size, image_size, 3), np.float32)
    return scratch


def _output(image_size: int, out) -> np.ndarray:
    if out is None:
        return np.empty((image_size, image_size, 3), np.uint8)
    if out.shape != (image_size, image_size, 3) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous ({image_size}, {image_size}, 3) uint8 array")
    return out


def apply_train(
    image: np.ndarray, params: TrainParams, image_size: int, preprocess: str, out=None, scratch=None
) -> np.ndarray:
    """(S, S, 3) uint8 of the decoded (H, W, 3) uint8 `image` under `params`, written into `out`.

    scratch: an optional (S, S, 3) float32 work buffer (a loader keeps one per worker) for the resized
    image the colour distortion works on; without colour the resize rounds x * 255 into `out` itself.
    """
    top, left, h, w = params.crop
    crop = image[top : top + h, left : left + w]
    if preprocess == "resnet":
        return _resnet_train(crop, params.flip, image_size, out, scratch)
    out = _output(image_size, out)
    if params.color is None:
        resize(crop, out, params.method, in_scale=1 / 255, flip=params.flip, multiplier=255)
        return out
    work = _scratch(image_size, scratch)
    resize(crop, work, params.method, in_scale=1 / 255, flip=params.flip)
    distort_color(work, params.color, out)  # the clip and the x255 rounding store in its last pass
    return out


def _resnet_train(window: np.ndarray, flip: bool, image_size: int, out, scratch) -> np.ndarray:
    """The resize rounds straight into `out` (scratch: the transforms' common signature, unused)."""
    out = _output(image_size, out)
    resize(window[:, ::-1] if flip else window, out, "bilinear")
    return out


def train_transform(
    jpeg: bytes,
    boxes,
    rng: np.random.Generator,
    image_size: int,
    preprocess: str = "resnet",
    color_distort: bool = False,
    file="",
    offset: int = 0,
    out=None,
    scratch=None,
    checkpoints=None,
) -> np.ndarray:
    """(image_size, image_size, 3) uint8: decode, then the seed's random crop, resize, flip, colour.

    checkpoints: the JPEG's row checkpoints (fasttrain.data.jpeg.doctor), which make the decode of the
    crop cheaper and leave its pixels as they are; None decodes without them."""
    if preprocess == "vgg":  # the ResNet seed's scale jitter + random crop (fasttrain.data.vgg)
        return vgg.train_transform(jpeg, rng, image_size, file, offset, out, scratch, checkpoints)
    if preprocess == "resnet":  # decode_and_crop_jpeg: only the window is decoded
        # sample_train_params' draws without its TrainParams: the crop, then the flip (the colour it
        # would draw next for color_distort comes last and changes nothing in this image).
        height, width = jpeg_size(jpeg, file, offset)
        crop = sample_distorted_bounding_box(rng, height, width, boxes)
        flip = rng.random() < 0.5
        # Decode and resize in one call without the GIL (fasttrain.data.jpeg.fused), where it can.
        out = _output(image_size, out)
        if crop_resize(jpeg, checkpoints, crop, flip, out):
            return out
        # Decoded into this thread's reused buffer (no allocation per image), read at once by the resize.
        rows, x = decode_window_rows(jpeg, checkpoints, crop, file, offset)
        left = crop[1] - x
        window = rows.reshape(rows.shape[0], -1, 3)[:, left : left + crop[3]]
        return _resnet_train(window, flip, image_size, out, scratch)
    # The Inception seed decodes the whole image and slices the crop from it: only the crop's pixels are
    # decoded here, the same pixels (decode_full_window_rows), into this thread's reused buffer.
    height, width = jpeg_size(jpeg, file, offset)
    params = sample_train_params(rng, height, width, boxes, preprocess, color_distort)
    # Decode, resize and colour in one call without the GIL (fasttrain.data.jpeg.fused), where it can.
    out = _output(image_size, out)
    work = None if params.color is None else _scratch(image_size, scratch)
    if crop_resize_inception(
        jpeg, checkpoints, params.crop, width, params.method, params.flip, params.color, out, work
    ):
        return out
    top, left, h, w = params.crop
    rows, x = decode_full_window_rows(jpeg, checkpoints, params.crop, width, file, offset)
    window = TrainParams((0, left - x, h, w), params.flip, params.method, params.color)
    return apply_train(rows.reshape(h, -1, 3), window, image_size, preprocess, out, work)


def inception_central_crop(height: int, width: int) -> tuple[int, int, int, int]:
    """(top, left, h, w) of tf.image.central_crop(image, 0.875) (float64 arithmetic, as TF)."""
    top = int((height - height * 0.875) / 2)
    left = int((width - width * 0.875) / 2)
    return top, left, height - 2 * top, width - 2 * left


def resnet_resize_size(height: int, width: int, image_size: int) -> tuple[int, int]:
    """TF official's _smallest_size_at_least: float32 scale, sizes truncated to int."""
    resize_min = _F32(round(image_size * 256 / 224))
    h, w = _F32(height), _F32(width)
    ratio = resize_min / min(h, w)
    return int(h * ratio), int(w * ratio)


def apply_eval(image: np.ndarray, image_size: int, preprocess: str, out=None, scratch=None) -> np.ndarray:
    """(S, S, 3) uint8: the seed's central-crop evaluation transform of a decoded (H, W, 3) image (the
    resize rounds straight into `out`; scratch: the transforms' common signature, unused)."""
    if preprocess == "vgg":
        return vgg.apply_eval(image, image_size, out)
    out = _output(image_size, out)
    height, width = image.shape[:2]
    if preprocess == "inception":
        top, left, h, w = inception_central_crop(height, width)
        resize(image[top : top + h, left : left + w], out, "bilinear", in_scale=1 / 255, multiplier=255)
        return out
    new_h, new_w = resnet_resize_size(height, width, image_size)
    window = ((new_h - image_size) // 2, (new_w - image_size) // 2)
    resize(image, out, "bilinear", full_size=(new_h, new_w), offset=window)
    return out


def eval_transform(
    jpeg: bytes, image_size: int, preprocess: str = "resnet", file="", offset: int = 0, out=None, scratch=None
) -> np.ndarray:
    """(image_size, image_size, 3) uint8: decode, then the seed's central-crop evaluation transform."""
    if preprocess == "vgg":  # decodes only the rows and columns the central window reads
        return vgg.eval_transform(jpeg, image_size, file, offset, out, scratch)
    return apply_eval(decode_jpeg(jpeg, file, offset), image_size, preprocess, out, scratch)


def warm_up() -> None:
    """Compile (or load from numba's disk cache) every kernel the transforms use, in this process.

    A loader calls it before starting its workers, which then inherit the compiled code (55 s of
    compilation the first time on the 2-core VM, bench/results/2026-11-27-cpu-numba-warm-up/; about
    1 s from the cache after that).
    """
    resize_warm_up()
    vgg.warm_up()
    fused_warm_up()
    color_warm_up()
