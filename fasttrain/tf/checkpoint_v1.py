"""TensorFlow V1 checkpoints (tensor slices): read.

V1 (TF until 2016, the Inception seed's era; `Saver(write_version=V1)` still writes it): one table per
file, PREFIX or PREFIX-{k:05d}-of-{n:05d}. Every value is a SavedTensorSlices {meta=1, data=2}. Key ""
-> meta: SavedTensorSliceMeta {tensor=1: repeated SavedSliceMeta {name=1, shape=2, type=3, slice=4}}.
Other keys (OrderedCode: 0x00, the name with 0x00 -> 00 ff and 0xff -> ff 00 escaped, ending 00 01,
then the slice) -> data: SavedSlice {name=1, slice=2 TensorSliceProto, data=3 TensorProto} with the
values in the TensorProto's typed list (float_val=5, double_val=6, int_val=7, int64_val=10,
bool_val=11, half_val=13 for half and bfloat16, uint32_val=16, uint64_val=17; uint8, int8, int16
and uint16 in int_val) or tensor_content=4. The slices of a partitioned variable are assembled.

Source: core/util/saved_tensor_slice{.proto,_util.cc}, core/lib/strings/ordered_code.cc; the container
is an SSTable (fasttrain/tf/table.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fasttrain.checkpoint import CheckpointError
from fasttrain.tf.proto import _dtype, _finish, _Mapped, _parse, _read_as, _shape
from fasttrain.tf.table import read_table

# TF dtype code -> the TensorProto list that holds its values (tensor_util's per-dtype field: the int_val
# of DT_UINT16 too; half_val only for half and bfloat16, as their bits).
_V1_FIELDS = {1: "float_val", 2: "double_val", 3: "int_val", 4: "int_val", 5: "int_val", 6: "int_val",
              9: "int64_val", 10: "bool_val", 14: "half_val", 17: "int_val", 19: "half_val",
              22: "uint32_val", 23: "uint64_val"}  # fmt: skip


def _v1_name(key: bytes) -> str | None:
    """The tensor name an OrderedCode slice key starts with (ordered_code.cc WriteString), or None."""
    if not key.startswith(b"\x00"):
        return None
    out, pos = bytearray(), 1
    while pos + 1 < len(key):
        byte, following = key[pos], key[pos + 1]
        if byte == 0x00 and following == 0x01:
            return out.decode("utf-8", "replace")
        if byte in (0x00, 0xFF):
            out.append(byte)
            pos += 2
        else:
            out.append(byte)
            pos += 1
    return None


class CheckpointV1:
    """A V1 checkpoint: one table per file (PREFIX, or PREFIX-?????-of-?????)."""

    version = "V1"

    def __init__(self, prefix: Path, files: list[Path]):
        self.prefix, self.files = prefix, files
        self.meta: dict[str, object] = {}
        self.parts: dict[str, list[tuple[Path, memoryview, int]]] = {}
        for path in files:
            for key, value, offset in read_table(_Mapped(path).data, path):
                if key == b"":
                    for m in _parse("SavedTensorSlices", value, path, offset).meta.tensor:
                        # A name that is not UTF-8 comes as bytes: decoded as the slice keys' names are.
                        name = m.name if isinstance(m.name, str) else bytes(m.name).decode("utf-8", "replace")
                        self.meta[name] = m
                elif (name := _v1_name(key)) is not None:
                    self.parts.setdefault(name, []).append((path, value, offset))
                else:
                    raise CheckpointError(f"{path} is corrupt: an unreadable key at offset {offset}")
        if not self.meta:
            raise CheckpointError(f'{files[0]} has no tensor list (key ""): not a TensorFlow V1 checkpoint')

    def shapes(self) -> dict[str, tuple[tuple[int, ...], np.dtype | None]]:
        return {n: (_shape(m.shape, n, self.files[0]), _read_as(m.type)) for n, m in self.meta.items()}

    def get(self, name: str) -> np.ndarray:
        meta, where = self.meta[name], self.files[0]
        dtype, shape = _dtype(meta.type, name, where), _shape(meta.shape, name, where)
        pieces, held = [], 0
        for path, value, offset in self.parts.get(name, []):
            saved = _parse("SavedTensorSlices", value, path, offset).data
            index = _slice_index(
                saved.slice, shape, f"{path} is corrupt: a slice of {name} at offset {offset}"
            )
            places = math.prod(s.stop - s.start for s in index)
            tensor = saved.data
            if tensor.tensor_content:
                if len(tensor.tensor_content) % dtype.itemsize:
                    raise CheckpointError(
                        f"{path} is corrupt: a slice of {name} at offset {offset} holds "
                        f"{len(tensor.tensor_content)} bytes, not a whole number of {dtype} values"
                    )
                values = np.frombuffer(tensor.tensor_content, dtype.newbyteorder("<"))
            else:
                values = np.asarray(getattr(tensor, _V1_FIELDS[meta.type]))
                values = values.astype(np.uint16).view(np.float16) if dtype == np.float16 else values
            if values.size != places:
                raise CheckpointError(
                    f"{path} is corrupt: a slice of {name} at offset {offset} holds {values.size} values "
                    f"for {places} places"
                )
            pieces.append((index, values, path, offset))
            held += places
        # Before allocating: a declared shape (e.g. (2**40, 2**20)) its slices cannot fill is refused here,
        # not by numpy's allocation.
        if held < math.prod(shape):
            raise CheckpointError(
                f"{where}: variable {name} is incomplete ({held} of {math.prod(shape)} values)"
            )
        full, covered = np.zeros(shape, dtype), np.zeros(shape, np.bool_)
        for index, values, path, offset in pieces:
            if covered[index].any():
                raise CheckpointError(
                    f"{path} is corrupt: a slice of {name} at offset {offset} overlaps another of its slices"
                )
            covered[index] = True
            full[index] = values.astype(dtype).reshape(full[index].shape)
        if not covered.all():
            raise CheckpointError(
                f"{where}: variable {name} is incomplete ({int(covered.sum())} of {full.size} values)"
            )
        return _finish(full, meta.type)


def _slice_index(proto, shape: tuple[int, ...], what: str) -> tuple[slice, ...]:
    """The index of a TensorSliceProto in a tensor of `shape`: one extent per dimension, each within it
    (an extent without a length is the whole dimension, TensorSlice's kFullExtent)."""
    if len(proto.extent) != len(shape):
        raise CheckpointError(f"{what} has {len(proto.extent)} extents for its {len(shape)} dimensions")
    index = []
    for axis, (extent, dim) in enumerate(zip(proto.extent, shape)):
        start = int(extent.start)
        stop = start + int(extent.length) if extent.HasField("length") else dim
        if not 0 <= start <= stop <= dim:
            raise CheckpointError(f"{what} spans [{start}, {stop}) of dimension {axis}, of size {dim}")
        index.append(slice(start, stop))
    return tuple(index)
