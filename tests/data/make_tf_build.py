"""Writes tests/data/tf-build/: a small ImageNet-style JPEG tree and the shards TensorFlow makes of it.
Run once, in a scratch environment (TensorFlow is never a dependency of the tests):

    /opt/tfvenv/bin/python tests/data/make_tf_build.py   # tensorflow-cpu 2.21, Pillow 13, scikit-image 0.26

Deterministic: every photo is cut from scikit-image's bundled photographs at fixed places, every random
choice comes from a seeded numpy Generator, the encoders are of fixed versions. (TensorFlow's shards
differ byte-wise from one run to the next, in the order of each record's features only.)

input/train/<synset>/*.JPEG and input/validation/<synset>/*.JPEG, with synsets.txt (the labels file),
metadata.txt (synset<TAB>text, one line UTF-8) and boxes.csv (what process_bounding_boxes.py prints).
What the tree holds, by what build_imagenet_data.py does with it:
- photos passed through as they are: baseline 4:2:0, 4:4:4, progressive, grayscale (plain and
  progressive), 1 to 2 boxes or none, one box line for an image that does not exist;
- n02105855/n02105855_2933.JPEG: an RGBA PNG under the one name the script converts from PNG;
- n01739381/n01739381_1309.JPEG: an Adobe CMYK JPEG (APP14, inverted values) under a name the script
  re-encodes; n02077923/n02077923_14822.JPEG: a CMYK JPEG without the Adobe marker under another;
- n03000134/n03000134_5.JPEG: an Adobe CMYK JPEG under a name the script does not list (kept as is);
- files the script's `*.JPEG` glob leaves out (a .jpeg, a .txt), a synset folder the labels file does
  not name, a labels-file synset with no folder (its label is used by no image);
- validation: 3 images for 4 shards over 2 threads, so the split arithmetic leaves shard 0 empty.

tf-output/: what TensorFlow writes, with the script's code ported to tf.compat.v1 (its own reading of
the three text files, the `<dir>/<synset>/*.JPEG` glob per synset in labels-file order, the seeded
shuffle `random.seed(12345); random.shuffle(range(N))`, the split of the list into num_threads ranges
and each range into shards by np.linspace(...).astype(int), the same Example features, the PNG and CMYK
conversions through decode_png / decode_jpeg(channels=0) and encode_jpeg(format='rgb', quality=100), a
TFRecordWriter per shard). One change: the glob's list is sorted, as fasttrain sorts it, because the
order the file system lists a directory in differs from machine to machine. Threads are run one after
another (what a thread writes does not depend on the others).

tf-output/reencoded.json: for each image the script re-encodes, the sha256 and shape of TensorFlow's
decode of the input (decode_png / decode_jpeg(channels=0)) and of its decode_jpeg(channels=3) of the
re-encoded JPEG, so a test can say how close fasttrain's re-encoding decodes to TensorFlow's pixels.

damaged/: JPEGs cut or spoiled from one photo (and a PNG), and verdicts.json: whether TensorFlow's
decode_jpeg(channels=3) decodes each (the script's check that an image is sound).
"""

import hashlib
import io
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import skimage.data
from PIL import Image

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
import tensorflow as tf  # noqa: E402

OUT = Path(__file__).resolve().parent / "tf-build"
TRAIN_SHARDS, VALIDATION_SHARDS, NUM_THREADS = 4, 4, 2
PNG_NAME = "n02105855_2933.JPEG"
CMYK_NAMES = ("n01739381_1309.JPEG", "n02077923_14822.JPEG")  # two of the script's 22


# --- the input tree -------------------------------------------------------------------------------


def _photo(name: str, top: int, left: int, h: int, w: int, size: tuple[int, int]) -> Image.Image:
    array = getattr(skimage.data, name)()
    if isinstance(array, tuple):  # stereo_motorcycle: (left, right, disparity)
        array = array[0]
    return Image.fromarray(array[top : top + h, left : left + w]).resize(size, Image.LANCZOS)


