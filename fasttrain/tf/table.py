"""The SSTable (LevelDB's table format) that TensorFlow's checkpoints are made of: read and write.

    for key, value, offset in read_table(data, path): ...     # data: bytes or an mmap of the file
    build_table([(b"", header), (b"name", entry), ...])       # keys sorted; one data block

Source: tensorflow/core/lib/io/{format,block,block_builder,table,table_builder}.cc.

Layout (all integers little endian):
    data blocks | metaindex block | index block | footer (48 bytes)
    footer  = varint64 (offset, size) of the metaindex and of the index block, zero-padded to 40 bytes,
              then the magic 0xdb4775248b80fb57 as a fixed64
    block   = entries | uint32 restarts[n] | uint32 n, then a 5-byte trailer: 1 byte compression
              (0 none; TF's checkpoint writers set none) + masked crc32c of block||type byte
    entry   = varint32 shared | varint32 non_shared | varint32 value_len | key[shared:] | value
              (the key shares `shared` bytes with the previous key; restarts reset sharing)
    index   = one entry per data block: a key >= the block's last key -> varint64 (offset, size)
    masked crc32c(b) = ((c >> 15) | (c << 17)) + 0xa282ead8 mod 2^32, c = crc32c(b) (as TFRecord's)

Every failure (a length or handle outside its block or file, a checksum mismatch, a compressed block,
data blocks overlapping or out of file order, keys not strictly rising, a block's keys adding up to more
than 16 times its size, which no writer's sharing, restarted every 16 entries, can make) is a
CheckpointError naming the file and the byte offset.
"""

from __future__ import annotations

import struct
from pathlib import Path

from fasttrain.checkpoint import CheckpointError
from fasttrain.data.tfrecord import masked_crc32c

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_BYTES = 48
_TRAILER_BYTES = 5  # compression type + masked crc32c
# table_builder.cc's Options::block_restart_interval (16; tensor_bundle and V1's writers keep it).
_RESTART_INTERVAL = 16


def _varint(buf, pos: int, end: int, where) -> tuple[int, int]:
    """(value, next position) of the varint at buf[pos:end]; where = (file, buf's offset in the file)."""
    result = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise CheckpointError(f"{where[0]} is corrupt: a length runs past its block at offset {where[1] + pos}")


def _block(data, offset: int, size: int, path: Path) -> memoryview:
    """The contents of the block at [offset, offset + size), its trailer's checksum verified."""
    if offset < 0 or size < 4 or offset + size + _TRAILER_BYTES > len(data) - FOOTER_BYTES:
        raise CheckpointError(
            f"{path} is truncated or corrupt: a block at offset {offset} of {size} bytes lies outside the "
            f"file's {len(data)} bytes"
        )
    end = offset + size
    kind, crc = data[end], struct.unpack_from("<I", data, end + 1)[0]
    if masked_crc32c(bytes(data[offset : end + 1])) != crc:
        raise CheckpointError(f"{path} is corrupt: the block at offset {offset} does not match its checksum")
    if kind != 0:
        raise CheckpointError(f"{path}: block at offset {offset} is compressed (type {kind}), which TF's "
                              "checkpoint writers never do; not supported")  # fmt: skip
    return memoryview(data)[offset:end]


def _entries(block: memoryview, offset: int, path: Path):
    """(key, value) of every entry of a block; `offset` is the block's place in the file (for errors)."""
    size = len(block)
    num_restarts = struct.unpack_from("<I", block, size - 4)[0]
    limit = size - 4 - 4 * num_restarts
    if num_restarts < 1 or limit < 0:
        raise CheckpointError(f"{path} is corrupt: bad restart count in the block at offset {offset}")
    where, pos, key, key_bytes = (path, offset), 0, b"", 0
    while pos < limit:
        start = pos
        shared, pos = _varint(block, pos, limit, where)
        non_shared, pos = _varint(block, pos, limit, where)
        value_len, pos = _varint(block, pos, limit, where)
        if shared > len(key) or pos + non_shared + value_len > limit:
            raise CheckpointError(f"{path} is corrupt: bad entry at offset {offset + start}")
        key = key[:shared] + bytes(block[pos : pos + non_shared])
        # Sharing restarts every _RESTART_INTERVAL entries at most in every TF writer, so a block's keys
        # add up to at most that many times its size; past it, entries that each share the whole
        # previous key and add a byte make memory (and a V1 reader's time) grow with the square of
        # the file: 2.8 GB for a 352 KiB index.
        key_bytes += len(key)
        if key_bytes > _RESTART_INTERVAL * size:
            raise CheckpointError(
                f"{path} is corrupt: the keys of the block at offset {offset} share more than a TF table's "
                f"keys can (entry at offset {offset + start})"
            )
        pos += non_shared
        yield key, block[pos : pos + value_len], offset + pos
        pos += value_len


