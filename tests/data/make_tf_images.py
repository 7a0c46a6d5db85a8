"""Writes tests/data/tf-images/: real photographs in every JPEG kind ImageNet shards hold, and what
TensorFlow makes of them. Run once, in a scratch environment (never a dependency of the tests):

    /tmp/tfenv/bin/python tests/data/make_tf_images.py   # tensorflow-cpu 2.21, scikit-image 0.26,
                                                         # simplejpeg, Pillow; cjpeg (libjpeg-turbo-progs)

Deterministic: a seeded numpy Generator draws every random choice; encoders of fixed versions.

JPEGs `<name>.jpg`: tests/data/tf_image_jpegs.py writes them (the photos, their kinds, encoders and
sizes). TF 2.21 on the CPU, TF_ENABLE_ONEDNN_OPTS=0, computes everything in cases.json:
- "decode", every file: shape, sha256 of `tf.io.decode_jpeg(data, channels=3)` (uint8, C order),
  per-channel sums; "simplejpeg_equal": simplejpeg.decode_jpeg(fastdct=True, fastupsample=False) gave
  the same array (CMYK: colorspace="CMYK", then TF's jpeg_mem.cc formula r = k * c // 255 after an
  Adobe marker, r = (255 - k) * (255 - c) // 255 without).
- "decode_crop", 3 windows [top, left, h, w] per non-decode-only file: `tf.image.decode_and_crop_jpeg(
  data, window, channels=3)`; "vs_crop_of_decode": mean/max |difference| to slicing decode_jpeg's output
  (libjpeg-turbo's jpeg_crop_scanline makes the decoded region's ends edges for the fancy chroma
  upsampling: with 4:2:x chroma only column 0, when left > 0 is a multiple of 16, and column w - 1,
  when left + w < width is even, can differ; checked on 150 random windows per file, up to 31 levels).
- "eval", image_size S = 56, every photo except the CMYK ones, the small ones too, graph functions with
  dynamic shapes like the seeds':
  inception (research/inception/inception/image_processing.py, decode_jpeg + eval_image):
    decode_jpeg(channels=3) -> convert_image_dtype(float32) -> central_crop(0.875) ->
    compat.v1.image.resize_bilinear([S, S], align_corners=False); stored * 255 (not the seed's final
    (x - 0.5) * 2).
  resnet (official/resnet/imagenet_preprocessing.py, eval branch): decode_jpeg(channels=3) ->
    _aspect_preserving_resize to R = round(S * 256 / 224) = 64 (_smallest_size_at_least in float32,
    cast to int32 truncates; "resized_shape") -> compat.v1.image.resize_images(BILINEAR,
    align_corners=False) -> _central_crop(S, S); stored as is (0..255, no mean subtraction).
- "train", S = 56, the random draws fixed: window, flip, method and float32 colour parameters (entering
  TF as float32 constants), from the seeded Generator:
  resnet (_decode_crop_and_flip + _resize_image): decode_and_crop_jpeg(window) -> flip_left_right if
    flip -> compat.v1.image.resize_images([S, S], BILINEAR, align_corners=False); stored as is.
  inception (distort_image with thread_id's choices fixed): decode_jpeg -> convert_image_dtype(float32)
    -> tf.slice(window) -> compat.v1.image.resize_images([S, S], method, align_corners=False) -> flip if
    flip -> with colour: adjust_brightness, then ordering 0: adjust_saturation, adjust_hue,
    adjust_contrast, ordering 1: adjust_contrast, adjust_saturation, adjust_hue (what random_brightness
    etc. call with the drawn value) -> clip_by_value(0, 1). The seed clips only inside distort_color,
    so cases without colour are stored unclipped (bicubic overshoots). Stored * 255.
- "geometry": "resnet" rows [h, w, R, new_h, new_w] of _smallest_size_at_least for R = 256 and 64 and
  "inception" rows [h, w, top, left, crop_h, crop_w] read off central_crop(0.875) of an arange image,
  over ~330 sizes in 1..2000 (see _geometry_sizes).
- "meta": versions, date, command.
reference.npz (savez_compressed): decode_crop arrays uint8; eval and train outputs (S, S, 3) as float16
of the 0..255 float, which keeps 0.125 resolution from 128 to 255 (0.0625 from 64 to 128).

Deviations from the seeds: none in the ops. One revision of imagenet_preprocessing.py has _resize_image
call tf.image.resize_with_pad; this follows the revisions calling tf.compat.v1.image.resize (BILINEAR,
align_corners=False), the same op as the v1 resize_images.
"""

import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import PIL  # noqa: E402
import simplejpeg  # noqa: E402
import skimage  # noqa: E402
import tensorflow as tf  # noqa: E402
from tf_image_jpegs import DECODE_ONLY, SMALL, write_jpegs  # noqa: E402

