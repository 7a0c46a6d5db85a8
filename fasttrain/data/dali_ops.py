"""The per-setting pieces of the DALI graph (fasttrain/data/dali_graph.py, whose docstring states
their equations): the train crop window, the Inception seed's colour distortion, the eval crop and
resize that make DALI's resize TF1's, and the ResNet seed's vgg geometry. Each takes DALI's `fn`,
`math` and `types` modules from the graph that calls it, so this module imports no DALI itself.
"""

from __future__ import annotations

import math


def distort_color(fn, dmath, types, images, gpu):
    """The seed's colour distortion on [0, 255] floats (dali_graph.py's docstring)."""
    x = fn.cast(images, dtype=types.FLOAT)
    x = dmath.clamp(x + gpu(fn.random.uniform(range=[-32.0, 32.0])), 0.0, 255.0)
    x = fn.hsv(
        x,
        hue=fn.random.uniform(range=[-72.0, 72.0]),  # TF's hue delta 0.2 of a turn
        saturation=fn.random.uniform(range=[0.5, 1.5]),
        dtype=types.FLOAT,
    )
    mean = fn.reductions.mean(x, axes=[0, 1])  # (3,) per image, as tf.image.adjust_contrast
    x = (x - mean) * gpu(fn.random.uniform(range=[0.5, 1.5])) + mean
    return dmath.clamp(x, 0.0, 255.0)


def train_window(fn, dmath, types, boxes, width, height):
    """(anchor, extent, start, shape): the seeds' distorted bounding-box crop of a (W, H) image with
    boxes (n, 4) xyXY fractions (dali_graph.py's docstring). anchor (x, y) and extent (w, h) are
    random_bbox_crop's window, fractions of the image (the whole image for an empty one); start (x, y)
    and shape (w, h), int32, the same window in whole pixels for decoders.image_slice, at least one
    pixel a side and inside the image.

    An empty extent (no window with a valid aspect ratio, very wide or tall images) is the whole
    image. Unlike TF's: `scaling` bounds each side at sqrt(0.05) where TF bounds the area at 0.05, so
    past about 6:1 no window fits and DALI takes the whole image where TF finds a square one; and a
    zero-area box counts as covered by any window, where TF skips it (README, input pipelines).

    DALI would round the fractions to pixels itself, and a window of a tiny image (1x1, 3x2: the side
    fraction at least sqrt(0.05) = 0.22) could round to no pixel, which fails its decode ("Invalid crop
    window"); TF's sample_distorted_bounding_box draws whole pixels, at least one a side.
    """
    anchor, extent, _ = fn.random_bbox_crop(
        boxes,
        input_shape=fn.cast(fn.stack(width, height), dtype=types.INT32),
        bbox_layout="xyXY",
        aspect_ratio=[0.75, 1.33],
        scaling=[math.sqrt(0.05), 1.0],
        thresholds=[0.1],
        threshold_type="overlap",
        all_boxes_above_threshold=False,
        bbox_prune_threshold=0.1,  # keep the covered box, so the window is not rejected for it
        allow_no_crop=False,
        num_attempts=100,
        total_num_attempts=100,
        quiet=True,
    )
    extent = extent + fn.cast(extent <= 0.0, dtype=types.FLOAT)  # an empty window: the whole image
    start, shape = [], []
    for a, e, full in ((anchor[0], extent[0], width), (anchor[1], extent[1], height)):
        pixels = dmath.max(dmath.floor(e * full + 0.5), 1.0)
        start.append(dmath.min(dmath.floor(a * full + 0.5), full - pixels))
        shape.append(pixels)
    as_int32 = [fn.cast(fn.stack(*v), dtype=types.INT32) for v in (start, shape)]
    return anchor, extent, *as_int32


