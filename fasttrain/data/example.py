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
"""

from __future__ import annotations

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
