"""fasttrain/data/synthetic.py: the synthetic set has the converter's layout and feature types
(build_imagenet_data.py's), is reproducible for a seed, and its class signal survives the train crop."""

import io

import numpy as np
from PIL import Image

from fasttrain.data.example import parse_example
from fasttrain.data.imagenet import decode_record, list_shards
from fasttrain.data.synthetic import make_synthetic
from fasttrain.data.tfrecord import iter_records
from fasttrain.data.transforms import eval_transform, train_transform

# --- the synthetic set -----------------------------------------------------------------------------

CONVERTER_TYPES = {
    "image/height": "int64_list", "image/width": "int64_list", "image/colorspace": "bytes_list",
    "image/channels": "int64_list", "image/class/label": "int64_list", "image/class/synset": "bytes_list",
    "image/class/text": "bytes_list", "image/object/bbox/xmin": "float_list",
    "image/object/bbox/xmax": "float_list", "image/object/bbox/ymin": "float_list",
    "image/object/bbox/ymax": "float_list", "image/object/bbox/label": "int64_list",
    "image/format": "bytes_list", "image/filename": "bytes_list", "image/encoded": "bytes_list",
}  # fmt: skip


def test_synthetic_layout_and_converter_types(synthetic):
    names = sorted(p.name for p in synthetic.iterdir() if not p.name.endswith(".idx"))
    assert names == [f"train-0000{i}-of-00003" for i in range(3)] + [
        f"validation-0000{i}-of-00002" for i in range(2)
    ]
    labels, sizes, box_counts = set(), set(), set()
    for shard in list_shards(synthetic, "train") + list_shards(synthetic, "validation"):
        for offset, payload in iter_records(shard):
            features = parse_example(payload).features.feature
            assert {k: features[k].WhichOneof("kind") for k in features} == CONVERTER_TYPES
            r = decode_record(payload, shard, offset, label_offset=-1, num_classes=4)
            img = Image.open(io.BytesIO(r.jpeg))
            assert (img.format, img.mode, img.height, img.width) == ("JPEG", "RGB", r.height, r.width)
            assert features["image/colorspace"].bytes_list.value[0] == b"RGB"
            assert list(features["image/object/bbox/label"].int64_list.value) == [r.stored_label] * len(
                r.boxes
            )
            assert np.all((r.boxes >= 0) & (r.boxes <= 1)) and np.all(r.boxes[:, :2] < r.boxes[:, 2:])
            labels.add(r.stored_label)
            sizes.add((r.height, r.width))
            box_counts.add(len(r.boxes))
    assert labels == {1, 2, 3, 4}
    assert box_counts == {0, 1, 2, 3}
    assert len(sizes) > 100 and min(min(s) for s in sizes) >= 48 and max(max(s) for s in sizes) <= 160


def test_synthetic_is_reproducible(synthetic, tmp_path):
    make_synthetic(tmp_path / "a", train_shards=1, val_shards=0, per_shard=40, classes=4, seed=7)
    shard = "train-00000-of-00001"
    first = [p for _, p in iter_records(tmp_path / "a" / shard)]
    make_synthetic(tmp_path / "b", train_shards=1, val_shards=0, per_shard=40, classes=4, seed=7)
    assert [p for _, p in iter_records(tmp_path / "b" / shard)] == first


def test_synthetic_class_signal_survives_the_train_crop(synthetic):
    # Nearest class mean of the mean colour: train on train-transformed 64 px crops (area down to 5%,
    # flips), test on eval-transformed validation images. Chance is 25%.
    def features(split, training):
        xs, ys = [], []
        rng = np.random.default_rng(0)
        for shard in list_shards(synthetic, split):
            for offset, payload in iter_records(shard):
                r = decode_record(payload, shard, offset, -1, 4)
                img = train_transform(r.jpeg, r.boxes, rng, 64) if training else eval_transform(r.jpeg, 64)
                xs.append(img.reshape(-1, 3).mean(0))
                ys.append(r.label)
        return np.array(xs), np.array(ys)

    x_train, y_train = features("train", True)
    x_val, y_val = features("validation", False)
    means = np.stack([x_train[y_train == c].mean(0) for c in range(4)])
    predicted = np.argmin(((x_val[:, None] - means[None]) ** 2).sum(-1), axis=1)
    assert (predicted == y_val).mean() > 0.9