def eval_images(fn, dmath, types, images, height, width, size: int, preprocess: str):
    """The decoded images (H, W, 3) resized as the seed's eval does (dali_graph.py's docstring):
    (S, S, 3).

    TF1's resize samples source index y * scale (no half-pixel offset); DALI samples at pixel centres,
    index roi_start + (y + 0.5) * scale - 0.5. Starting the ROI 0.5 * (1 - scale) later makes the two
    the same. Both clamp the taps to the resized tensor's last row and column, and DALI's resize
    clamps them to its input, not to the ROI: so Inception's central crop is cut out first, as TF's
    central_crop cuts it before resize_bilinear. A ROI on the whole image read rows and columns
    beyond the crop wherever the crop is upscaled (a central crop under S pixels on a side), up to
    139 levels from TF in the last columns of a 20x15 image at S = 299.
    """
    if preprocess == "inception":
        # tf.image.central_crop(image, 0.875): offset int((H - 0.875 H) / 2), size H - 2 * offset
        top = dmath.floor((height - height * 0.875) / 2)
        left = dmath.floor((width - width * 0.875) / 2)
        height, width = height - 2 * top, width - 2 * left
        images = fn.slice(
            images,
            fn.stack(top, left),
            fn.stack(height, width),
            axis_names="HW",
            normalized_anchor=False,
            normalized_shape=False,
        )
        sy, sx = height / size, width / size
        top, left = 0.0, 0.0
    else:
        # TF official's _smallest_size_at_least: float32 scale, the new size truncated. The central
        # crop of the resized image is a ROI: its taps clamp to the whole resized image, as TF's do.
        ratio = float(round(size * 256 / 224)) / dmath.min(height, width)
        new_h, new_w = dmath.floor(height * ratio), dmath.floor(width * ratio)
        sy, sx = height / new_h, width / new_w  # source pixels per resized pixel
        top, left = dmath.floor((new_h - size) / 2) * sy, dmath.floor((new_w - size) / 2) * sx
    top, left = top + 0.5 * (1 - sy), left + 0.5 * (1 - sx)
    return fn.resize(
        images,
        size=[size, size],
        roi_start=fn.stack(top, left),
        roi_end=fn.stack(top + size * sy, left + size * sx),
        interp_type=types.INTERP_LINEAR,
        antialias=False,  # TF1's resize_bilinear has none: 2 x 2 taps whatever the scale
    )


def vgg_images(fn, dmath, types, jpegs, decoder, height, width, size: int, training: bool):
    """The ResNet seed's vgg_preprocessing geometry (dali_graph.py's docstring): (images, mirror,
    crop), crop = (side, top, left, flip) per sample, for tests. Every step in float32, as TF's
    _smallest_size_at_least."""
    from fasttrain.data.vgg import resize_sides

    lo, hi, eval_side = resize_sides(size)
    if training:
        side = fn.random.uniform(values=[float(v) for v in range(lo, hi + 1)])
    else:
        side = fn.cast(eval_side, dtype=types.FLOAT)
    ratio = side / dmath.min(height, width)
    new_h, new_w = dmath.floor(height * ratio), dmath.floor(width * ratio)
    if training:
        top = dmath.min(dmath.floor(fn.random.uniform(range=[0.0, 1.0]) * (new_h - size + 1)), new_h - size)
        left = dmath.min(dmath.floor(fn.random.uniform(range=[0.0, 1.0]) * (new_w - size + 1)), new_w - size)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        top, left, mirror = dmath.floor((new_h - size) / 2), dmath.floor((new_w - size) / 2), 0
    sy, sx = height / new_h, width / new_w  # source pixels per resized pixel
    # TF1 samples y * sy from the resized row y = top + i; DALI samples roi_start + (i + 0.5) * sy - 0.5.
    y0, x0 = top * sy + 0.5 * (1 - sy), left * sx + 0.5 * (1 - sx)
    images = fn.resize(
        fn.decoders.image(jpegs, **decoder),
        size=[size, size],
        roi_start=fn.stack(y0, x0),
        roi_end=fn.stack(y0 + size * sy, x0 + size * sx),
        interp_type=types.INTERP_LINEAR,
        antialias=False,  # TF1's resize_bilinear: 2 x 2 taps at any scale
    )
    flip = fn.cast(mirror, dtype=types.FLOAT) if training else fn.cast(0, dtype=types.FLOAT)
    return images, mirror, (fn.stack(side, top, left, flip),)
