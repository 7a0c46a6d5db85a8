"""fasttrain/data/imagenet.py: ImageNet records decoded field by field (as build_imagenet_data.py
writes them), bad records named by file and offset, the shard layout (train-NNNNN-of-NNNNN), and a
shard TensorFlow itself wrote (tests/data/make_tf_fixture.py, TF 2.21) read back field by field."""

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from record_helpers import _features, _jpeg

from fasttrain.data import DataError
from fasttrain.data.example import encode_example
from fasttrain.data.imagenet import decode_record, list_shards
from fasttrain.data.tfrecord import build_index, iter_records

# --- decode_record ---------------------------------------------------------------------------------


def test_decode_record_fields_and_label_offset():
    payload = encode_example(_features())
    r = decode_record(payload, "shard", 40, label_offset=-1, num_classes=10)
    assert (r.label, r.stored_label, r.height, r.width, r.filename) == (4, 5, 16, 20, "n01_1.JPEG")
    np.testing.assert_array_equal(r.boxes, np.array([[0.1, 0.3, 0.5, 0.7], [0.2, 0.4, 0.6, 0.8]], np.float32))
    assert r.jpeg == _jpeg()
    assert decode_record(payload, "shard", 40, label_offset=0, num_classes=1001).label == 5
    no_boxes = {k: None for k in _features() if "bbox" in k}
    assert decode_record(encode_example(_features(**no_boxes)), "s", 0, 0, 1001).boxes.shape == (0, 4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"image/encoded": None}, "missing key 'image/encoded'"),
        ({"image/class/label": None}, "missing key 'image/class/label'"),
        ({"image/class/label": b"5"}, "'image/class/label' is bytes_list, expected int64_list"),
        ({"image/encoded": 3}, "'image/encoded' is int64_list"),
        ({"image/object/bbox/xmin": [1, 2]}, "expected float_list"),
        ({"image/object/bbox/xmax": [0.5]}, "different lengths"),
        # NaN crashed the crop sampler in a loader worker (found by mutating records), and verify let it pass.
        ({"image/object/bbox/ymin": [0.1, float("nan")]}, "bounding-box coordinate is NaN or infinite"),
        ({"image/object/bbox/xmax": [float("inf"), 0.8]}, "bounding-box coordinate is NaN or infinite"),
        ({"image/class/label": [1, 2]}, "2 values"),
        ({"image/class/label": 11}, r"label 11 \+ label_offset -1 is outside \[0, 10\)"),
        ({"image/class/label": 0}, r"label 0 \+ label_offset -1 is outside"),
    ],
)
def test_bad_records_name_file_and_offset(overrides, message):
    payload = encode_example(_features(**overrides))
    with pytest.raises(DataError, match=f"record at offset 123 in /d/train-00003-of-00004: .*{message}"):
        decode_record(payload, "/d/train-00003-of-00004", 123, label_offset=-1, num_classes=10)


def test_garbage_payload_is_a_data_error():
    with pytest.raises(DataError, match="offset 9 in f: not a tf.train.Example"):
        decode_record(b"\xff\xff\xff", "f", 9, 0, 1001)


# --- layout ----------------------------------------------------------------------------------------


def test_list_shards(tmp_path):
    for name in (
        "train-00001-of-00002",
        "train-00000-of-00002",
        "train-00000-of-00002.idx",
        "validation-00000-of-00001",
        "train-0-of-2",
        "README",
    ):
        (tmp_path / name).write_bytes(b"x")  # not empty: a 0-byte shard is an error
    assert [p.name for p in list_shards(tmp_path, "train")] == [
        "train-00000-of-00002",
        "train-00001-of-00002",
    ]
    assert [p.name for p in list_shards(tmp_path, "validation")] == ["validation-00000-of-00001"]


def test_list_shards_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        list_shards(tmp_path / "missing", "train")
    with pytest.raises(DataError, match="no data directory given; set data_dir"):
        list_shards("", "train")
    with pytest.raises(DataError, match=f"no train-NNNNN-of-NNNNN shards in {tmp_path}"):
        list_shards(tmp_path, "train")
    (tmp_path / "validation-00000-of-00001").write_bytes(b"")
    with pytest.raises(DataError, match="no train"):
        list_shards(tmp_path, "train")


# --- a shard TensorFlow itself wrote ----------------------------------------------------------------

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