def _jpeg(image: Image.Image, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", **options)
    return buf.getvalue()


def _cmyk(image: Image.Image, adobe: bool) -> bytes:
    rgb = np.asarray(image.convert("RGB"), np.int32)
    k = 255 - rgb.max(axis=2, keepdims=True)
    cmy = np.where(k < 255, (255 - rgb - k) * 255 // np.maximum(255 - k, 1), 0)
    data = _jpeg(Image.fromarray(np.concatenate([cmy, k], axis=2).astype(np.uint8), "CMYK"), quality=92)
    if adobe:
        return data
    at = data.index(b"\xff\xee")  # drop APP14: libjpeg then takes the 4 components as plain CMYK
    return data[:at] + data[at + 2 + int.from_bytes(data[at + 2 : at + 4], "big") :]


def _png_rgba(image: Image.Image) -> bytes:
    rgba = np.asarray(image.convert("RGBA")).copy()
    rgba[..., 3] = np.linspace(40, 255, rgba.shape[1], dtype=np.uint8)[None, :]  # alpha TF must drop
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    return buf.getvalue()


def write_inputs(root: Path) -> None:
    t, v = root / "train", root / "validation"
    files = {
        t / "n01440764/n01440764_10026.JPEG": _jpeg(_photo("chelsea", 0, 0, 300, 451, (97, 65)), quality=90),
        t / "n01440764/n01440764_10027.JPEG": _jpeg(
            _photo("astronaut", 0, 100, 300, 300, (64, 64)), quality=88, subsampling=0
        ),
        t / "n01440764/n01440764_3198.JPEG": _jpeg(
            _photo("coffee", 0, 0, 400, 600, (90, 60)), quality=85, progressive=True
        ),
        t / "n01440764/n01440764_39.JPEG": _jpeg(_photo("camera", 50, 50, 400, 300, (48, 64)), quality=90),
        t / "n01440764/n01440764_7.JPEG": _jpeg(_photo("rocket", 0, 0, 427, 640, (75, 50)), quality=80),
        t / "n01739381" / CMYK_NAMES[0]: _cmyk(
            _photo("immunohistochemistry", 0, 0, 512, 512, (56, 56)), True
        ),
        t / "n01739381/n01739381_77.JPEG": _jpeg(_photo("stereo_motorcycle", 0, 0, 500, 741, (81, 55))),
        t / "n02077923" / CMYK_NAMES[1]: _cmyk(_photo("retina", 300, 300, 800, 800, (50, 50)), False),
        t / "n02105855" / PNG_NAME: _png_rgba(_photo("astronaut", 0, 0, 512, 512, (60, 45))),
        t / "n02105855/n02105855_10.JPEG": _jpeg(_photo("hubble_deep_field", 0, 0, 872, 1000, (70, 61))),
        t / "n03000134/n03000134_5.JPEG": _cmyk(_photo("coffee", 0, 100, 400, 400, (52, 52)), True),
        t / "n03000134/n03000134_6.JPEG": _jpeg(
            _photo("page", 0, 0, 191, 384, (80, 40)), quality=90, progressive=True
        ),
        t / "n03000134/n03000134_7.jpeg": _jpeg(_photo("moon", 0, 0, 512, 512, (20, 20))),  # not globbed
        t / "n03000134/notes.txt": b"not an image\n",
        t / "n09999999/n09999999_1.JPEG": _jpeg(_photo("cat", 0, 0, 300, 451, (30, 20))),  # not a label
        v / "n01440764/ILSVRC2012_val_00000001.JPEG": _jpeg(
            _photo("chelsea", 0, 100, 300, 300, (66, 66)), quality=75
        ),
        v / "n01739381/ILSVRC2012_val_00000002.JPEG": _jpeg(_photo("rocket", 0, 200, 427, 400, (47, 50))),
        v / "n02105855/ILSVRC2012_val_00000003.JPEG": _jpeg(
            _photo("coffee", 100, 0, 300, 600, (80, 40)), quality=95
        ),
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    synsets = ["n01440764", "n01739381", "n02077923", "n02105855", "n03000134", "n04000000"]
    (root / "synsets.txt").write_text("".join(s + "\n" for s in synsets))
    texts = {
        "n00004475": "organism, being",
        "n01440764": "tench, Tinca tinca",
        "n01739381": "vine snake",
        "n02077923": "sea lion",
        "n02105855": "Shetland sheepdog, Shetland sheep dog, Shetland",
        "n03000134": "chainlink fence, caf\u00e9 fence",  # non-ASCII: written as UTF-8
        "n04000000": "a synset without images",
        "n09999999": "not in the labels file",
    }
    (root / "metadata.txt").write_text("".join(f"{s}\t{t}\n" for s, t in texts.items()), encoding="utf-8")
    rng = np.random.default_rng(39)
    lines = []
    for name, n in [
        ("n01440764_10026.JPEG", 2),
        ("n01440764_3198.JPEG", 1),
        (CMYK_NAMES[0], 1),
        (PNG_NAME, 1),
        ("n03000134_5.JPEG", 1),
        ("n01440764_99999.JPEG", 1),  # no such image
        ("ILSVRC2012_val_00000002.JPEG", 2),
        ("n01440764_10026.JPEG", 1),  # a third box, listed apart from the image's first two
    ]:
        for _ in range(n):
            x0, y0 = rng.uniform(0, 0.5, 2)
            x1, y1 = x0 + rng.uniform(0.1, 0.5), y0 + rng.uniform(0.1, 0.5)
            lines.append(f"{name},{x0:.4f},{y0:.4f},{x1:.4f},{y1:.4f}\n")
    (root / "boxes.csv").write_text("".join(lines))


# --- TensorFlow's side: build_imagenet_data.py's steps, ported to tf.compat.v1 --------------------


class Coder:
    """The script's three TF image operations in one graph and session."""

    def __init__(self):
        v1 = tf.compat.v1
        self.session = v1.Session(graph=tf.Graph())
        with self.session.graph.as_default():
            self.data = v1.placeholder(tf.string)
            self.pixels = v1.placeholder(tf.uint8)
            self.png = tf.io.decode_png(self.data, channels=3)
            self.cmyk = tf.io.decode_jpeg(self.data, channels=0)
            self.rgb = tf.io.decode_jpeg(self.data, channels=3)
            self.encode = tf.io.encode_jpeg(self.pixels, format="rgb", quality=100)

    def run(self, op, data):
        return self.session.run(op, {self.data: data})

    def to_jpeg(self, pixels):
        return self.session.run(self.encode, {self.pixels: pixels})


def _digest(pixels: np.ndarray) -> dict:
    sha = hashlib.sha256(np.ascontiguousarray(pixels).tobytes()).hexdigest()
    return {"shape": list(pixels.shape), "sha256": sha}


def _feature(kind, values):
    if kind is bytes:
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
    if kind is float:
        return tf.train.Feature(float_list=tf.train.FloatList(value=values))
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def tf_build(
    root: Path, out: Path, coder: Coder, reencoded: dict, shards=None, num_threads=NUM_THREADS
) -> None:
    """The script's run over root/{validation,train} (shards: {split: count}; bench/bench_build.py
    times it on a larger tree)."""
    synsets = [line.strip() for line in (root / "synsets.txt").read_text().splitlines(True)]
    human = {}
    for line in (root / "metadata.txt").read_text(encoding="utf-8").splitlines(True):
        synset, text = line.strip().split("\t")
        human[synset] = text
    boxes: dict[str, list[list[float]]] = {}
    for line in (root / "boxes.csv").read_text().splitlines(True):
        name, *values = line.split(",")
        boxes.setdefault(name, []).append([float(v) for v in values])  # xmin, ymin, xmax, ymax

    shards = shards or {"validation": VALIDATION_SHARDS, "train": TRAIN_SHARDS}
    for split, num_shards in shards.items():
        directory = root / split
        paths, labels, names = [], [], []
        for label, synset in enumerate(synsets, start=1):
            found = sorted(tf.io.gfile.glob(f"{directory}/{synset}/*.JPEG"))  # sorted: the one change
            paths += found
            labels += [label] * len(found)
            names += [synset] * len(found)
        order = list(range(len(paths)))
        random.seed(12345)
        random.shuffle(order)
        paths, labels, names = ([v[i] for i in order] for v in (paths, labels, names))

        bounds = np.linspace(0, len(paths), num_threads + 1).astype(int)
        per_thread = num_shards // num_threads
        for thread in range(num_threads):
            cuts = np.linspace(bounds[thread], bounds[thread + 1], per_thread + 1).astype(int)
            for s in range(per_thread):
                shard = out / f"{split}-{thread * per_thread + s:05d}-of-{num_shards:05d}"
                with tf.io.TFRecordWriter(str(shard)) as writer:
                    for i in range(cuts[s], cuts[s + 1]):
                        writer.write(_example(paths[i], labels[i], names[i], human, boxes, coder, reencoded))


def _example(path, label, synset, human, boxes, coder, reencoded) -> bytes:
    data = tf.io.gfile.GFile(path, "rb").read()
    base = os.path.basename(path)
    if PNG_NAME in path:
        pixels = coder.run(coder.png, data)
    elif base in CMYK_NAMES:
        pixels = coder.run(coder.cmyk, data)
    else:
        pixels = None
    if pixels is not None:
        data = coder.to_jpeg(pixels)
        reencoded[base] = {"input": _digest(pixels), "decoded": _digest(coder.run(coder.rgb, data))}
    image = coder.run(coder.rgb, data)
    assert image.ndim == 3 and image.shape[2] == 3
    image_boxes = boxes.get(base, [])
    xmin, ymin, xmax, ymax = ([b[k] for b in image_boxes] for k in range(4))
    feature = {
        "image/height": _feature(int, [image.shape[0]]),
        "image/width": _feature(int, [image.shape[1]]),
        "image/colorspace": _feature(bytes, [b"RGB"]),
        "image/channels": _feature(int, [3]),
        "image/class/label": _feature(int, [label]),
        "image/class/synset": _feature(bytes, [synset.encode()]),
        "image/class/text": _feature(bytes, [human[synset].encode("utf-8")]),
        "image/object/bbox/xmin": _feature(float, xmin),
        "image/object/bbox/xmax": _feature(float, xmax),
        "image/object/bbox/ymin": _feature(float, ymin),
        "image/object/bbox/ymax": _feature(float, ymax),
        "image/object/bbox/label": _feature(int, [label] * len(xmin)),
        "image/format": _feature(bytes, [b"JPEG"]),
        "image/filename": _feature(bytes, [base.encode()]),
        "image/encoded": _feature(bytes, [data]),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


# --- damaged JPEGs and TensorFlow's verdict on each -----------------------------------------------


def write_damaged(out: Path, coder: Coder) -> None:
    base = _jpeg(_photo("astronaut", 0, 0, 512, 512, (64, 64)), quality=90)
    prog = _jpeg(_photo("astronaut", 0, 0, 512, 512, (64, 64)), quality=90, progressive=True)
    middle = len(base) // 2
    # Sampling factors TurboJPEG's API cannot name (Y 2x2, Cb 2x1, Cr 1x1) over data coded for 4:4:4:
    # libjpeg decodes it (wrong pixels, warnings); simplejpeg refuses it at the header.
    unusual = bytearray(_jpeg(_photo("astronaut", 0, 0, 512, 512, (64, 64)), quality=90, subsampling=0))
    sof = unusual.index(b"\xff\xc0") + 10  # the first component's id, then its sampling byte
    unusual[sof + 1], unusual[sof + 4], unusual[sof + 7] = 0x22, 0x21, 0x11
    spoiled = bytearray(base)
    spoiled[middle : middle + 40] = bytes(b ^ 0x5A for b in spoiled[middle : middle + 40])
    cases = {
        "sound.jpg": base,
        "sound_progressive.jpg": prog,
        "truncated_half.jpg": base[:middle],
        "truncated_last_10.jpg": base[:-10],
        "no_eoi.jpg": base[:-2],
        "no_eoi_padded.jpg": base[:-2] + b"\x00\x00\x00\x00",
        "progressive_truncated.jpg": prog[: len(prog) * 2 // 3],
        "progressive_no_eoi.jpg": prog[:-2],
        "header_only.jpg": base[:600],
        "empty.jpg": b"",
        "early_eoi.jpg": base[:middle] + b"\xff\xd9",  # libjpeg warns and pads: TF decodes it
        "extraneous_before_eoi.jpg": base[:-2] + b"\x12\x34\x56" + base[-2:],  # a warning only
        "trailing_data.jpg": base + b"data after EOI",
        "spoiled_entropy.jpg": bytes(spoiled),  # wrong pixels, but nothing libjpeg calls an error
        "reserved_marker.jpg": base[:middle] + b"\xff\x02" + base[middle + 2 :],  # fatal in libjpeg
        "unusual_sampling.jpg": bytes(unusual),
        "png_content.jpg": _png_rgba(_photo("astronaut", 0, 0, 512, 512, (32, 32))),  # TF 2 decodes PNG too
    }
    verdicts = {}
    for name, data in cases.items():
        (out / name).write_bytes(data)
        try:
            coder.run(coder.rgb, data)
            verdicts[name] = True
        except tf.errors.OpError:
            verdicts[name] = False
    (out / "verdicts.json").write_text(json.dumps(verdicts, indent=1, sort_keys=True) + "\n")


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    inputs, output, damaged = OUT / "input", OUT / "tf-output", OUT / "damaged"
    for d in (inputs, output, damaged):
        d.mkdir(parents=True)
    write_inputs(inputs)
    coder = Coder()
    reencoded: dict = {}
    tf_build(inputs, output, coder, reencoded)
    (output / "reencoded.json").write_text(json.dumps(reencoded, indent=1, sort_keys=True) + "\n")
    write_damaged(damaged, coder)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({total / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