OUT = Path(__file__).parent / "tf-images"
S = 56  # image_size of every eval and train case
SEED = 17
METHODS = {  # tf.compat.v1.image.ResizeMethod by the seed's thread_id % 4
    "bilinear": tf.compat.v1.image.ResizeMethod.BILINEAR,
    "nearest": tf.compat.v1.image.ResizeMethod.NEAREST_NEIGHBOR,
    "bicubic": tf.compat.v1.image.ResizeMethod.BICUBIC,
    "area": tf.compat.v1.image.ResizeMethod.AREA,
}

# ---- TensorFlow, as the seeds call it (graph functions with dynamic shapes, like the seeds' graphs)

_JPEG = tf.TensorSpec([], tf.string)
_WINDOW = tf.TensorSpec([4], tf.int32)


@tf.function(input_signature=[tf.TensorSpec([], tf.int32)] * 3)
def tf_smallest_size_at_least(height, width, resize_min):
    resize_min = tf.cast(resize_min, tf.float32)
    height, width = tf.cast(height, tf.float32), tf.cast(width, tf.float32)
    scale_ratio = resize_min / tf.minimum(height, width)
    return tf.cast(height * scale_ratio, tf.int32), tf.cast(width * scale_ratio, tf.int32)


@tf.function(input_signature=[tf.TensorSpec([None, None, 1], tf.int32)])
def tf_central_crop(image):
    return tf.image.central_crop(image, central_fraction=0.875)


@tf.function(input_signature=[_JPEG, tf.TensorSpec([], tf.int32)])
def tf_eval_inception(data, size):
    image = tf.image.convert_image_dtype(tf.io.decode_jpeg(data, channels=3), tf.float32)
    image = tf.image.central_crop(image, central_fraction=0.875)
    image = tf.compat.v1.image.resize_bilinear(image[None], [size, size], align_corners=False)
    return image[0] * 255.0


@tf.function(input_signature=[_JPEG, tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int32)])
def tf_eval_resnet(data, size, resize_min):
    image = tf.io.decode_jpeg(data, channels=3)
    shape = tf.shape(image)
    new_h, new_w = tf_smallest_size_at_least(shape[0], shape[1], resize_min)
    image = tf.compat.v1.image.resize_images(
        image, [new_h, new_w], method=tf.compat.v1.image.ResizeMethod.BILINEAR, align_corners=False
    )
    shape = tf.shape(image)
    top, left = (shape[0] - size) // 2, (shape[1] - size) // 2
    return tf.slice(image, [top, left, 0], [size, size, -1]), tf.stack([new_h, new_w])


@tf.function(input_signature=[_JPEG, _WINDOW, tf.TensorSpec([], tf.bool), tf.TensorSpec([], tf.int32)])
def tf_train_resnet(data, window, flip, size):
    image = tf.image.decode_and_crop_jpeg(data, window, channels=3)
    image = tf.cond(flip, lambda: tf.image.flip_left_right(image), lambda: image)
    return tf.compat.v1.image.resize_images(
        image, [size, size], method=tf.compat.v1.image.ResizeMethod.BILINEAR, align_corners=False
    )


def tf_train_inception(data, window, flip, method, color, size):
    """distort_image with its random draws fixed; color is None or the drawn float32 parameters."""
    image = tf.image.convert_image_dtype(tf.io.decode_jpeg(data, channels=3), tf.float32)
    image = tf.slice(image, [window[0], window[1], 0], [window[2], window[3], 3])
    image = tf.compat.v1.image.resize_images(image, [size, size], method=METHODS[method], align_corners=False)
    if flip:
        image = tf.image.flip_left_right(image)
    if color is not None:
        f32 = {k: tf.constant(np.float32(v), tf.float32) for k, v in color.items() if k != "ordering"}
        image = tf.image.adjust_brightness(image, f32["brightness"])
        if color["ordering"] == 0:
            image = tf.image.adjust_saturation(image, f32["saturation"])
            image = tf.image.adjust_hue(image, f32["hue"])
            image = tf.image.adjust_contrast(image, f32["contrast"])
        else:
            image = tf.image.adjust_contrast(image, f32["contrast"])
            image = tf.image.adjust_saturation(image, f32["saturation"])
            image = tf.image.adjust_hue(image, f32["hue"])
        image = tf.clip_by_value(image, 0.0, 1.0)
    return image * 255.0


def tf_decode(data):
    return tf.io.decode_jpeg(data, channels=3).numpy()


# ---- the cases


