"""fasttrain.tf.checkpoint on crafted and damaged files, written with fasttrain's own table writer:
each ends in one CheckpointError naming the file (and offset or variable), never a traceback, a wrong
value read silently, or an allocation the file cannot fill. Values expected are written out by hand."""

from pathlib import Path

import numpy as np
import pytest

from fasttrain.checkpoint import CheckpointError
from fasttrain.tf.checkpoint import open_checkpoint, write_checkpoint
from fasttrain.tf.proto import _MSG
from fasttrain.tf.table import build_table, read_table


def _v1_key(name: str, part: int) -> bytes:
    """OrderedCode of the name (ordered_code.cc WriteString), then a distinct tail per slice."""
    return (
        b"\x00"
        + name.encode().replace(b"\x00", b"\x00\xff").replace(b"\xff", b"\xff\x00")
        + b"\x00\x01"
        + bytes([part])
    )


def write_v1(path: Path, shape, slices, dtype: int = 1, name: str = "w") -> Path:
    """A V1 table of one float32 variable `name` of the declared `shape`, from `slices`: a list of
    (extents, values), an extent a dict of start/length (empty: the whole dimension)."""
    meta = _MSG["SavedTensorSlices"]()
    m = meta.meta.tensor.add(name=name, type=dtype)
    for d in shape:
        m.shape.dim.add(size=d)
    items = [(b"", meta.SerializeToString())]
    for i, (extents, values) in enumerate(slices):
        saved = _MSG["SavedTensorSlices"]()
        saved.data.name = name
        for e in extents:
            saved.data.slice.extent.add(**e)
        saved.data.data.dtype = dtype
        saved.data.data.float_val.extend(values)
        items.append((_v1_key(name, i), saved.SerializeToString()))
    path.write_bytes(build_table(items))
    return path


def test_v1_slices_assembled(tmp_path):
    path = write_v1(
        tmp_path / "ok", (2, 2), [([{}, {"start": 1, "length": 1}], [2, 4]), ([{}, {"length": 1}], [1, 3])]
    )
    assert np.array_equal(open_checkpoint(path).get("w"), np.array([[1, 2], [3, 4]], np.float32))


def test_v1_overlapping_slices(tmp_path):
    path = write_v1(tmp_path / "overlap", (4,), [([{"start": 0, "length": 2}], [1, 2])] * 2)
    with pytest.raises(
        CheckpointError, match=rf"^{path} is corrupt: a slice of w at offset \d+ overlaps another"
    ):
        open_checkpoint(path).get("w")


def test_v1_slices_overlapping_in_part_or_short(tmp_path):
    path = write_v1(
        tmp_path / "gap", (4,), [([{"start": 0, "length": 2}], [1, 2]), ([{"start": 1, "length": 2}], [3, 4])]
    )
    with pytest.raises(CheckpointError, match=r"overlaps another"):  # 4 values held, but [1, 2) twice
        open_checkpoint(path).get("w")
    path = write_v1(tmp_path / "short", (4,), [([{"start": 0, "length": 2}], [1, 2])])
    with pytest.raises(CheckpointError, match=rf"^{path}: variable w is incomplete \(2 of 4 values\)"):
        open_checkpoint(path).get("w")


@pytest.mark.parametrize(
    "extents, why",
    [
        ([{}, {}], r"has 2 extents for its 1 dimensions"),
        ([], r"has 0 extents for its 1 dimensions"),
        ([{"start": -4, "length": 4}], r"spans \[-4, 0\) of dimension 0, of size 4"),
        ([{"start": 2, "length": 4}], r"spans \[2, 6\) of dimension 0, of size 4"),
        ([{"start": 2}], r"spans \[2, 4\) of dimension 0|holds 4 values for 2 places"),
    ],
)
def test_v1_slice_outside_its_tensor(tmp_path, extents, why):
    path = write_v1(tmp_path / "bad", (4,), [(extents, [1, 2, 3, 4])])
    with pytest.raises(CheckpointError, match=rf"^{path} is corrupt: a slice of w at offset \d+ .*({why})"):
        open_checkpoint(path).get("w")


def test_v1_declared_shape_larger_than_its_slices_is_refused_before_allocating(tmp_path):
    path = write_v1(tmp_path / "huge", (2**40, 2**20), [([{"length": 1}, {"length": 1}], [1.0])])
    with pytest.raises(CheckpointError, match=rf"^{path}: variable w is incomplete \(1 of {2**60} values\)"):
        open_checkpoint(path).get("w")


def test_v1_negative_dimension(tmp_path):
    path = write_v1(tmp_path / "neg", (-1,), [([{}], [1.0])])
    with pytest.raises(
        CheckpointError, match=rf"^{path} is corrupt: variable w has shape \(-1,\), a negative"
    ):
        open_checkpoint(path).shapes()


def _rewrite_v2_entry(prefix: Path, name: str, edit) -> None:
    """Rewrite the V2 index with edit(entry) applied to `name`'s BundleEntryProto."""
    index = Path(f"{prefix}.index")
    items = []
    for key, value, _ in read_table(index.read_bytes(), index):
        if key == name.encode():
            entry = _MSG["BundleEntryProto"].FromString(bytes(value))
            edit(entry)
            value = entry.SerializeToString()
        items.append((key, bytes(value)))
    index.write_bytes(build_table(items))


def test_v2_negative_dimension(tmp_path):
    prefix = write_checkpoint(tmp_path / "model.ckpt-1", {"w": np.ones(1, np.float32)}, state_file=False)

    def negative(entry):
        del entry.shape.dim[:]
        entry.shape.dim.add(size=-1)
        entry.shape.dim.add(size=-1)

    _rewrite_v2_entry(prefix, "w", negative)
    with pytest.raises(
        CheckpointError, match=r"model.ckpt-1.index is corrupt: variable w has shape \(-1, -1\)"
    ):
        open_checkpoint(prefix).get("w")
