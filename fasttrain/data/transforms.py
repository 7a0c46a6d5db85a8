"""The seeds' image preprocessing on the CPU (Pillow + NumPy): uint8 (S, S, 3) RGB out.

Train (both seeds): (top, left, h, w) = sample_distorted_bounding_box(image size, record boxes,
min_object_covered 0.1, aspect [0.75, 1.33], area [0.05, 1.0], 100 attempts; whole image when there
is no box or no attempt succeeds), resize the crop to S x S (Inception: one of bilinear, nearest,
bicubic, area at random, as the seed's thread_id % 4; ResNet: bilinear), flip left-right with
probability 1/2, then the Inception colour distortion when asked (fasttrain.data.color).

Eval: inception: TF's central_crop(0.875) (start = int((H - 0.875 H) / 2), size = H - 2 start, per
axis) then bilinear resize to S x S; resnet: bilinear resize so the short side is R = round(S * 256 /
224) (the long side round(long * R / short)), then the central S x S crop at ((H' - S) // 2,
(W' - S) // 2). Each is done as one Pillow resize of the equivalent source box, which gives the same
pixels as resize-then-crop (the filter still reads the neighbours outside the box).

Speed: JPEG decoding uses libjpeg's DCT scaling (Pillow's draft mode, factor 2, 4 or 8) whenever the
crop still has at least S pixels on each side at the reduced scale; the source box is scaled to match,
so the geometry is unchanged and only detail the resize would discard anyway is lost.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from fasttrain.data import DataError
from fasttrain.data.color import distort_color

_F32 = np.float32
# The Inception seed picks the resize method by preprocessing thread: bilinear, nearest, bicubic, area.
_INCEPTION_RESAMPLE = (Image.BILINEAR, Image.NEAREST, Image.BICUBIC, Image.BOX)


def _generate_random_crop(rng, width, height, min_area_frac, max_area_frac, aspect):
    """TF's GenerateRandomCrop (sample_distorted_bounding_box_op.cc), in float32 like the C++."""
    min_area = _F32(min_area_frac) * _F32(width) * _F32(height)
    max_area = _F32(max_area_frac) * _F32(width) * _F32(height)
    h = int(np.rint(np.sqrt(min_area / aspect)))  # lrintf: round half to even
    max_h = int(np.rint(np.sqrt(max_area / aspect)))
    if int(np.rint(_F32(max_h) * aspect)) > width:
        # The smallest max_h with round(max_h * aspect) <= width (kEps guards the float division).
        max_h = int((width + 0.5 - 1e-7) / float(aspect))
        if int(np.rint(_F32(max_h) * aspect)) > width:
            max_h -= 1
    max_h = min(max_h, height)
    h = min(h, max_h)
    if h < max_h:
        h += int(rng.integers(0, max_h - h + 1))
    w = int(np.rint(_F32(h) * aspect))
    area = _F32(w * h)
    for _ in range(2):  # rounding may leave the area just below the minimum: try 1-2 rows taller
        if area < min_area:
            h += 1
            w = int(np.rint(_F32(h) * aspect))
            area = _F32(w * h)
    if area < min_area or area > max_area or w > width or h > height or w <= 0 or h <= 0:
        return None
    y = int(rng.integers(0, height - h)) if h < height else 0
    x = int(rng.integers(0, width - w)) if w < width else 0
    return y, x, h, w


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
    """
    boxes = np.clip(np.asarray(boxes, dtype=np.float32).reshape(-1, 4), 0, 1)  # TF rejects; we clip
    scale = np.array([height, width, height, width], dtype=np.float32)
    pixel_boxes = [tuple(int(v) for v in row) for row in boxes * scale]  # static_cast<int32>
    if not pixel_boxes:
        pixel_boxes = [(0, 0, height, width)]
    lo, hi = _F32(aspect_ratio_range[0]), _F32(aspect_ratio_range[1])
    for _ in range(max_attempts):
        aspect = _F32(rng.random()) * (hi - lo) + lo
        crop = _generate_random_crop(rng, width, height, area_range[0], area_range[1], aspect)
        if crop is not None and _covers_an_object(*crop, pixel_boxes, min_object_covered):
            return crop
    return 0, 0, height, width


def open_image(jpeg: bytes, file="", offset=0) -> Image.Image:
    """A lazily decoded Pillow image (the header is read, the pixels are not yet)."""
    try:
        return Image.open(io.BytesIO(jpeg))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _undecodable(file, offset, e) from None


def _undecodable(file, offset, error) -> DataError:
    return DataError(
        f"undecodable JPEG in record at offset {offset} in {file} ({error}); re-create the shard "
        "or train with --skip_corrupt"
    )


def _load_rgb(jpeg: bytes, box, min_side: int, draft: bool, file, offset):
    """(RGB image, box in its coordinates) for the source `box` (left, top, right, bottom) of `jpeg`.

    Decodes at 1/2, 1/4 or 1/8 scale when the box keeps at least min_side pixels per side there.
    """
    img = open_image(jpeg, file, offset)
    scale = 1.0
    try:
        if draft and img.format == "JPEG":
            short = min(box[2] - box[0], box[3] - box[1])
            factor = next((f for f in (8, 4, 2) if short / f >= min_side), 1)
            if factor > 1:
                full_width = img.size[0]
                result = img.draft("RGB", (img.size[0] // factor, img.size[1] // factor))
                if result is not None:  # (mode, (0, 0, W / s, H / s)) for the scale s chosen
                    scale = result[1][2] / full_width
        img.load()
        rgb = img if img.mode == "RGB" else img.convert("RGB")  # grayscale, CMYK -> 3 channels
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _undecodable(file, offset, e) from None
    return rgb, tuple(v * scale for v in box)


def train_transform(
    jpeg: bytes,
    boxes,
    rng: np.random.Generator,
    image_size: int,
    preprocess: str = "resnet",
    color_distort: bool = False,
    file="",
    offset: int = 0,
    draft: bool = True,
) -> np.ndarray:
    """(image_size, image_size, 3) uint8: distorted-box crop, resize, random flip, optional colour."""
    width, height = open_image(jpeg, file, offset).size
    top, left, h, w = sample_distorted_bounding_box(rng, height, width, boxes)
    resample = _INCEPTION_RESAMPLE[int(rng.integers(0, 4))] if preprocess == "inception" else Image.BILINEAR
    flip = rng.random() < 0.5
    img, box = _load_rgb(jpeg, (left, top, left + w, top + h), image_size, draft, file, offset)
    img = img.resize((image_size, image_size), resample, box=box)
    if flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    out = np.asarray(img)
    if color_distort:
        out = distort_color(out, rng)
    return out


def eval_box(height: int, width: int, image_size: int, preprocess: str) -> tuple[float, float, float, float]:
    """The source box (left, top, right, bottom) whose resize to S x S is the seed's eval transform."""
    if preprocess == "inception":
        top = int((height - height * 0.875) / 2)  # tf.image.central_crop(image, 0.875)
        left = int((width - width * 0.875) / 2)
        return left, top, width - left, height - top
    short = round(image_size * 256 / 224)
    if height <= width:
        new_h, new_w = short, round(width * short / height)
    else:
        new_h, new_w = round(height * short / width), short
    top, left = (new_h - image_size) // 2, (new_w - image_size) // 2
    sy, sx = height / new_h, width / new_w  # source pixels per resized pixel
    return left * sx, top * sy, (left + image_size) * sx, (top + image_size) * sy


def eval_transform(
    jpeg: bytes, image_size: int, preprocess: str = "resnet", file="", offset: int = 0, draft: bool = True
) -> np.ndarray:
    """(image_size, image_size, 3) uint8: the seed's central-crop evaluation transform."""
    width, height = open_image(jpeg, file, offset).size
    img, box = _load_rgb(
        jpeg, eval_box(height, width, image_size, preprocess), image_size, draft, file, offset
    )
    return np.asarray(img.resize((image_size, image_size), Image.BILINEAR, box=box))