def _simplejpeg_decode(kind, data):
    """simplejpeg's libjpeg-turbo with the fast IDCT; CMYK through TF's formula (jpeg_mem.cc)."""
    if kind.startswith("cmyk"):
        cmyk = simplejpeg.decode_jpeg(data, colorspace="CMYK", fastdct=True, fastupsample=False)
        cmyk = cmyk.astype(np.int32)
        if kind == "cmyk-plain":  # no saw_Adobe_marker: r = (255 - k) * (255 - c) / 255
            cmyk = 255 - cmyk
        # saw_Adobe_marker: r = k * c / 255 (integer division) on libjpeg's (inverted) CMYK output
        return (cmyk[..., :3] * cmyk[..., 3:] // 255).astype(np.uint8)
    return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=True, fastupsample=False)


def decode_cases(jpegs):
    cases = []
    for name, (kind, data) in jpegs.items():
        try:
            image = tf_decode(data)
        except tf.errors.OpError as e:
            cases.append({"file": f"{name}.jpg", "kind": kind, "error": e.message})
            continue
        mine = _simplejpeg_decode(kind, data)
        cases.append(
            {
                "file": f"{name}.jpg",
                "kind": kind,
                "shape": list(image.shape),
                "sha256": hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest(),
                "sum": [int(s) for s in image.astype(np.int64).sum(axis=(0, 1))],
                "simplejpeg_equal": bool(mine.shape == image.shape and (mine == image).all()),
            }
        )
    return cases


