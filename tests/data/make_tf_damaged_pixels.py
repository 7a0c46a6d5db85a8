"""Writes tests/data/tf-build/damaged/tf-pixels.npz and tf-crops.json: what TensorFlow's decode_jpeg and
decode_and_crop_jpeg (channels=3, the training path's decodes) make of each damaged JPEG that
make_tf_build.py wrote, so the loader's decodes can be held to TensorFlow's on broken files too (which
files decode at all, and their pixels). Run once, in a scratch environment (TensorFlow is never a
dependency of the tests):

    /tmp/tfvenv/bin/python tests/data/make_tf_damaged_pixels.py   # tensorflow-cpu 2.21

tf-crops.json: for each file and crop window (top, left, height, width) of WINDOWS, whether
decode_and_crop_jpeg decodes it. tf-pixels.npz: `<file>/full` for each file decode_jpeg decodes, and
`<file>/crop<i>` for each window i that decode_and_crop_jpeg decodes (uint8 (h, w, 3)). The windows
lie above, across and below the middle of the 64 x 64 photo, where the damaged files are cut or spoiled.
"""

import json
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
import tensorflow as tf  # noqa: E402

DAMAGED = Path(__file__).resolve().parent / "tf-build" / "damaged"
WINDOWS = [(0, 0, 16, 16), (4, 9, 20, 23), (24, 17, 17, 30), (40, 0, 24, 64), (0, 0, 64, 64)]


def main() -> None:
    v1 = tf.compat.v1
    session = v1.Session(graph=tf.Graph())
    with session.graph.as_default():
        data = v1.placeholder(tf.string)
        window = v1.placeholder(tf.int32, [4])
        full = tf.io.decode_jpeg(data, channels=3)
        crop = tf.image.decode_and_crop_jpeg(data, window, channels=3)
    pixels, crops = {}, {}
    for path in sorted(DAMAGED.glob("*.jpg")):
        jpeg = path.read_bytes()
        try:
            pixels[f"{path.name}/full"] = session.run(full, {data: jpeg})
        except tf.errors.OpError:
            pass
        crops[path.name] = []
        for i, w in enumerate(WINDOWS):
            try:
                pixels[f"{path.name}/crop{i}"] = session.run(crop, {data: jpeg, window: w})
                crops[path.name].append(True)
            except tf.errors.OpError:
                crops[path.name].append(False)
    np.savez_compressed(DAMAGED / "tf-pixels.npz", **pixels)
    record = {"tensorflow": tf.__version__, "windows": WINDOWS, "decodes": crops}
    (DAMAGED / "tf-crops.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"{len(pixels)} decodes of {len(crops)} files written to {DAMAGED}")


if __name__ == "__main__":
    main()
