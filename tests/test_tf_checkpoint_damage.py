"""fasttrain.tf.checkpoint on crafted and damaged files, written with fasttrain's own table writer:
each ends in one CheckpointError naming the file (and offset or variable), never a traceback, a wrong
value read silently, or an allocation the file cannot fill. Values expected are written out by hand."""

from pathlib import Path

import numpy as np
import pytest

from fasttrain.checkpoint import CheckpointError
from fasttrain.data.tfrecord import masked_crc32c
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


def test_v1_tensor_content_not_whole_values(tmp_path):
    # 7 bytes for two float32 values: numpy's frombuffer raised ValueError before the size was checked.
    path = write_v1(tmp_path / "odd", (2,), [([{}], [1.0, 2.0])])
    items = []
    for key, value, _ in read_table(path.read_bytes(), path):
        value = bytes(value)
        if key:
            saved = _MSG["SavedTensorSlices"].FromString(value)
            del saved.data.data.float_val[:]
            saved.data.data.tensor_content = b"\x00" * 7
            value = saved.SerializeToString()
        items.append((key, value))
    path.write_bytes(build_table(items))
    with pytest.raises(
        CheckpointError,
        match=rf"^{path} is corrupt: a slice of w at offset \d+ holds 7 bytes, not a whole number of float32",
    ):
        open_checkpoint(path).get("w")


def test_v1_tensor_name_not_utf8_is_a_name_like_the_others(tmp_path):
    # protobuf hands a string field that is not UTF-8 over as bytes: it became a bytes key beside the str
    # ones, and the name checks that split names on "/" ended in a TypeError.
    path = write_v1(tmp_path / "name", (1,), [([{}], [1.0])], name="bool/Zalue")
    items = [
        (key, bytes(value).replace(b"bool/Zalue", b"bool/\xffalue") if key == b"" else bytes(value))
        for key, value, _ in read_table(path.read_bytes(), path)
    ]
    path.write_bytes(build_table(items))
    ckpt = open_checkpoint(path)
    assert list(ckpt.shapes()) == ["bool/\ufffdalue"]  # decoded as the slice keys' names are
    with pytest.raises(CheckpointError, match="variable bool/\ufffdalue is incomplete"):
        ckpt.get("bool/\ufffdalue")  # its slices are under the other name


@pytest.mark.parametrize(
    "dims", [(0, 2**40, 2**40), (0,) + (1,) * 64], ids=["no-values-yet-too-big", "65-dimensions"]
)
def test_v2_shape_no_array_can_hold(tmp_path, dims):
    # Zero values pass the size check (the product is 0), but numpy can make no such array: a ValueError
    # from reshape (or from np.zeros in V1) before.
    prefix = write_checkpoint(tmp_path / "model.ckpt-1", {"w": np.ones(1, np.float32)}, state_file=False)

    def shaped(entry):
        del entry.shape.dim[:]
        for d in dims:
            entry.shape.dim.add(size=d)

    _rewrite_v2_entry(prefix, "w", shaped)
    with pytest.raises(CheckpointError, match=r"ckpt-1.index is corrupt: variable w has shape .*no array"):
        open_checkpoint(prefix).shapes()


def test_a_scalar_classifier_is_named_not_an_index_error(tmp_path):
    # network_widths read the classifier's and the stem's last dimension: a scalar raised IndexError.
    import shutil

    from fasttrain.tf.state import network_widths

    src = Path(__file__).parent / "data" / "tf-resnet-v2" / "resnet18_v2_w4"
    shutil.copytree(src, tmp_path / "ckpt")
    prefix = tmp_path / "ckpt" / "model.ckpt-0"

    def scalar(entry):
        del entry.shape.dim[:]
        entry.size = 4
        data = Path(f"{prefix}.data-00000-of-00001").read_bytes()[entry.offset : entry.offset + 4]
        entry.crc32c = masked_crc32c(data)

    _rewrite_v2_entry(prefix, "resnet/dense/kernel", scalar)
    with pytest.raises(
        CheckpointError, match=r"variable resnet/dense/kernel has shape \(\), not a dense kernel"
    ):
        network_widths(open_checkpoint(prefix), "resnet18_v2")


def test_v2_two_keys_that_decode_to_one_name(tmp_path):
    # Keys that are not UTF-8 are decoded with replacement, so b"w\xfe" and b"w\xff" both read as
    # "w\ufffd": the second replaced the first without a word.
    prefix = write_checkpoint(tmp_path / "model.ckpt-1", {"w": np.ones(1, np.float32)}, state_file=False)
    index = Path(f"{prefix}.index")
    items = []
    for key, value, _ in read_table(index.read_bytes(), index):
        if key == b"w":
            items += [(b"w\xfe", bytes(value)), (b"w\xff", bytes(value))]
        else:
            items.append((key, bytes(value)))
    index.write_bytes(build_table(items))
    with pytest.raises(CheckpointError, match=r"is corrupt: the key at offset \d+ names 'w\ufffd' again"):
        open_checkpoint(prefix)
