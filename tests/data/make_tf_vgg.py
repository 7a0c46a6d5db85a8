"""Writes tests/data/tf-vgg/: what the ResNet seed's own vgg_preprocessing makes of the JPEGs in
tests/data/tf-images/ (every JPEG kind there, tiny and CMYK included). Run once, in a scratch
environment (never a dependency of the tests):

    /opt/tfvenv/bin/python tests/data/make_tf_vgg.py     # tensorflow-cpu 2.21, numpy

The seed: ucloud/uai-sdk examples/tensorflow/train/imagenet/code/, imagenet.py's parser
(decode_image(channels=3) -> convert_image_dtype(float32) -> vgg_preprocessing.preprocess_image(224,
224, is_training)) and vgg_preprocessing.py's functions, ported below to tf.compat.v1 graph mode line
for line (tf.to_float -> tf.compat.v1.to_float and the like). The random draws of preprocess_for_train
(resize_side, the two crop offsets, the flip) become placeholders fed the values in cases.json; every
other op is the seed's. TF 2.21 on the CPU, TF_ENABLE_ONEDNN_OPTS=0.

cases.json:
- "cases": per JPEG and case: file, kind, mode ("eval" or "train"), image_size S, side, top, left,
  flip, resized [H', W'] (TF's), key. S = 224 cases are the seed's own setting; S = 56 cases use the
  scaled sides (round(S * 256 / 224) = 64 for eval, [64, 128] for train), a 2-5x shrink of these
  photos (no antialiasing), where the S = 224 cases mostly enlarge them.
  Train parameters: a seeded numpy Generator draws the side (S = 224: one in [256, 300], one in
  [450, 512]; S = 56: [64, 128]), offsets uniform in [0, H' - S] x [0, W' - S], the flip alternating.
- "lattice": the row/column indices kept of a 224 x 224 output (every 4th and the last): the S = 224
  arrays are out[lattice][:, lattice] (57 x 57), so that 45 cases fit in under 1 MB; S = 56 arrays whole.
- "geometry": rows [h, w, side, new_h, new_w] of TF's _smallest_size_at_least (the seed's), for sides
  256..512 and 64..128: every (h, w, side) of a seeded random sample, plus every size whose float32
  truncation differs from exact arithmetic in a scan (those that get a 255 px short side and the like).
- "meta": versions, date, command.
reference.npz (savez_compressed): per key, the preprocessed image before _mean_image_subtraction times
255, as float16 (0.125 resolution from 128 to 255); and for S = 56 eval cases "<key>/final", the seed's
final output (means subtracted, on the [0, 1] scale), float16.
"""

import datetime
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()
v1 = tf.compat.v1

IMAGES = Path(__file__).parent / "tf-images"
OUT = Path(__file__).parent / "tf-vgg"
SEED = 27
LATTICE = list(range(0, 224, 4)) + [223]

# ---- vgg_preprocessing.py, ported (the seed's names, its order of ops)

_R_MEAN = 123.68 / 255
_G_MEAN = 116.78 / 255
_B_MEAN = 103.94 / 255


def _crop(image, offset_height, offset_width, crop_height, crop_width):
    original_shape = tf.shape(image)
    rank_assertion = tf.Assert(tf.equal(tf.rank(image), 3), ["Rank of image must be equal to 3."])
    with tf.control_dependencies([rank_assertion]):
        cropped_shape = tf.stack([crop_height, crop_width, original_shape[2]])
    size_assertion = tf.Assert(
        tf.logical_and(
            tf.greater_equal(original_shape[0], crop_height), tf.greater_equal(original_shape[1], crop_width)
        ),
        ["Crop size greater than the image size."],
    )
    offsets = v1.to_int32(tf.stack([offset_height, offset_width, 0]))
    with tf.control_dependencies([size_assertion]):
        image = tf.slice(image, offsets, cropped_shape)
    return tf.reshape(image, cropped_shape)


def _random_crop_at(image, crop_height, crop_width, offset_height, offset_width):
    """_random_crop with its two random_uniform draws (maxval H - crop + 1) fed as offsets."""
    image_shape = tf.shape(image)
    crop_size_assert = tf.Assert(
        tf.logical_and(
            tf.greater_equal(image_shape[0], crop_height), tf.greater_equal(image_shape[1], crop_width)
        ),
        ["Crop size greater than the image size."],
    )
    with tf.control_dependencies([crop_size_assert]):
        return _crop(image, offset_height, offset_width, crop_height, crop_width)


