"""Example wire format, ImageNet record decoding, shard layout, the synthetic set, verify/ls CLI."""

import io
import json
import struct

import numpy as np
import pytest
from PIL import Image

from fasttrain.data import DataError
from fasttrain.data.__main__ import main
from fasttrain.data.example import encode_example, parse_example
from fasttrain.data.imagenet import decode_record, list_shards
from fasttrain.data.synthetic import make_synthetic
from fasttrain.data.tfrecord import iter_records, write_records
from fasttrain.data.transforms import eval_transform, train_transform
from fasttrain.data.verify import verify_dataset

# --- protobuf wire format, written out by hand from the encoding spec ------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _example_one(key: str, kind: int, list_payload: bytes) -> bytes:
    feature = _len_field(kind, list_payload)  # Feature.{bytes_list=1, float_list=2, int64_list=3}
    entry = _len_field(1, key.encode()) + _len_field(2, feature)  # map entry: key=1, value=2
    return _len_field(1, _len_field(1, entry))  # Example.features=1 -> Features.feature=1


def test_example_wire_format_matches_tensorflow():
    # int64_list and float_list are packed (one length-delimited field 1), bytes_list is not.
    assert encode_example({"image/class/label": 7}) == _example_one(
        "image/class/label", 3, _len_field(1, b"\x07")
    )
    assert encode_example({"image/height": 300}) == _example_one(
        "image/height", 3, _len_field(1, _varint(300))
    )
    floats = struct.pack("<2f", 0.25, 1.0)
    assert encode_example({"b": [0.25, 1.0]}) == _example_one("b", 2, _len_field(1, floats))
    assert encode_example({"b": (float, [])}) == _example_one("b", 2, b"")
    assert encode_example({"f": b"ab"}) == _example_one("f", 1, _len_field(1, b"ab"))
    assert encode_example({"f": [b"a", b"b"]}) == _example_one(
        "f", 1, _len_field(1, b"a") + _len_field(1, b"b")
    )


# --- decode_record ---------------------------------------------------------------------------------


def _jpeg(size=(20, 16), mode="RGB", color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color if mode == "RGB" else 128).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _features(**overrides):
    features = {
        "image/encoded": _jpeg(),
        "image/class/label": 5,
        "image/height": 16,
        "image/width": 20,
        "image/filename": "n01_1.JPEG",
        "image/object/bbox/ymin": [0.1, 0.2],
        "image/object/bbox/xmin": [0.3, 0.4],
        "image/object/bbox/ymax": [0.5, 0.6],
        "image/object/bbox/xmax": [0.7, 0.8],
    }
    features.update(overrides)
    return {k: v for k, v in features.items() if v is not None}


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


# --- the synthetic set -----------------------------------------------------------------------------

CONVERTER_TYPES = {
    "image/height": "int64_list", "image/width": "int64_list", "image/colorspace": "bytes_list",
    "image/channels": "int64_list", "image/class/label": "int64_list", "image/class/synset": "bytes_list",
    "image/class/text": "bytes_list", "image/object/bbox/xmin": "float_list",
    "image/object/bbox/xmax": "float_list", "image/object/bbox/ymin": "float_list",
    "image/object/bbox/ymax": "float_list", "image/object/bbox/label": "int64_list",
    "image/format": "bytes_list", "image/filename": "bytes_list", "image/encoded": "bytes_list",
}  # fmt: skip


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    make_synthetic(out, train_shards=3, val_shards=2, per_shard=40, classes=4, seed=7)
    return out


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
    make_synthetic(tmp_path, train_shards=1, val_shards=0, per_shard=40, classes=4, seed=7)
    shard = "train-00000-of-00001"
    first = [p for _, p in iter_records(tmp_path / shard)]
    make_synthetic(tmp_path, train_shards=1, val_shards=0, per_shard=40, classes=4, seed=7)
    assert [p for _, p in iter_records(tmp_path / shard)] == first


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


# --- verify and ls ---------------------------------------------------------------------------------


