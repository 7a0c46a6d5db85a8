"""TensorFlow's checkpoint protobuf messages and dtypes, and the file access both readers share.

The protobuf messages are built from descriptors at import time (as fasttrain.data.example does), with
TensorFlow's field numbers; enum fields are read as int32, their wire type.
"""

from __future__ import annotations

import math
import mmap
import os
import re
from pathlib import Path

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from fasttrain.checkpoint import CheckpointError

# tensorflow/core/framework/types.proto DataType -> numpy dtype (bfloat16, 14, is read as float32).
DTYPES = {1: np.float32, 2: np.float64, 3: np.int32, 4: np.uint8, 5: np.int16, 6: np.int8, 9: np.int64,
          10: np.bool_, 17: np.uint16, 19: np.float16, 22: np.uint32, 23: np.uint64}  # fmt: skip
_DT_BFLOAT16 = 14
DTYPE_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
# The shapes numpy can hold: 64 dimensions at most, and (for 8-byte values) at most 2**60 of them.
_MAX_DIMS, _MAX_ELEMENTS = 64, 2**60


# TensorFlow's messages, one a line: "number name type", `*` before a repeated field's type; a capitalised
# type is a message. Enums (DataType, Endianness) are int32 on the wire.
_MESSAGES = """
Dim: 1 size int64, 2 name string
TensorShapeProto: 2 dim *Dim, 3 unknown_rank bool
Extent: 1 start int64, 2 length int64
TensorSliceProto: 1 extent *Extent
VersionDef: 1 producer int32, 2 min_consumer int32, 3 bad_consumers *int32
BundleHeaderProto: 1 num_shards int32, 2 endianness int32, 3 version VersionDef
BundleEntryProto: 1 dtype int32, 2 shape TensorShapeProto, 3 shard_id int32, 4 offset int64, 5 size int64,
    6 crc32c fixed32, 7 slices *TensorSliceProto
TensorProto: 1 dtype int32, 2 tensor_shape TensorShapeProto, 4 tensor_content bytes, 5 float_val *float,
    6 double_val *double, 7 int_val *int32, 8 string_val *bytes, 10 int64_val *int64, 11 bool_val *bool,
    13 half_val *int32, 16 uint32_val *uint32, 17 uint64_val *uint64
SavedSliceMeta: 1 name string, 2 shape TensorShapeProto, 3 type int32, 4 slice *TensorSliceProto
SavedTensorSliceMeta: 1 tensor *SavedSliceMeta, 2 versions VersionDef
SavedSlice: 1 name string, 2 slice TensorSliceProto, 3 data TensorProto
SavedTensorSlices: 1 meta SavedTensorSliceMeta, 2 data SavedSlice
"""


def _build_messages() -> dict:
    F = descriptor_pb2.FieldDescriptorProto
    # proto2, so that Extent.length can be told absent (a full extent) from 0.
    file = descriptor_pb2.FileDescriptorProto(name="fasttrain/tf/checkpoint.proto", package="ftckpt")
    file.syntax = "proto2"
    names = []
    for definition in re.split(r"\n(?=\w)", _MESSAGES.strip()):
        name, fields = definition.split(":", 1)
        msg = file.message_type.add(name=name)
        names.append(name)
        for field in fields.split(","):
            number, field_name, kind = field.split()
            label = F.LABEL_REPEATED if kind.startswith("*") else F.LABEL_OPTIONAL
            kind = kind.lstrip("*")
            f = msg.field.add(name=field_name, number=int(number), label=label)
            if kind[0].isupper():
                f.type, f.type_name = F.TYPE_MESSAGE, f".ftckpt.{kind}"
            else:
                f.type = getattr(F, f"TYPE_{kind.upper()}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"ftckpt.{n}")) for n in names}


_MSG = _build_messages()


def _parse(kind: str, value, path: Path, offset: int):
    message = _MSG[kind]()
    try:
        message.ParseFromString(bytes(value))
    except DecodeError:
        raise CheckpointError(f"{path} is corrupt: the {kind} at offset {offset} does not parse") from None
    return message


def _shape(proto, name: str, path: Path) -> tuple[int, ...]:
    """A TensorShapeProto's dimensions; CheckpointError for a negative one (unknown: no saved tensor)."""
    shape = tuple(int(d.size) for d in proto.dim)
    if any(d < 0 for d in shape):
        raise CheckpointError(f"{path} is corrupt: variable {name} has shape {shape}, a negative dimension")
    # numpy's limits, which a size check alone lets through when a dimension is 0: (0, 2**40, 2**40)
    # has no values yet no array of it can be made, nor of more than 64 dimensions.
    if len(shape) > _MAX_DIMS or math.prod(d for d in shape if d) > _MAX_ELEMENTS:
        raise CheckpointError(
            f"{path} is corrupt: variable {name} has shape {shape[:8]}{'...' if len(shape) > 8 else ''} "
            f"({len(shape)} dimensions), which no array can hold"
        )
    return shape


def _dtype(code: int, name: str, path: Path):
    if code == _DT_BFLOAT16:
        return np.dtype(np.uint16)  # converted to float32 by _finish
    if code not in DTYPES:
        raise CheckpointError(f"{path}: variable {name} has TF dtype {code} (string or other), not supported")
    return np.dtype(DTYPES[code])


def _read_as(code: int) -> np.dtype | None:
    """The dtype get() returns for TF dtype `code` (float32 for bfloat16); None where it reads none
    (string, resource, ...): shapes() lists such a variable, and only get() of it is an error, so an
    unrelated string (a run note, TF2's _CHECKPOINTABLE_OBJECT_GRAPH) does not stop an import."""
    if code == _DT_BFLOAT16:
        return np.dtype(np.float32)
    return np.dtype(DTYPES[code]) if code in DTYPES else None


def _finish(array: np.ndarray, code: int) -> np.ndarray:
    if code == _DT_BFLOAT16:  # bfloat16 is the upper half of a float32
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


class _Mapped:
    """A file's bytes through mmap (a checkpoint can be gigabytes); CheckpointError when unreadable."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as exc:
            raise CheckpointError(f"cannot read {path} ({exc.strerror})") from None