def _central_crop(image, crop_height, crop_width):
    image_height = tf.shape(image)[0]
    image_width = tf.shape(image)[1]
    offset_height = (image_height - crop_height) / 2  # the seed's true division (from __future__)
    offset_width = (image_width - crop_width) / 2
    return _crop(image, offset_height, offset_width, crop_height, crop_width)


def _mean_image_subtraction(image, means):
    channels = tf.split(axis=2, num_or_size_splits=3, value=image)
    for i in range(3):
        channels[i] -= means[i]
    return tf.concat(axis=2, values=channels)


def _smallest_size_at_least(height, width, smallest_side):
    smallest_side = tf.convert_to_tensor(smallest_side, dtype=tf.int32)
    height = v1.to_float(height)
    width = v1.to_float(width)
    smallest_side = v1.to_float(smallest_side)
    scale = tf.cond(tf.greater(height, width), lambda: smallest_side / width, lambda: smallest_side / height)
    new_height = v1.to_int32(height * scale)
    new_width = v1.to_int32(width * scale)
    return new_height, new_width


def _aspect_preserving_resize(image, smallest_side):
    smallest_side = tf.convert_to_tensor(smallest_side, dtype=tf.int32)
    shape = tf.shape(image)
    new_height, new_width = _smallest_size_at_least(shape[0], shape[1], smallest_side)
    image = tf.expand_dims(image, 0)
    resized_image = v1.image.resize_bilinear(image, [new_height, new_width], align_corners=False)
    resized_image = tf.squeeze(resized_image)
    resized_image.set_shape([None, None, 3])
    return resized_image, tf.stack([new_height, new_width])


def preprocess_for_train(image, output_height, output_width, resize_side, top, left, flip):
    """The seed's preprocess_for_train; returns (before the means, final, resized shape)."""
    image, resized = _aspect_preserving_resize(image, resize_side)
    image = _random_crop_at(image, output_height, output_width, top, left)
    image.set_shape([output_height, output_width, 3])
    image = v1.to_float(image)
    image = tf.cond(flip, lambda: tf.reverse(image, [1]), lambda: image)  # random_flip_left_right's branch
    return image, _mean_image_subtraction(image, [_R_MEAN, _G_MEAN, _B_MEAN]), resized


def preprocess_for_eval(image, output_height, output_width, resize_side):
    image, resized = _aspect_preserving_resize(image, resize_side)
    image = _central_crop(image, output_height, output_width)
    image.set_shape([output_height, output_width, 3])
    image = v1.to_float(image)
    return image, _mean_image_subtraction(image, [_R_MEAN, _G_MEAN, _B_MEAN]), resized


def parser_image(jpeg):
    """imagenet.py's parser, up to preprocess_image."""
    image = tf.image.decode_image(tf.reshape(jpeg, shape=[]), 3)
    return tf.image.convert_image_dtype(image, dtype=tf.float32)


# ---- the cases


def _graph():
    g = {k: v1.placeholder(tf.int32, [], k) for k in ("size", "side", "top", "left")}
    g["jpeg"] = v1.placeholder(tf.string, [], "jpeg")
    g["flip"] = v1.placeholder(tf.bool, [], "flip")
    outs = {}
    for size in (224, 56):
        image = parser_image(g["jpeg"])
        outs["train", size] = preprocess_for_train(
            image, size, size, g["side"], g["top"], g["left"], g["flip"]
        )
        outs["eval", size] = preprocess_for_eval(parser_image(g["jpeg"]), size, size, g["side"])
    return g, outs


def _kinds():
    cases = json.loads((IMAGES / "cases.json").read_text())["decode"]
    return [(c["file"], c["kind"]) for c in cases]