def _crop_windows(h, w):
    """One touching the bottom-right corner, one small MCU-aligned interior, one at odd offsets."""
    return [
        [h - 33, w - 45, 33, 45],
        [16 * (h // 32), 16 * (w // 32), 20, 30],
        [(h // 3) | 1, (w // 3) | 1, 41, 51],
    ]


def decode_crop_cases(jpegs, arrays):
    cases = []
    for name, (kind, data) in jpegs.items():
        if kind in DECODE_ONLY | SMALL:
            continue
        full = tf_decode(data)
        for i, window in enumerate(_crop_windows(*full.shape[:2])):
            key = f"decode_crop/{name}/{i}"
            crop = tf.image.decode_and_crop_jpeg(data, tf.constant(window, tf.int32), channels=3).numpy()
            top, left, h, w = window
            diff = np.abs(crop.astype(np.int32) - full[top : top + h, left : left + w])
            arrays[key] = crop
            vs = {"mean_abs": round(float(diff.mean()), 4), "max_abs": int(diff.max())}
            cases.append({"file": f"{name}.jpg", "window": window, "key": key, "vs_crop_of_decode": vs})
    return cases


def _photos(jpegs):
    """The names train uses: every photo but the decode-only, small and CMYK files."""
    return [n for n, (kind, _) in jpegs.items() if kind not in DECODE_ONLY | SMALL | {"cmyk", "cmyk-plain"}]


def eval_cases(jpegs, arrays):
    cases = []
    resize_min = round(S * 256 / 224)  # 64: the seed's 256 for 224 scaled to S
    for name in _photos(jpegs) + [n for n, (kind, _) in jpegs.items() if kind in SMALL]:
        data = jpegs[name][1]
        key = f"eval/inception/{name}"
        arrays[key] = tf_eval_inception(data, S).numpy().astype(np.float16)
        cases.append({"file": f"{name}.jpg", "preprocess": "inception", "image_size": S, "key": key})
        key = f"eval/resnet/{name}"
        image, resized = tf_eval_resnet(data, S, resize_min)
        arrays[key] = image.numpy().astype(np.float16)
        case = {"file": f"{name}.jpg", "preprocess": "resnet", "image_size": S, "key": key}
        cases.append({**case, "resize_min": resize_min, "resized_shape": [int(v) for v in resized.numpy()]})
    return cases


def _window(rng, h, w, size_class):
    """A random crop window [top, left, ch, cw]: "up" smaller than S both ways, "mid" either way of S,
    "down" at least 0.6 of the image (a 3-7x shrink to S)."""
    lo, hi = {"up": (8, S - 1), "mid": (24, 160), "down": (None, None)}[size_class]
    if size_class == "down":
        ch, cw = int(rng.integers(int(0.6 * h), h + 1)), int(rng.integers(int(0.6 * w), w + 1))
    else:
        ch, cw = int(rng.integers(lo, min(hi, h) + 1)), int(rng.integers(lo, min(hi, w) + 1))
    return [int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw]


def _color(rng, ordering):
    f32 = lambda lo, hi: float(np.float32(rng.uniform(lo, hi)))  # exactly representable in JSON
    return {
        "ordering": ordering,
        "brightness": f32(-32 / 255, 32 / 255),
        "saturation": f32(0.5, 1.5),
        "hue": f32(-0.2, 0.2),
        "contrast": f32(0.5, 1.5),
    }


def train_cases(jpegs, arrays):
    rng = np.random.default_rng(SEED)
    classes = ["up", "mid", "down"]
    cases = []
    for i, name in enumerate(_photos(jpegs)):
        data = jpegs[name][1]
        h, w = tf_decode(data).shape[:2]
        window, flip = _window(rng, h, w, classes[i % 3]), bool(rng.integers(2))
        key = f"train/resnet/{name}"
        out = tf_train_resnet(data, tf.constant(window, tf.int32), flip, S)
        arrays[key] = out.numpy().astype(np.float16)
        case = {"file": f"{name}.jpg", "preprocess": "resnet", "image_size": S, "window": window}
        cases.append({**case, "flip": flip, "method": "bilinear", "color": None, "key": key})
        for k, method in enumerate(METHODS):
            window, flip = _window(rng, h, w, classes[(i + k) % 3]), bool(rng.integers(2))
            slot = (i + k) % 4  # colour on two of the four methods, both orderings, rotating over files
            color = _color(rng, slot) if slot < 2 else None
            key = f"train/inception/{name}/{method}"
            arrays[key] = tf_train_inception(data, window, flip, method, color, S).numpy().astype(np.float16)
            case = {"file": f"{name}.jpg", "preprocess": "inception", "image_size": S, "window": window}
            cases.append({**case, "flip": flip, "method": method, "color": color, "key": key})
    return cases


def _geometry_sizes():
    """(h, w) pairs: every short side in 1..2000 that float32 truncation leaves at R - 1 (the same
    sides for R = 256 and 64, powers of two apart), long sides it truncates one below exact
    arithmetic, extremes, and random sizes."""
    rng = np.random.default_rng(SEED + 1)
    side = np.arange(1, 2001, dtype=np.float32)
    short = (side * (np.float32(256) / side)).astype(np.int32)  # only picks sizes; TF gives the numbers
    sizes = []
    for j, s in enumerate(int(v) for v in np.nonzero(short != 256)[0] + 1):
        long = int(rng.integers(s, 2001))
        sizes.append((s, long) if j % 2 else (long, s))
    found = 0
    for s in rng.permutation(np.arange(2, 2001))[:400]:
        longs = np.arange(s, 2001)
        trunc = (longs.astype(np.float32) * (np.float32(256) / np.float32(s))).astype(np.int64)
        off = longs[trunc != longs * 256 // s]
        if len(off):
            sizes.append((int(s), int(off[0])) if found % 2 else (int(off[0]), int(s)))
            found += 1
        if found == 20:
            break
    sizes += [(332, 500), (500, 332), (1, 1), (1, 2000), (2000, 1), (2000, 2000), (224, 224), (256, 256)]
    sizes += [(int(a), int(b)) for a, b in rng.integers(1, 2001, size=(30, 2))]
    return list(dict.fromkeys(sizes))


def geometry_cases():
    resnet, inception = [], []
    for h, w in _geometry_sizes():
        for r in (256, 64):
            new_h, new_w = tf_smallest_size_at_least(h, w, r)
            resnet.append([h, w, r, int(new_h), int(new_w)])
        where = tf_central_crop(tf.reshape(tf.range(h * w, dtype=tf.int32), [h, w, 1])).numpy()
        first = int(where[0, 0, 0])
        inception.append([h, w, first // w, first % w, where.shape[0], where.shape[1]])
    return {"resnet": resnet, "inception": inception}


def _meta():
    cjpeg = subprocess.run(["cjpeg", "-version"], capture_output=True, text=True).stderr.strip()
    versions = {"tensorflow": tf, "numpy": np, "simplejpeg": simplejpeg, "skimage": skimage, "pillow": PIL}
    return {
        **{name: module.__version__ for name, module in versions.items()},
        "cjpeg": cjpeg,
        "python": sys.version.split()[0],
        "TF_ENABLE_ONEDNN_OPTS": os.environ["TF_ENABLE_ONEDNN_OPTS"],
        "date": datetime.date.today().isoformat(),
        "command": "/tmp/tfenv/bin/python tests/data/make_tf_images.py",
    }


def main():
    OUT.mkdir(exist_ok=True)
    for old in OUT.glob("*.jpg"):
        old.unlink()
    jpegs = write_jpegs(OUT)
    arrays = {}
    cases = {
        "decode": decode_cases(jpegs),
        "decode_crop": decode_crop_cases(jpegs, arrays),
        "eval": eval_cases(jpegs, arrays),
        "train": train_cases(jpegs, arrays),
        "geometry": geometry_cases(),
        "meta": _meta(),
    }
    text = json.dumps(cases, indent=1)
    # lists of numbers or strings on one line each (a geometry row, a window, a shape)
    text = re.sub(
        r"\[[^\[\]{}]*\]",
        lambda m: re.sub(r"\s+", " ", m.group()).replace("[ ", "[").replace(" ]", "]"),
        text,
    )
    (OUT / "cases.json").write_text(text + "\n")
    np.savez_compressed(OUT / "reference.npz", **arrays)


if __name__ == "__main__":
    main()
