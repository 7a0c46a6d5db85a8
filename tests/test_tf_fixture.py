"""fasttrain reads a shard that TensorFlow itself wrote (tests/data/make_tf_fixture.py, TF 2.21)."""

import io
from pathlib import Path

import numpy as np
from PIL import Image

from fasttrain.data.imagenet import decode_record, list_shards
from fasttrain.data.tfrecord import build_index, iter_records

FIXTURE = Path(__file__).parent / "data" / "tf-written"


def test_every_field_of_a_tensorflow_written_shard():
    (shard,) = list_shards(FIXTURE, "train")
    records = list(iter_records(shard, verify=True))  # both masked CRC32Cs of every record
    assert [offset for offset, _ in records] == [0, 1202, 2440]
    assert build_index(shard) == [(0, 1202), (1202, 1238), (2440, 1251)]
    for k, (offset, payload) in enumerate(records):
        rec = decode_record(payload, shard, offset, label_offset=-1, num_classes=1000)
        assert (rec.label, rec.stored_label, rec.height, rec.width) == (10 * k, 10 * k + 1, 6 + k, 8)
        assert (rec.filename, rec.synset, rec.text) == (f"n0144{k}_{k}.JPEG", f"n0144{k}", f"tench {k}")
        # the script wrote boxes as xmin, ymin, xmax, ymax = 0.1 (j + 1), 0.2, 0.5, 0.9
        expected = np.array([[0.2, 0.1 * (j + 1), 0.9, 0.5] for j in range(k)], dtype=np.float32).reshape(
            -1, 4
        )
        np.testing.assert_array_equal(rec.boxes, expected)
        image = Image.open(io.BytesIO(rec.jpeg))
        assert (image.format, image.mode, image.size) == ("JPEG", "RGB", (8, 6 + k))
