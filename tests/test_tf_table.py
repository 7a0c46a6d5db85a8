"""fasttrain.tf.table on crafted SSTables: block handles that name a block again or lie out of file
order, and keys out of order or repeated, are one CheckpointError naming the file and offset (a crafted
38 kB index of 3000 handles to one block of 3000 entries took 34 s, quadratic in its size)."""

import struct

import pytest

from fasttrain.checkpoint import CheckpointError
from fasttrain.data.tfrecord import masked_crc32c
from fasttrain.tf import table
from fasttrain.tf.checkpoint import open_checkpoint
from fasttrain.tf.table import build_table, read_table


def _table(data_blocks: list, index: list[tuple[bytes, int]]) -> bytes:
    """Data blocks laid out in order (each a list of (key, value) items, or a block's bytes as they
    are), then an index whose entry (key, i) names data block i."""
    out, handles = bytearray(), []

    def add(contents: bytes) -> bytes:
        handle = bytearray()
        table._put_varint(handle, len(out))
        table._put_varint(handle, len(contents))
        out.extend(contents + b"\x00" + struct.pack("<I", masked_crc32c(contents + b"\x00")))
        return bytes(handle)

    handles = [add(b if isinstance(b, bytes) else table._build_block(b)) for b in data_blocks]
    meta = add(table._build_block([]))
    index_handle = add(table._build_block([(key, handles[i]) for key, i in index]))
    return bytes(out + (meta + index_handle).ljust(40, b"\x00") + struct.pack("<Q", table.TABLE_MAGIC))


def test_many_handles_to_one_block_are_refused_at_the_second(tmp_path):
    n = 3000  # 38 kB
    entries = [(b"", b"")] + [(b"k%07d" % i, b"") for i in range(n)]
    crafted = tmp_path / "model.ckpt-1.index"
    crafted.write_bytes(_table([entries], [(b"z%07d" % i, 0) for i in range(n)]))
    assert 30_000 < crafted.stat().st_size < 40_000
    with pytest.raises(
        CheckpointError,
        match=rf"^{crafted} is corrupt: the index entry at offset \d+ names a block at offset 0 ",
    ):
        open_checkpoint(tmp_path / "model.ckpt-1")


def test_blocks_out_of_file_order(tmp_path):
    crafted = tmp_path / "t"
    crafted.write_bytes(_table([[(b"a", b"1")], [(b"b", b"2")]], [(b"a", 1), (b"b", 0)]))
    with pytest.raises(
        CheckpointError, match=r"names a block at offset 0 of \d+ bytes, not after the previous"
    ):
        list(read_table(crafted.read_bytes(), crafted))


def test_blocks_in_order_read(tmp_path):
    crafted = tmp_path / "t"
    crafted.write_bytes(_table([[(b"a", b"1")], [(b"b", b"2"), (b"c", b"3")]], [(b"a", 0), (b"c", 1)]))
    got = [(k, bytes(v)) for k, v, _ in read_table(crafted.read_bytes(), crafted)]
    assert got == [(b"a", b"1"), (b"b", b"2"), (b"c", b"3")]


@pytest.mark.parametrize(
    "keys, why",
    [([b"a", b"b", b"b"], "repeats"), ([b"a", b"c", b"b"], "sorts before"), ([b"", b""], "repeats")],
)
def test_keys_out_of_order_or_repeated(tmp_path, keys, why):
    crafted = tmp_path / "t"
    crafted.write_bytes(build_table([(k, b"%d" % i) for i, k in enumerate(keys)]))
    with pytest.raises(
        CheckpointError,
        match=rf"^{crafted} is corrupt: the key of the entry whose value is at offset \d+ {why}",
    ):
        list(read_table(crafted.read_bytes(), crafted))


def test_repeated_key_across_blocks(tmp_path):
    crafted = tmp_path / "t"
    crafted.write_bytes(_table([[(b"a", b"1")], [(b"a", b"2")]], [(b"a", 0), (b"a", 1)]))
    with pytest.raises(CheckpointError, match=r"repeats the previous key"):
        list(read_table(crafted.read_bytes(), crafted))


def _block_of(entries: list[tuple[int, bytes]]) -> bytes:
    """A data block of (shared, key tail) entries with empty values, one restart point (at 0)."""
    out = bytearray()
    for shared, tail in entries:
        for n in (shared, len(tail), 0):
            table._put_varint(out, n)
        out += tail
    return bytes(out + struct.pack("<II", 0, 1))


def test_keys_sharing_more_than_a_tf_table_can_are_refused(tmp_path):
    # Each entry shares the whole previous key and adds a byte: 4 bytes on disk, a key one byte longer
    # in memory. 20,000 of them (80 kB) decoded to 2 GB of keys before (quadratic in the file's size).
    first = b"v" * 1000
    entries = [(0, first)] + [(len(first) + i, b"\x01") for i in range(20000)]
    path = tmp_path / "shared.index"
    path.write_bytes(_table([_block_of(entries)], [(first + b"\x01" * 20000, 0)]))
    with pytest.raises(
        CheckpointError,
        match=rf"^{path} is corrupt: the keys of the block at offset 0 share more than a TF table's keys "
        r"can \(entry at offset \d+\)",
    ):
        list(read_table(path.read_bytes(), path))


def test_long_keys_sharing_as_tfs_writer_shares_them_are_read(tmp_path):
    # The bound's edge for a real writer: keys of 1,000 bytes that differ in their last bytes, sharing
    # restarted every 16 entries (table_builder.cc): every key decoded, none refused.
    keys = [b"k" * 994 + b"%06d" % i for i in range(200)]
    path = tmp_path / "long.index"
    path.write_bytes(build_table([(k, b"") for k in keys]))
    assert [k for k, _, _ in read_table(path.read_bytes(), path)] == keys
