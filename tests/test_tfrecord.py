"""TFRecord framing, CRC32C, corruption and truncation errors, and DALI-format index files."""

import os
import shutil
import struct
import subprocess

import numpy as np
import pytest

from fasttrain.data import DataError
from fasttrain.data import tfrecord as tfr


def _ref_crc32c(data: bytes) -> int:
    """Bit-at-a-time CRC32C (reflected polynomial 0x82F63B78): the definition, not the C library."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _ref_masked(data: bytes) -> int:
    crc = _ref_crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) % (1 << 32)


def _ref_frame(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _ref_masked(length)) + data + struct.pack("<I", _ref_masked(data))


PAYLOADS = [b"", b"a", b"hello tfrecord", bytes(range(256)) * 3, os.urandom(1000)]


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "train-00000-of-00001"
    tfr.write_records(path, PAYLOADS)
    return path


def _offsets():
    out, offset = [], 0
    for p in PAYLOADS:
        out.append(offset)
        offset += len(p) + 16
    return out


def test_crc32c_check_value():
    assert tfr.crc32c(b"123456789") == 0xE3069283
    assert _ref_crc32c(b"123456789") == 0xE3069283


def test_crc32c_and_mask_match_the_definition():
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 64, 1000):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert tfr.crc32c(data) == _ref_crc32c(data)
        assert tfr.masked_crc32c(data) == _ref_masked(data)


def test_write_matches_reference_framing_and_reads_back(shard):
    assert shard.read_bytes() == b"".join(_ref_frame(p) for p in PAYLOADS)
    records = list(tfr.iter_records(shard))
    assert [p for _, p in records] == PAYLOADS
    assert [o for o, _ in records] == _offsets()


def test_read_record_random_access(shard):
    index = tfr.build_index(shard)
    assert index == [(o, len(p) + 16) for o, p in zip(_offsets(), PAYLOADS)]
    with open(shard, "rb") as f:
        for (offset, size), payload in reversed(list(zip(index, PAYLOADS))):
            assert tfr.read_record(f, offset, size, shard) == payload


# (field, position relative to the start of record 3): length, length CRC, data, data CRC.
FIELDS = {"length": 2, "length_crc": 9, "data": 12 + 100, "data_crc": 12 + 768 + 1}


@pytest.mark.parametrize("field", FIELDS)
def test_flipped_byte_in_each_field_is_corrupted(shard, field):
    record = 3
    offset = _offsets()[record]
    data = bytearray(shard.read_bytes())
    data[offset + FIELDS[field]] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"corrupted record at offset {offset} in {shard}"):
        list(tfr.iter_records(shard))
    with open(shard, "rb") as f, pytest.raises(DataError, match=f"corrupted record at offset {offset}"):
        tfr.read_record(f, offset, len(PAYLOADS[record]) + 16, shard)
    # Records before the damaged one still read.
    records = tfr.iter_records(shard)
    assert [next(records)[1] for _ in range(record)] == PAYLOADS[:record]


def test_unverified_read_ignores_crc(shard):
    offset = _offsets()[3]
    data = bytearray(shard.read_bytes())
    data[offset + FIELDS["data_crc"]] ^= 0x10
    shard.write_bytes(bytes(data))
    assert [p for _, p in tfr.iter_records(shard, verify=False)] == PAYLOADS


@pytest.mark.parametrize("cut", [1, 8, 11, 12, 300, 12 + 768 + 2])
def test_truncation_at_several_offsets(shard, cut):
    offset = _offsets()[3]
    shard.write_bytes(shard.read_bytes()[: offset + cut])
    with pytest.raises(DataError, match=f"truncated record at offset {offset} in {shard}"):
        list(tfr.iter_records(shard))


def test_truncation_at_a_record_boundary_is_a_shorter_file(shard):
    shard.write_bytes(shard.read_bytes()[: _offsets()[3]])
    assert [p for _, p in tfr.iter_records(shard)] == PAYLOADS[:3]


def test_empty_file(tmp_path):
    path = tmp_path / "train-00000-of-00001"
    path.write_bytes(b"")
    assert list(tfr.iter_records(path)) == []
    assert tfr.build_index(path) == []
    index_path = tfr.ensure_index(path, cache_dir=tmp_path / "cache")
    assert index_path.read_text() == ""


def test_index_is_dali_format(shard, tmp_path):
    index_path = tfr.ensure_index(shard, cache_dir=tmp_path / "cache")
    assert index_path == shard.with_name(shard.name + ".idx")
    expected = "".join(f"{o} {len(p) + 16}\n" for o, p in zip(_offsets(), PAYLOADS))
    assert index_path.read_text() == expected


@pytest.mark.skipif(shutil.which("tfrecord2idx") is None, reason="DALI's tfrecord2idx is not installed")
def test_index_equals_dali_tfrecord2idx(shard, tmp_path):
    dali_index = tmp_path / "dali.idx"
    subprocess.run(["tfrecord2idx", str(shard), str(dali_index)], check=True, capture_output=True, timeout=60)
    assert tfr.ensure_index(shard, cache_dir=tmp_path / "cache").read_text() == dali_index.read_text()


def test_stale_index_is_rebuilt(shard, tmp_path):
    index_path = tfr.ensure_index(shard, cache_dir=tmp_path / "cache")
    with open(shard, "ab") as f:  # the shard grew after the index was written
        f.write(tfr.frame_record(b"one more"))
    assert tfr.check_index(shard, tfr.read_index_file(index_path)) is not None
    _, entries = tfr.load_index(shard, cache_dir=tmp_path / "cache")
    assert [tuple(e) for e in entries] == tfr.build_index(shard)
    assert len(entries) == len(PAYLOADS) + 1


def test_short_or_garbage_index_is_rebuilt(shard, tmp_path):
    index_path = tfr.ensure_index(shard, cache_dir=tmp_path / "cache")
    good = index_path.read_text()
    # The last: a number beyond int64 (NumPy's OverflowError ended the run in a traceback).
    for bad in (
        "".join(good.splitlines(keepends=True)[:-1]),
        "garbage\n",
        "0 16\n16\n",
        "99999999999999999999 5\n",
    ):
        index_path.write_text(bad)
        assert tfr.ensure_index(shard, cache_dir=tmp_path / "cache") == index_path
        assert index_path.read_text() == good


def test_index_of_a_rewritten_shard_with_the_same_size_is_rejected(shard, tmp_path):
    index_path = tfr.ensure_index(shard, cache_dir=tmp_path / "cache")
    # Same total size, different record boundaries: the header check catches it.
    tfr.write_records(shard, [b"x" * (sum(len(p) + 16 for p in PAYLOADS) - 16)])
    assert tfr.check_index(shard, tfr.read_index_file(index_path)) is not None
    _, entries = tfr.load_index(shard, cache_dir=tmp_path / "cache")
    assert len(entries) == 1


def test_read_only_data_dir_uses_the_cache(shard, tmp_path, monkeypatch):
    write = tfr.write_index_file

    def refuse_data_dir(path, entries):
        if path.parent == shard.parent:
            raise PermissionError(13, "Permission denied")
        write(path, entries)

    monkeypatch.setattr(tfr, "write_index_file", refuse_data_dir)
    index_path = tfr.ensure_index(shard, cache_dir=tmp_path / "cache")
    assert (tmp_path / "cache") in index_path.parents
    assert not shard.with_name(shard.name + ".idx").exists()
    assert tfr.ensure_index(shard, cache_dir=tmp_path / "cache") == index_path  # found, not rebuilt

    monkeypatch.setattr(
        tfr, "write_index_file", lambda p, e: (_ for _ in ()).throw(PermissionError(13, "no"))
    )
    other = shard.with_name("validation-00000-of-00001")
    tfr.write_records(other, [b"z"])
    with pytest.raises(DataError, match="set data_cache_dir to a writable directory"):
        tfr.ensure_index(other, cache_dir=tmp_path / "cache2")


def test_read_record_with_a_wrong_size_names_the_index(shard):
    with open(shard, "rb") as f, pytest.raises(DataError, match="index"):
        tfr.read_record(f, _offsets()[2], len(PAYLOADS[2]) + 17, shard)


# --- RecordBuffer: the loader's reads into a reused buffer -----------------------------------------


def _both(path, offset, size):
    """(outcome of read_record, outcome of RecordBuffer.read): the payload bytes or the error text."""
    outcomes = []
    with open(path, "rb") as f:
        for read in (tfr.read_record, tfr.RecordBuffer(size=64).read):
            try:
                outcomes.append(bytes(read(f, offset, size, path)))
            except DataError as e:
                outcomes.append(str(e))
    return outcomes


def test_record_buffer_reads_as_read_record(shard):
    buffer = tfr.RecordBuffer(size=64)  # smaller than record 3: the buffer grows
    with open(shard, "rb") as f:
        for offset, payload in reversed(list(zip(_offsets(), PAYLOADS))):
            assert bytes(buffer.read(f, offset, len(payload) + 16, shard)) == payload


@pytest.mark.parametrize("field", FIELDS)
def test_record_buffer_errors_are_read_records(shard, field):
    record, offset = 3, _offsets()[3]
    data = bytearray(shard.read_bytes())
    data[offset + FIELDS[field]] ^= 0x10
    shard.write_bytes(bytes(data))
    ours, reference = _both(shard, offset, len(PAYLOADS[record]) + 16)
    assert ours == reference and reference.startswith(f"corrupted record at offset {offset} in {shard}")


@pytest.mark.parametrize("cut", [1, 12, 300])
def test_record_buffer_truncation_and_stale_size_are_read_records(shard, cut):
    offset = _offsets()[3]
    ours, reference = _both(shard, _offsets()[2], len(PAYLOADS[2]) + 17)
    assert ours == reference and "delete the stale index file" in reference
    shard.write_bytes(shard.read_bytes()[: offset + cut])
    ours, reference = _both(shard, offset, len(PAYLOADS[3]) + 16)
    assert ours == reference and reference.startswith(f"truncated record at offset {offset} in {shard}")


def test_record_buffer_without_preadv_or_the_c_crc(shard, monkeypatch):
    monkeypatch.setattr(tfr, "_crc_at", None)  # the fallbacks: google_crc32c over a copy,
    monkeypatch.setattr(tfr, "_preadv", None)  # seek + readinto
    test_record_buffer_reads_as_read_record(shard)
    data = bytearray(shard.read_bytes())
    data[_offsets()[4] + 12 + 5] ^= 1
    shard.write_bytes(bytes(data))
    assert "data CRC mismatch" in _both(shard, _offsets()[4], len(PAYLOADS[4]) + 16)[1]


def test_record_buffer_reads_on_after_short_reads(shard, monkeypatch):
    def short_preadv(fd, buffers, offset):  # at most 7 bytes a call, as a network file system may give
        (view,) = buffers
        data = os.pread(fd, min(7, len(view)), offset)
        view[: len(data)] = data
        return len(data)

    monkeypatch.setattr(tfr, "_preadv", short_preadv)
    test_record_buffer_reads_as_read_record(shard)
    shard.write_bytes(shard.read_bytes()[: _offsets()[4] + 30])
    ours, reference = _both(shard, _offsets()[4], len(PAYLOADS[4]) + 16)
    assert ours == reference and "30 of 1016 bytes" in reference
