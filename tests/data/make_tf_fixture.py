"""Writes tests/data/tf-written/train-00000-of-00001 with TensorFlow itself (run once; needs tensorflow).

The Examples are built exactly like TensorFlow models' build_imagenet_data.py `_convert_to_example`
(TF 2.21's tf.io.TFRecordWriter and tf.train.Example), so the file is an independent reference for
fasttrain's reader: tests/test_data_imagenet.py checks every field read back.
"""

from pathlib import Path

import numpy as np
import tensorflow as tf


def _float(v):
    return tf.train.Feature(float_list=tf.train.FloatList(value=v))


def _int(v):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=v))


def _bytes(v):
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))


out = Path(__file__).parent / "tf-written"
out.mkdir(exist_ok=True)
with tf.io.TFRecordWriter(str(out / "train-00000-of-00001")) as writer:
    for k in range(3):
        image = (np.random.RandomState(k).rand(6 + k, 8, 3) * 255).astype(np.uint8)
        boxes = [[0.1 * (j + 1), 0.2, 0.5, 0.9] for j in range(k)]  # xmin, ymin, xmax, ymax
        feature = {
            "image/height": _int([6 + k]),
            "image/width": _int([8]),
            "image/colorspace": _bytes(b"RGB"),
            "image/channels": _int([3]),
            "image/class/label": _int([10 * k + 1]),
            "image/class/synset": _bytes(b"n0144%d" % k),
            "image/class/text": _bytes(b"tench %d" % k),
            "image/object/bbox/xmin": _float([b[0] for b in boxes]),
            "image/object/bbox/xmax": _float([b[2] for b in boxes]),
            "image/object/bbox/ymin": _float([b[1] for b in boxes]),
            "image/object/bbox/ymax": _float([b[3] for b in boxes]),
            "image/object/bbox/label": _int([10 * k + 1] * len(boxes)),
            "image/format": _bytes(b"JPEG"),
            "image/filename": _bytes(b"n0144%d_%d.JPEG" % (k, k)),
            "image/encoded": _bytes(tf.io.encode_jpeg(image).numpy()),
        }
        writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
