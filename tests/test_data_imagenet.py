"""fasttrain/data/imagenet.py: ImageNet records decoded field by field (as build_imagenet_data.py
writes them), bad records named by file and offset, the shard layout (train-NNNNN-of-NNNNN), and a
shard TensorFlow itself wrote (tests/data/make_tf_fixture.py, TF 2.21) read back field by field."""

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from record_helpers import _features, _jpeg

from fasttrain.data import DataError, imagenet
from fasttrain.data.example import encode_example
from fasttrain.data.imagenet import SampleDecoder, decode_record, list_shards
from fasttrain.data.tfrecord import RecordBuffer, build_index, iter_records

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


# --- SampleDecoder: the loader's wire-format scan, against the protobuf runtime ---------------------


def _outcome(payload: bytes, label_offset=-1, num_classes=10, decoder=None):
    """What a loader gets for the payload: (jpeg, label, boxes as lists) or the error's text."""
    buffer = RecordBuffer(size=len(payload) + 16)
    buffer.data[12 : 12 + len(payload)] = payload  # where RecordBuffer.read puts a payload
    decoder = decoder or SampleDecoder(label_offset, num_classes)
    try:
        jpeg, label, boxes = decoder.decode(buffer, buffer.view[12 : 12 + len(payload)], "/d/s", 7)
    except DataError as e:
        return str(e)
    return bytes(jpeg), label, np.asarray(boxes, np.float32).tolist(), boxes.dtype


def _reference(payload: bytes, label_offset=-1, num_classes=10):
    try:
        r = decode_record(payload, "/d/s", 7, label_offset, num_classes)
    except DataError as e:
        return str(e)
    return r.jpeg, r.label, r.boxes.tolist(), r.boxes.dtype


@pytest.fixture
def protobuf_calls(monkeypatch):
    """How many payloads went to the protobuf path (decode_record) instead of the scan."""
    calls = []

    def counted(*args):
        calls.append(args)
        return decode_record(*args)

    monkeypatch.setattr(imagenet, "decode_record", counted)
    return calls


def _plain_payloads():
    no_boxes = {k: None for k in _features() if "bbox" in k}
    empty_boxes = {k: (float, []) for k in _features() if "bbox" in k}  # what the converter writes
    (shard,) = list_shards(FIXTURE, "train")
    return [
        encode_example(_features()),
        encode_example(_features(**no_boxes)),
        encode_example(_features(**empty_boxes)),
        encode_example(_features(**{"image/class/label": 2**40, "image/filename": "é"})),
        *(payload for _, payload in iter_records(shard)),  # written by TensorFlow
    ]


def test_the_scan_reads_plain_records_as_protobuf_does(protobuf_calls):
    for payload in _plain_payloads():
        for label_offset, num_classes in ((-1, 1000), (0, 2**41)):
            calls = len(protobuf_calls)
            reference = _reference(payload, label_offset, num_classes)
            assert _outcome(payload, label_offset, num_classes) == reference
            # The scan took it, unless the label is out of range (label 2**40 with 1000 classes).
            assert len(protobuf_calls) == calls + isinstance(reference, str)


@pytest.mark.parametrize(
    "overrides", [o for o, _ in test_bad_records_name_file_and_offset.pytestmark[0].args[1]]
)
def test_bad_records_fail_as_in_decode_record(overrides):
    payload = encode_example(_features(**overrides))
    assert _outcome(payload) == _reference(payload)
    assert isinstance(_reference(payload), str)


def _field(number: int, wire_type: int, body: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + (_varint(len(body)) + body if wire_type == 2 else body)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _with_entry(payload: bytes, key: bytes, feature: bytes) -> bytes:
    """payload (one Example) with one more map entry appended to its Features."""
    features = _field(1, 2, _field(1, 2, key) + _field(2, 2, feature))
    return _field(1, 2, _inner(payload) + features)


def _inner(payload: bytes) -> bytes:
    """The Features bytes of an Example that encode_example wrote (tag, length, body)."""
    length, pos = 0, 1
    for shift in range(0, 35, 7):
        length |= (payload[pos] & 0x7F) << shift
        pos += 1
        if payload[pos - 1] < 0x80:
            break
    return payload[pos : pos + length]


UNUSUAL = {  # valid protobuf the scan leaves to the runtime (and what the runtime makes of it)
    "unpacked floats": (b"image/object/bbox/ymin", _field(2, 2, _field(1, 5, b"\0\0\0?"))),
    "unpacked int64": (b"image/class/label", _field(3, 2, _field(1, 0, _varint(3)))),
    "a repeated key": (b"image/class/label", _field(3, 2, _field(1, 2, _varint(4)))),
    "a non-ASCII key": ("clé".encode(), _field(1, 2, _field(1, 2, b"x"))),
    "an empty feature": (b"other", b""),
    "two kinds in one feature": (b"other", _field(1, 2, b"") + _field(3, 2, b"")),
    "an unknown field": (b"other", _field(9, 0, _varint(1))),
}


@pytest.mark.parametrize("case", UNUSUAL)
def test_unusual_encodings_go_to_protobuf(case, protobuf_calls):
    key, feature = UNUSUAL[case]
    payload = _with_entry(encode_example(_features()), key, feature)
    assert _outcome(payload) == _reference(payload)
    assert len(protobuf_calls) == 1


def test_mutated_records_fail_or_decode_as_in_protobuf():
    """Flipped bytes, cut and spliced payloads (seeded): the same result or the same error line."""
    rng = np.random.default_rng(0)
    decoder = SampleDecoder(-1, 1000)
    plain = _plain_payloads()
    for trial in range(3000):
        payload = bytearray(plain[trial % len(plain)])
        kind = trial % 3
        if kind == 0:
            for _ in range(int(rng.integers(1, 4))):
                payload[int(rng.integers(0, len(payload)))] ^= int(rng.integers(1, 256))
        elif kind == 1:
            del payload[int(rng.integers(0, len(payload))) :]
        else:
            at = int(rng.integers(0, len(payload)))
            payload[at:at] = rng.integers(0, 256, int(rng.integers(1, 8)), dtype=np.uint8).tobytes()
        payload = bytes(payload)
        assert _outcome(payload, -1, 1000, decoder) == _reference(payload, -1, 1000), trial