def read_table(data, path: Path):
    """Every (key, value, value's file offset) of an SSTable held in `data` (bytes or mmap), in key order."""
    if len(data) < FOOTER_BYTES or struct.unpack_from("<Q", data, len(data) - 8)[0] != TABLE_MAGIC:
        raise CheckpointError(
            f"{path} is not a TensorFlow checkpoint file (no table footer magic in its last 8 bytes; "
            "truncated, or another kind of file)"
        )
    footer_at = len(data) - FOOTER_BYTES
    where = (path, 0)  # the footer's positions are the file's
    pos = footer_at
    meta_offset, pos = _varint(data, pos, footer_at + 40, where)
    meta_size, pos = _varint(data, pos, footer_at + 40, where)
    index_offset, pos = _varint(data, pos, footer_at + 40, where)
    index_size, pos = _varint(data, pos, footer_at + 40, where)
    # The metaindex holds nothing TF's writers use, but a damaged one is a damaged file: verify it.
    for _ in _entries(_block(data, meta_offset, meta_size, path), meta_offset, path):
        pass
    if meta_offset + meta_size + _TRAILER_BYTES > index_offset:
        raise CheckpointError(f"{path} is corrupt: the metaindex at offset {meta_offset} runs into the index")
    # The data blocks lie in file order, each after the previous one's trailer and all before the
    # metaindex (table_builder.cc), and the keys rise strictly: a handle that names a block again (n
    # handles to one block of n entries: quadratic time, hours for 1 MB) or keys out of order (a
    # duplicate: the last would win) are a damaged file, refused at the handle or key.
    block_end, last_key = 0, None
    for _, handle, at in _entries(_block(data, index_offset, index_size, path), index_offset, path):
        offset, p = _varint(handle, 0, len(handle), (path, at))
        size, _ = _varint(handle, p, len(handle), (path, at))
        if offset < block_end or offset + size + _TRAILER_BYTES > meta_offset:
            raise CheckpointError(
                f"{path} is corrupt: the index entry at offset {at} names a block at offset {offset} of "
                f"{size} bytes, not after the previous block (ends at {block_end}) and before the metaindex "
                f"(at {meta_offset})"
            )
        block_end = offset + size + _TRAILER_BYTES
        for key, value, value_at in _entries(_block(data, offset, size, path), offset, path):
            if last_key is not None and key <= last_key:
                raise CheckpointError(
                    f"{path} is corrupt: the key of the entry whose value is at offset {value_at} "
                    f"{'repeats' if key == last_key else 'sorts before'} the previous key"
                )
            last_key = key
            yield key, value, value_at


def _put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _build_block(items: list[tuple[bytes, bytes]], restart_interval: int = _RESTART_INTERVAL) -> bytes:
    out, restarts, last = bytearray(), [], b""
    for i, (key, value) in enumerate(items):
        shared = 0
        if i % restart_interval == 0:
            restarts.append(len(out))
        else:
            limit = min(len(last), len(key))
            while shared < limit and last[shared] == key[shared]:
                shared += 1
        for n in (shared, len(key) - shared, len(value)):
            _put_varint(out, n)
        out += key[shared:] + value
        last = key
    restarts = restarts or [0]
    out += struct.pack(f"<{len(restarts)}I", *restarts) + struct.pack("<I", len(restarts))
    return bytes(out)


def build_table(items: list[tuple[bytes, bytes]]) -> bytes:
    """An SSTable of `items` (sorted by key): one data block, an empty metaindex, the index, the footer."""
    out = bytearray()

    def add_block(contents: bytes) -> bytes:
        handle = bytearray()
        _put_varint(handle, len(out))
        _put_varint(handle, len(contents))
        out.extend(contents + b"\x00" + struct.pack("<I", masked_crc32c(contents + b"\x00")))
        return bytes(handle)

    data_handle = add_block(_build_block(items))
    meta_handle = add_block(_build_block([]))
    index_handle = add_block(_build_block([(items[-1][0] if items else b"", data_handle)]))
    footer = (meta_handle + index_handle).ljust(40, b"\x00")
    out += footer + struct.pack("<Q", TABLE_MAGIC)
    return bytes(out)
