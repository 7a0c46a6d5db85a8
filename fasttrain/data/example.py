"""tf.train.Example without TensorFlow: the message classes built from descriptors at import time.

The messages are TensorFlow's (tensorflow/core/example/{example,feature}.proto, proto3):

    message BytesList { repeated bytes value = 1; }
    message FloatList { repeated float value = 1 [packed = true]; }
    message Int64List { repeated int64 value = 1 [packed = true]; }
    message Feature   { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                                     Int64List int64_list = 3; } }
    message Features  { map<string, Feature> feature = 1; }
    message Example   { Features features = 1; }

Building them in a private descriptor pool gives the protobuf library's C (upb) parser and serializer
with TensorFlow's exact wire format, without compiling a .proto file, and cannot clash with
TensorFlow's own registration when both are imported in one process.

`scan_example` is a loader's fast path for a few keys: one numba pass over the wire format (a
length-delimited field is tag 0x0A / 0x12 / 0x1A for field 1 / 2 / 3, then a varint length; Example
{features = 1} -> Features {feature = 1: map entry {key = 1, value = 2}} -> Feature {bytes_list = 1,
float_list = 2, int64_list = 3} -> list {value = 1}, floats and int64s packed) that reports where the
wanted keys' values lie instead of building Python objects (about 40 us with the protobuf runtime and
its containers, for a converter record). It accepts only the plain layout TensorFlow writes, and every
part of it (each key ASCII, each entry key-then-value, each Feature one kind, each list one packed
run, every varint whole, each wanted key once); for anything else it answers "not plain" and the
caller parses with protobuf, so no input means something different on the two paths. The scan keeps
the GIL (no nogil): releasing it for a few microseconds would hand it to another loader thread and
wait to take it back, which costs more than the scan.
"""

from __future__ import annotations

import numba
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto


def _build_example_class():
    file = descriptor_pb2.FileDescriptorProto(
        name="fasttrain/tf_example.proto", package="tensorflow", syntax="proto3"
    )

    def message(name, fields, nested=None, oneof=None):
        msg = file.message_type.add(name=name)
        if oneof:
            msg.oneof_decl.add(name=oneof)
        for number, (field_name, kind, label, type_name, packed) in enumerate(fields, start=1):
            field = msg.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name
            if packed:
                field.options.packed = True
            if oneof:
                field.oneof_index = 0
        if nested:
            msg.nested_type.append(nested)
        return msg

    rep, opt = _F.LABEL_REPEATED, _F.LABEL_OPTIONAL
    message("BytesList", [("value", _F.TYPE_BYTES, rep, None, False)])
    message("FloatList", [("value", _F.TYPE_FLOAT, rep, None, True)])
    message("Int64List", [("value", _F.TYPE_INT64, rep, None, True)])
    message(
        "Feature",
        [
            ("bytes_list", _F.TYPE_MESSAGE, opt, ".tensorflow.BytesList", False),
            ("float_list", _F.TYPE_MESSAGE, opt, ".tensorflow.FloatList", False),
            ("int64_list", _F.TYPE_MESSAGE, opt, ".tensorflow.Int64List", False),
        ],
        oneof="kind",
    )
    entry = descriptor_pb2.DescriptorProto(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=opt)
    entry.field.add(name="value", number=2, type=_F.TYPE_MESSAGE, label=opt, type_name=".tensorflow.Feature")
    message(
        "Features", [("feature", _F.TYPE_MESSAGE, rep, ".tensorflow.Features.FeatureEntry", False)], entry
    )
    message("Example", [("features", _F.TYPE_MESSAGE, opt, ".tensorflow.Features", False)])

    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


Example = _build_example_class()


def encode_example(features: dict[str, bytes | str | int | float | list]) -> bytes:
    """Serialize a dict as a tf.train.Example, typed as TensorFlow's converter types its features.

    bytes/str (or a list of them) -> bytes_list; int (or a list of ints) -> int64_list; float or a list
    of floats -> float_list. An empty list must be given as `(float, [])` or `(int, [])` to pick its
    type (the converter writes empty float lists for images without boxes).
    """
    example = Example()
    feature_map = example.features.feature
    for key, value in features.items():
        kind = None
        if isinstance(value, tuple):
            kind, value = value
        values = value if isinstance(value, list) else [value]
        kind = kind or type(values[0])
        feature = feature_map[key]
        if kind in (bytes, str):
            feature.bytes_list.value.extend(v.encode() if isinstance(v, str) else v for v in values)
        elif kind is int:
            feature.int64_list.value.extend(values)
        elif kind is float:
            feature.float_list.value.extend(values)
        else:
            raise TypeError(f"feature {key!r}: unsupported value type {kind.__name__}")
    return example.SerializeToString()


def parse_example(payload: bytes):
    """The parsed Example message (raises google.protobuf.message.DecodeError on bad bytes)."""
    example = Example()
    example.ParseFromString(payload)
    return example


# --- the fast path: a wire-format scan for a fixed set of keys -------------------------------------

# Columns of scan_example's `found` rows, one row per wanted key.
KIND, COUNT, START, LENGTH, VALUE = range(5)  # kind 0 = absent, 1 bytes, 2 float, 3 int64
BYTES_LIST, FLOAT_LIST, INT64_LIST = 1, 2, 3