def _copy(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        if not p.name.endswith(".idx"):
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_verify_clean_data_writes_indexes(synthetic, tmp_path, capsys):
    data = _copy(synthetic, tmp_path / "data")
    report = verify_dataset(data, decode=True, workers=1, label_offset=-1, num_classes=4)
    assert report.ok and report.records == 200
    assert {s.index for s in report.shards} == {"written"}
    assert report.split_summary("train") == "train: 120 records in 3 shards, labels 1..4"
    assert main(["verify", str(data), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "validation: 80 records in 2 shards, labels 1..4" in out and "index files: 5 ok" in out
    assert "records/s" in out


def test_verify_reports_every_bad_record(synthetic, tmp_path, capsys):
    data = _copy(synthetic, tmp_path / "data")
    shard0, shard1 = list_shards(data, "train")[:2]
    offsets = [o for o, _ in iter_records(shard0)]
    raw = bytearray(shard0.read_bytes())
    raw[offsets[3] + 40] ^= 1  # data CRC: the scan goes on
    raw[offsets[7] + 40] ^= 1
    shard0.write_bytes(bytes(raw))
    cut = [o for o, _ in iter_records(shard1)][5] + 20
    shard1.write_bytes(shard1.read_bytes()[:cut])
    bad_label = tmp_path / "data" / "validation-00000-of-00002"
    write_records(bad_label, [encode_example(_features(**{"image/class/label": 9}))])
    empty = tmp_path / "data" / "validation-00001-of-00002"
    empty.write_bytes(b"")

    assert main(["verify", str(data), "--workers", "2", "--label-offset", "-1", "--num-classes", "4"]) == 1
    out = capsys.readouterr().out
    assert f"{shard0}: 2 bad record(s)" in out
    for offset in (offsets[3], offsets[7]):
        assert f"corrupted record at offset {offset} in {shard0} (data CRC mismatch)" in out
    assert f"truncated record at offset {cut - 20} in {shard1}" in out
    assert f"record at offset 0 in {bad_label}: label 9 + label_offset -1 is outside [0, 4)" in out
    assert f"empty shard {empty}" in out
    assert "train: 85 records in 3 shards" in out  # 40 (2 with bad CRCs) + 5 before the cut + 40
    report = verify_dataset(data, workers=1, label_offset=-1, num_classes=4, splits=["train"])
    assert {s.index for s in report.shards} == {"ok", "not written (broken framing)"}


def test_verify_decode_finds_a_bad_jpeg(tmp_path):
    (tmp_path / "d").mkdir()
    bad = _jpeg()[:-200]
    write_records(
        tmp_path / "d" / "train-00000-of-00001", [encode_example(_features(**{"image/encoded": bad}))]
    )
    assert verify_dataset(tmp_path / "d", workers=1).ok  # without --decode the JPEG is not looked at
    report = verify_dataset(tmp_path / "d", decode=True, workers=1)
    assert len(report.bad) == 1 and "undecodable JPEG in record at offset 0" in report.bad[0].bad[0]


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    assert main(["ls", str(tmp_path)]) == 0  # no shards of either split: nothing to list
    assert main(["ls", str(tmp_path), "--split", "train"]) == 1
    with pytest.raises(SystemExit) as e:
        main(["verify", str(tmp_path), "--workers", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["make-synthetic", "--out", str(tmp_path), "--train-shards", "0", "--val-shards", "0"])
    assert e.value.code == 2
    capsys.readouterr()
    (tmp_path / "a-file").write_text("")
    assert main(["make-synthetic", "--out", str(tmp_path / "a-file" / "d"), "--per-shard", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the data set to" in err and "Not a directory" in err


def test_ls_prints_one_json_object_per_record(synthetic, capsys):
    assert main(["ls", str(synthetic), "--split", "validation", "--limit", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3
    shard = list_shards(synthetic, "validation")[0]
    expected = [decode_record(p, shard, o, 0, 1001) for o, p in list(iter_records(shard))[:3]]
    for line, r in zip(lines, expected):
        assert {"file", "offset", "label", "filename", "height", "width", "boxes"} <= set(line)
        assert (line["file"], line["offset"], line["label"]) == (str(shard), r.offset, r.stored_label)
        assert (line["filename"], line["height"], line["width"]) == (r.filename, r.height, r.width)
        np.testing.assert_allclose(np.array(line["boxes"]).reshape(-1, 4), r.boxes, atol=1e-6)
