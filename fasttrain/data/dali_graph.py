"""The DALI graph of fasttrain.data.dali_pipeline's loader: one epoch's pipeline reads the records,
decodes, crops, resizes, distorts the colour and normalises them as below (the per-setting pieces are
fasttrain/data/dali_ops.py). DALI itself is imported when a graph is built, not with this module.

Graph (CUDA: "mixed" nvJPEG decode and GPU ops; CPU-only mode, device_id=None: all "cpu")
    train: boxes = the record's (xmin, ymin, xmax, ymax), or [0, 0, 1, 1] when it has none
        anchor, size = random_bbox_crop(boxes, input_shape = (W, H) of the JPEG, pixel aspect ratio
            w/h in [0.75, 1.33], each side in [sqrt(0.05), 1] of the image's, intersection / box area
            >= 0.1 for some box, 100 attempts); the whole image when no window had a valid aspect
        x = image_slice(jpeg, anchor, size rounded to whole pixels, at least 1 a side: dali_ops.train_window)
            resized to S x S (bilinear with antialiasing; inception: bilinear, nearest, bicubic,
            bilinear at random, as the seed's four thread_id % 4 methods)
        inception colour (color_distort): x = clamp(x + U[-32, 32], 0, 255);
            x = hsv(x, hue + U[-72, 72] degrees, saturation * U[0.5, 1.5]);
            x = (x - mean_c(x)) * U[0.5, 1.5] + mean_c(x);  x = clamp(x, 0, 255)
        y = crop_mirror_normalize(x, flip with p = 1/2, (x - mean) / std, HWC layout, float)
    eval: the whole image decoded; the seed's eval geometry (fasttrain.data.transforms: central_crop
        0.875, sliced out first so that the resize's taps clamp at the crop's edges as TF's do, or TF
        official's truncated aspect-preserving size and central crop, a ROI of the whole image) as a
        resize ROI, shifted so that DALI's pixel-centre bilinear samples where TF1's resize_bilinear
        does, without antialiasing; y = crop_mirror_normalize(x) without flip. Against TensorFlow's
        own eval outputs (tests/test_transforms_tf.py) the difference is DALI's decoder and rounding:
        see the README.
    vgg (the ResNet seed's, fasttrain.data.vgg): side = U{256..512} (eval 256), (H', W') by its float32
        truncated rule, top = floor(U[0, 1) * (H' - S + 1)) and left likewise (eval: the central
        offsets), the whole image decoded and resized with the ROI that makes DALI's samples TF1's
        (as for eval above), no antialiasing; flip with p = 1/2 in crop_mirror_normalize.
    mean/std as fasttrain.data.normalize: inception 127.5/127.5 (y = x / 127.5 - 1); resnet
    (123.68, 116.78, 103.94)/1; vgg (123.68, 116.78, 103.94)/255. Labels: image/class/label +
    label_offset, int64, checked on the host.

Where this differs from the torch pipeline (fasttrain.data.transforms, TF's exact algorithms):
    random_bbox_crop samples each side's fraction uniformly and rejects bad aspect ratios, where TF
    samples the aspect ratio and then the height, so area and aspect ranges are TF's but their
    distributions differ; after 100 failed overlap attempts DALI keeps the best-overlapping window
    where TF takes the whole image. DALI's hsv is a linear approximation of HSV in RGB space; being
    linear it commutes with the contrast step, so the seed's two colour orderings are the same here.
"""

from __future__ import annotations

from fasttrain.config import Config
from fasttrain.data.dali_ops import distort_color, eval_images, train_window, vgg_images
from fasttrain.data.normalize import RESNET_CHANNEL_MEANS

# Decoder buffers sized for ImageNet's largest JPEGs, so nvJPEG does not reallocate mid-run (the
# values of NVIDIA's DeepLearningExamples ResNet-50 DALI pipeline).
_DEVICE_MEMORY_PADDING = 211_025_920
_HOST_MEMORY_PADDING = 140_544_512
_BOX_KEYS = (("xmin", 0.0), ("ymin", 0.0), ("xmax", 1.0), ("ymax", 1.0))
_MEAN_STD = {
    "inception": ([127.5] * 3, [127.5] * 3),
    "resnet": (list(RESNET_CHANNEL_MEANS), [1.0] * 3),
    "vgg": (list(RESNET_CHANNEL_MEANS), [255.0] * 3),  # (x - mean) / 255: the means on the [0, 1] scale
}