def key_table(keys: list[tuple[str, int, int, bool]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """scan_example's (key_bytes, key_ends, rules) for wanted keys given as (key, kind, count, required)."""
    encoded = [k.encode("ascii") for k, _, _, _ in keys]
    key_bytes = np.frombuffer(b"".join(encoded), np.uint8).copy()
    rules = np.array([(kind, count, required) for _, kind, count, required in keys], np.int64).reshape(-1, 3)
    return key_bytes, np.cumsum([len(k) for k in encoded]).astype(np.int64), rules


@numba.njit(cache=True)
def _varint(buf, pos, end, max_bytes):
    """(value, position after it), or (0, -1) if it runs past `end` or is longer than max_bytes."""
    value = np.uint64(0)
    for k in range(max_bytes):
        if pos + k >= end:
            return np.uint64(0), -1
        byte = np.uint64(buf[pos + k])
        if k == 9 and byte > 1:  # a tenth byte holds bit 63 only: more is an overlong varint
            return np.uint64(0), -1
        value |= (byte & np.uint64(0x7F)) << np.uint64(7 * k)
        if byte < 0x80:
            return value, pos + k + 1
    return np.uint64(0), -1


@numba.njit(cache=True)
def _field(buf, pos, end, tag):
    """(start, end) of the length-delimited field with one-byte `tag` at pos, or (-1, -1)."""
    if pos >= end or buf[pos] != tag:
        return -1, -1
    length, start = _varint(buf, pos + 1, end, 5)
    if start < 0 or start + np.int64(length) > end:
        return -1, -1
    return start, start + np.int64(length)


@numba.njit(cache=True)
def _list(buf, start, end, kind, row):
    """Check a BytesList / FloatList / Int64List in buf[start:end] and describe it in `row`."""
    count = 0
    if kind == BYTES_LIST:
        pos = start
        while pos < end:
            s, e = _field(buf, pos, end, 0x0A)
            if s < 0:
                return False
            if count == 0:
                row[START], row[LENGTH] = s, e - s
            count += 1
            pos = e
    elif start < end:  # packed: one run of values (an empty list has none)
        s, e = _field(buf, start, end, 0x0A)
        if s < 0 or e != end:
            return False
        row[START], row[LENGTH] = s, e - s
        if kind == FLOAT_LIST:
            if (e - s) % 4:
                return False
            count = (e - s) // 4
        else:
            pos = s
            while pos < e:
                value, pos = _varint(buf, pos, e, 10)
                if pos < 0:
                    return False
                if count == 0:
                    row[VALUE] = np.int64(value)  # two's complement, as int64 fields are
                count += 1
    row[COUNT] = count
    return True


@numba.njit(cache=True)
def _which(buf, start, end, key_bytes, key_ends):
    """Index of the wanted key equal to buf[start:end], -1 for another ASCII key, -2 for non-ASCII."""
    for pos in range(start, end):
        if buf[pos] >= 0x80:
            return -2
    begin = 0
    for k in range(key_ends.size):
        if key_ends[k] - begin == end - start:
            same = True
            for i in range(end - start):
                if buf[start + i] != key_bytes[begin + i]:
                    same = False
                    break
            if same:
                return k
        begin = key_ends[k]
    return -1


@numba.njit(cache=True)
def scan_example(buf, start, end, key_bytes, key_ends, rules, found):
    """True if buf[start:end] is a plain serialized Example whose wanted keys follow `rules`; then
    found[k] (zeroed first) describes wanted key k: KIND, COUNT of values, START and LENGTH of the
    first bytes value or of the packed run, VALUE of the first int64. False: parse it with protobuf.

    rules[k] = (kind, count, required): the kind key k must have if present, the number of values it
    must have (-1: any), whether it must be present.
    """
    found[:] = 0
    f_start, f_end = _field(buf, start, end, 0x0A)  # Example.features
    if f_start < 0 or f_end != end:
        return False
    row = np.zeros(5, np.int64)
    pos = f_start
    while pos < f_end:
        e_start, e_end = _field(buf, pos, f_end, 0x0A)  # one map entry
        if e_start < 0:
            return False
        pos = e_end
        k_start, k_end = _field(buf, e_start, e_end, 0x0A)
        if k_start < 0:
            return False
        v_start, v_end = _field(buf, k_end, e_end, 0x12)
        if v_start < 0 or v_end != e_end or v_start == v_end:
            return False
        kind = buf[v_start] >> 3
        if buf[v_start] & 7 != 2 or not 1 <= kind <= 3:
            return False
        l_start, l_end = _field(buf, v_start, v_end, buf[v_start])
        if l_start < 0 or l_end != v_end:
            return False
        row[:] = 0
        if not _list(buf, l_start, l_end, kind, row):
            return False
        k = _which(buf, k_start, k_end, key_bytes, key_ends)
        if k == -2:
            return False
        if k >= 0:
            if found[k, KIND]:  # a repeated key: protobuf keeps the last; leave that to it
                return False
            if kind != rules[k, 0] or (rules[k, 1] >= 0 and row[COUNT] != rules[k, 1]):
                return False
            found[k, :] = row
            found[k, KIND] = kind
    for k in range(rules.shape[0]):
        if rules[k, 2] and not found[k, KIND]:
            return False
    return True
