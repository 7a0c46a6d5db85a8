"""fasttrain/data/example.py: the tf.train.Example encoder against the protobuf wire format, written
out by hand from the encoding specification (what TensorFlow's own serializer emits)."""

import struct

from fasttrain.data.example import encode_example

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
