"""fasttrain.tf.checkpoint against checkpoints TensorFlow 2.21 wrote (tests/data/make_tf_checkpoints.py):
the V2 bundle and the V1 table (a partitioned variable assembled) read to the values TF saved, every
dtype and shape bit for bit; damaged copies (a flipped byte, a cut file, a missing shard), files that
are not TF's and a V2 partitioned variable each end in one CheckpointError naming the file or the
variable; the V2 writer's output reads back exactly, and its data file is TF's byte for byte (TF's
own reading of the whole is checked by hand, see the README)."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from fasttrain.checkpoint import CheckpointError
from fasttrain.tf.checkpoint import (
    checkpoint_prefix,
    is_tf_checkpoint,
    open_checkpoint,
    write_checkpoint,
)

FIXTURES = Path(__file__).parent / "data" / "tf-checkpoints" / "format"


def expected() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "expected.npz") as saved:
        return {k.replace("|", "/"): saved[k] for k in saved.files}


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_reads_what_tensorflow_wrote(version):
    ckpt = open_checkpoint(FIXTURES / version)  # the directory: its `checkpoint` file names the prefix
    assert ckpt.version == version.upper()
    want = {k: v for k, v in expected().items() if version == "v1" or k != "partitioned/weights"}
    shapes = ckpt.shapes()
    assert sorted(shapes) == sorted(want)
    for name, value in want.items():
        got = ckpt.get(name)
        assert shapes[name] == (value.shape, value.dtype), name
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert np.array_equal(got, value), name
    assert ckpt.get("global_step").dtype == np.float32  # the Inception seed's float global_step
    assert ckpt.get("resnet/global_step64") == 123456789012  # needs all 64 bits


def test_prefix_forms():
    prefix = FIXTURES / "v2" / "model.ckpt-7"
    for given in (prefix, f"{prefix}.index", f"{prefix}.data-00000-of-00001", FIXTURES / "v2"):
        assert checkpoint_prefix(given) == prefix
        assert is_tf_checkpoint(given)
    assert is_tf_checkpoint(FIXTURES / "v1" / "model.ckpt-7")
    assert not is_tf_checkpoint(FIXTURES / "expected.npz")


def _copy(tmp_path: Path, version: str) -> Path:
    target = tmp_path / version
    shutil.copytree(FIXTURES / version, target)
    return target


def _read_all(path) -> None:
    ckpt = open_checkpoint(path)
    for name in ckpt.shapes():
        ckpt.get(name)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_v2_corrupt_tensor_bytes_name_the_file_variable_and_offset(tmp_path):
    d = _copy(tmp_path, "v2")
    entry = open_checkpoint(d).entries["conv0/weights"]
    data = d / "model.ckpt-7.data-00000-of-00001"
    _flip(data, entry.offset + 5)
    with pytest.raises(CheckpointError, match=rf"{data}.*conv0/weights at offset {entry.offset}.*checksum"):
        _read_all(d)


def test_v2_truncated_data_file(tmp_path):
    d = _copy(tmp_path, "v2")
    data = d / "model.ckpt-7.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{data} is truncated: variable .* needs bytes \["):
        _read_all(d)


def test_v2_missing_data_file(tmp_path):
    d = _copy(tmp_path, "v2")
    (d / "model.ckpt-7.data-00000-of-00001").unlink()
    with pytest.raises(CheckpointError, match=r"model.ckpt-7.data-00000-of-00001 is missing"):
        _read_all(d)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_flipped_byte_anywhere_in_the_table_is_one_error(tmp_path, version):
    d = _copy(tmp_path, version)
    table = d / ("model.ckpt-7.index" if version == "v2" else "model.ckpt-7")
    size = table.stat().st_size
    # Every byte but the footer's padding (after the two block handles, before the magic), which no
    # reader looks at, TF's included.
    footer = table.read_bytes()[-48:]
    handles_end = [i for i, b in enumerate(footer) if b < 0x80][3] + 1  # the 4th varint's last byte
    padding = range(size - 48 + handles_end, size - 8)
    for offset in [o for o in range(0, size, 5) if o not in padding]:  # every 5th byte: 2 s, not 20
        shutil.copy(FIXTURES / version / table.name, table)
        _flip(table, offset)
        with pytest.raises(CheckpointError, match=str(table)):
            _read_all(d)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("keep", [0, 10, 47, 200, -1])
def test_cut_table_is_one_error(tmp_path, version, keep):
    d = _copy(tmp_path, version)
    table = d / ("model.ckpt-7.index" if version == "v2" else "model.ckpt-7")
    table.write_bytes(table.read_bytes()[:keep])
    with pytest.raises(CheckpointError, match=rf"{table} is not a TensorFlow checkpoint file"):
        _read_all(d)


def test_v1_block_checksum_names_the_offset(tmp_path):
    d = _copy(tmp_path, "v1")
    _flip(d / "model.ckpt-7", 30)  # inside the first data block
    with pytest.raises(CheckpointError, match=r"block at offset 0 does not match its checksum"):
        _read_all(d)


def test_not_a_checkpoint(tmp_path):
    other = tmp_path / "model.ckpt-1"
    other.write_bytes(b"PK\x03\x04" + bytes(200))  # a zip (torch) file, say
    assert not is_tf_checkpoint(other)
    with pytest.raises(CheckpointError, match=rf"{other} is not a TensorFlow checkpoint file"):
        open_checkpoint(other)
    with pytest.raises(CheckpointError, match=r"no TensorFlow checkpoint at .*nothing"):
        open_checkpoint(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=r"has no readable `checkpoint` file"):
        open_checkpoint(tmp_path)
    (tmp_path / "checkpoint").write_text("garbage\n")
    with pytest.raises(CheckpointError, match=r"names no model_checkpoint_path"):
        open_checkpoint(tmp_path)


def test_checkpoint_file_with_a_moved_absolute_path(tmp_path):
    d = _copy(tmp_path, "v2")
    (d / "checkpoint").write_text('model_checkpoint_path: "/gone/elsewhere/model.ckpt-7"\n')
    assert open_checkpoint(d).prefix == d / "model.ckpt-7"


def test_writer_round_trip_every_dtype(tmp_path):
    tensors = {k: v for k, v in expected().items()}
    tensors["a/long/name/" + "x" * 300] = np.arange(7, dtype=np.int64)
    tensors.update({f"layer{i}/kernel": np.full((2, 1), i, np.float32) for i in range(40)})  # many blocks
    prefix = write_checkpoint(tmp_path / "run" / "model.ckpt-12", tensors)
    assert (tmp_path / "run" / "checkpoint").read_text().startswith('model_checkpoint_path: "model.ckpt-12"')
    ckpt = open_checkpoint(tmp_path / "run")
    assert ckpt.prefix == prefix and sorted(ckpt.shapes()) == sorted(tensors)
    for name, value in tensors.items():
        got = ckpt.get(name)
        assert got.dtype == value.dtype and got.shape == value.shape and np.array_equal(got, value), name


def test_writer_matches_tensorflows_bytes_for_the_data_file(tmp_path):
    """TF lays the tensors out in name order with no padding: the data file is the same bytes."""
    tensors = {k: v for k, v in expected().items() if k != "partitioned/weights"}
    write_checkpoint(tmp_path / "model.ckpt-7", tensors)
    ours = (tmp_path / "model.ckpt-7.data-00000-of-00001").read_bytes()
    assert ours == (FIXTURES / "v2" / "model.ckpt-7.data-00000-of-00001").read_bytes()


def test_v2_partitioned_variable_is_refused_by_name():
    ckpt = open_checkpoint(FIXTURES / "v2-partitioned")
    assert ckpt.shapes()["partitioned/weights"][0] == (6, 2)
    assert np.array_equal(ckpt.get("conv0/weights"), expected()["conv0/weights"])  # the rest reads
    with pytest.raises(CheckpointError, match=r"variable partitioned/weights is partitioned, which is not"):
        ckpt.get("partitioned/weights")


def test_checkpoint_file_escapes(tmp_path):
    """The `checkpoint` file is a text proto: non-ASCII bytes written as octal escapes (CEscape)."""
    run = tmp_path / "r\u00e9sum\u00e9"
    shutil.copytree(FIXTURES / "v2", run)
    for name in ("index", "data-00000-of-00001"):
        (run / f"model.ckpt-7.{name}").rename(run / f"mod\u00e8le.ckpt-7.{name}")
    (run / "checkpoint").write_text('model_checkpoint_path: "mod\\303\\250le.ckpt-7"\n')
    assert open_checkpoint(run).prefix == run / "mod\u00e8le.ckpt-7"