def _graph(
    cfg: Config, paths: list[str], index_files: list[str], training: bool, cuda: bool, dtype, box_keys: bool
):
    """DataNodes images (S, S, 3) `dtype` on the device, labels () int64 on the CPU, and in training
    the crop window (anchor (x, y) and extent (w, h), fractions of the image, as dali_ops.train_window
    has them before it rounds them to pixels; image (W, H) pixels)."""
    import nvidia.dali.fn as fn
    import nvidia.dali.math as dmath
    import nvidia.dali.tfrecord as tfrec
    from nvidia.dali import types

    features = {
        "image/encoded": tfrec.FixedLenFeature((), tfrec.string, ""),
        "image/class/label": tfrec.FixedLenFeature([1], tfrec.int64, -1),
    }
    if box_keys:
        features.update(
            {f"image/object/bbox/{k}": tfrec.VarLenFeature(tfrec.float32, d) for k, d in _BOX_KEYS}
        )
    inputs = fn.readers.tfrecord(
        path=paths, index_path=index_files, features=features, random_shuffle=False, pad_last_batch=True
    )
    jpegs = inputs["image/encoded"]
    labels = fn.reshape(inputs["image/class/label"], shape=[]) + cfg.label_offset
    size = cfg.image_size
    decoder = dict(device="mixed" if cuda else "cpu", output_type=types.RGB, adjust_orientation=False)
    if cuda:
        decoder.update(
            device_memory_padding=_DEVICE_MEMORY_PADDING,
            host_memory_padding=_HOST_MEMORY_PADDING,
            jpeg_fancy_upsampling=True,  # the CPU decoder's (and TF's) chroma upsampling
        )
    hwc = fn.peek_image_shape(jpegs, dtype=types.FLOAT, adjust_orientation=False)  # (H, W, C)
    height, width = hwc[0], hwc[1]
    gpu = (lambda node: node.gpu()) if cuda else (lambda node: node)
    crop = None

    if cfg.preprocess == "vgg":
        images, mirror, crop = vgg_images(fn, dmath, types, jpegs, decoder, height, width, size, training)
    elif training:
        if box_keys:  # an empty list becomes the whole-image box: pad to at least one entry, never more
            coords = [fn.reshape(inputs[f"image/object/bbox/{k}"], shape=[-1]) for k, _ in _BOX_KEYS]
            coords = [
                fn.pad(c, fill_value=d, axes=(0,), shape=(1,), align=(1,))
                for c, (_, d) in zip(coords, _BOX_KEYS)
            ]
            boxes = fn.stack(*coords, axis=1)
        else:  # records without the keys: the whole-image box, (xmin, ymin, xmax, ymax)
            boxes = fn.constant(fdata=[d for _, d in _BOX_KEYS], shape=[1, 4], dtype=types.FLOAT)
        anchor, extent, start, shape = train_window(fn, dmath, types, boxes, width, height)
        crop = (anchor, extent, fn.stack(width, height))
        images = fn.decoders.image_slice(
            jpegs, start, shape, normalized_anchor=False, normalized_shape=False, **decoder
        )
        interp = types.INTERP_LINEAR
        if cfg.preprocess == "inception":
            methods = [types.INTERP_LINEAR, types.INTERP_NN, types.INTERP_CUBIC, types.INTERP_LINEAR]
            interp = fn.cast(fn.random.choice([int(m) for m in methods]), dtype=types.INTERP_TYPE)
        images = fn.resize(images, size=[size, size], interp_type=interp, antialias=True)
        if cfg.color_distort and cfg.preprocess == "inception":  # Inception's, as the torch backend's
            images = distort_color(fn, dmath, types, images, gpu)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        images = fn.decoders.image(jpegs, **decoder)
        images = eval_images(fn, dmath, types, images, height, width, size, cfg.preprocess)
        mirror = 0
    mean, std = _MEAN_STD[cfg.preprocess]
    images = fn.crop_mirror_normalize(
        images, mean=mean, std=std, mirror=mirror, output_layout="HWC", dtype=dtype
    )
    return images, labels, crop