def run_cases(sess, g, outs, arrays):
    rng = np.random.default_rng(SEED)
    size_of = v1.placeholder(tf.string, [])
    shape_op = tf.shape(tf.image.decode_image(size_of, 3))
    cases = []
    for file, kind in _kinds():
        jpeg = (IMAGES / file).read_bytes()
        h, w = (int(v) for v in sess.run(shape_op, {size_of: jpeg})[:2])
        plans = [("eval", 224, 256), ("train", 224, int(rng.integers(256, 301)))]
        plans += [
            ("train", 224, int(rng.integers(450, 513))),
            ("eval", 56, 64),
            ("train", 56, int(rng.integers(64, 129))),
        ]
        for n, (mode, size, side) in enumerate(plans):
            new_h, new_w = _smallest_size(h, w, side)
            top = int(rng.integers(0, new_h - size + 1)) if mode == "train" else 0
            left = int(rng.integers(0, new_w - size + 1)) if mode == "train" else 0
            flip = mode == "train" and n % 2 == 1
            feed = {g["jpeg"]: jpeg, g["side"]: side, g["top"]: top, g["left"]: left, g["flip"]: flip}
            before, final, resized = sess.run(outs[mode, size], feed)
            if mode == "eval":
                top, left = (int(resized[0]) - size) // 2, (int(resized[1]) - size) // 2
            key = f"{mode}/{size}/{file}/{n}"
            kept = before * 255.0
            if size == 224:
                kept = kept[LATTICE][:, LATTICE]
            arrays[key] = kept.astype(np.float16)
            if mode == "eval" and size == 56:
                arrays[key + "/final"] = final.astype(np.float16)
            cases.append(
                dict(file=file, kind=kind, mode=mode, image_size=size, side=side, top=top, left=left,
                     flip=flip, resized=[int(v) for v in resized], key=key)
            )  # fmt: skip
    return cases


_SIZE = {}


def _smallest_size(h, w, side):
    """TF's _smallest_size_at_least for ints (a small graph of its own, evaluated in the session)."""
    return _SIZE["sess"].run(_SIZE["op"], {_SIZE["h"]: h, _SIZE["w"]: w, _SIZE["s"]: side})


def geometry(sess):
    rng = np.random.default_rng(SEED + 1)
    hs = rng.integers(1, 2001, 400)
    ws = rng.integers(1, 2001, 400)
    sides = np.concatenate([rng.integers(256, 513, 400)[:300], rng.integers(64, 129, 100)])
    rows = [[int(h), int(w), int(s)] for h, w, s in zip(hs, ws, sides)]
    # a scan for truncation (numpy float32, only to choose sizes; TF gives the numbers): short sides
    # 1..2000 x every side, keeping one long side each where the float32 rule and exact math differ
    short = np.arange(1, 2001, dtype=np.float32)[:, None]
    for lo, hi in ((256, 513), (64, 129)):
        side = np.arange(lo, hi, dtype=np.float32)[None, :]
        trunc = (short * (side / short)).astype(np.int64)
        for i, j in zip(*np.nonzero(trunc != side.astype(np.int64))):
            if (i + j) % 29 == 0:  # one in 29 of them: about 1,000 rows
                s, long = int(short[i, 0]), int(rng.integers(int(short[i, 0]), 2001))
                rows.append([s, long, int(side[0, j])] if (i + j) % 2 else [long, s, int(side[0, j])])
    out = []
    for h, w, s in rows:
        new_h, new_w = _smallest_size(h, w, s)
        out.append([h, w, s, int(new_h), int(new_w)])
    return out


def main():
    OUT.mkdir(exist_ok=True)
    g, outs = _graph()
    h, w, s = (v1.placeholder(tf.int32, []) for _ in range(3))
    op = tf.stack(_smallest_size_at_least(h, w, s))
    with v1.Session() as sess:
        _SIZE.update(sess=sess, op=op, h=h, w=w, s=s)
        arrays = {}
        cases = run_cases(sess, g, outs, arrays)
        geo = geometry(sess)
    meta = dict(
        tensorflow=tf.__version__, numpy=np.__version__, python=sys.version.split()[0],
        TF_ENABLE_ONEDNN_OPTS=os.environ["TF_ENABLE_ONEDNN_OPTS"], date=datetime.date.today().isoformat(),
        command="/opt/tfvenv/bin/python tests/data/make_tf_vgg.py",
    )  # fmt: skip
    text = json.dumps(dict(cases=cases, lattice=LATTICE, geometry=geo, meta=meta), indent=1)
    text = re.sub(
        r"\[[^\[\]{}]*\]",
        lambda m: re.sub(r"\s+", " ", m.group()).replace("[ ", "[").replace(" ]", "]"),
        text,
    )
    (OUT / "cases.json").write_text(text + "\n")
    np.savez_compressed(OUT / "reference.npz", **arrays)


if __name__ == "__main__":
    main()
