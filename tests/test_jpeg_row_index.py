"""The per-shard sidecar store of row checkpoints (fasttrain.data.jpeg.row_index): built, opened, refused
when stale, truncated or foreign, written to the cache for a read-only data directory, and its command.
The checkpoints it stores are those of fasttrain.data.jpeg.scan, which tests/test_jpeg_doctor.py holds to
libjpeg-turbo's own decode."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import skimage.data
from test_jpeg_doctor import CASES, _pil

from fasttrain.data.jpeg import doctor as jpeg_rows
from fasttrain.data.jpeg.decode import CROP_DECODE
from fasttrain.data.jpeg.scan import COLUMN_GROUP

pytestmark = pytest.mark.skipif(not CROP_DECODE, reason="needs libjpeg-turbo's TurboJPEG library")


@pytest.fixture
def shard(tmp_path):
    """A train shard: the baseline cases, a progressive JPEG, and a record that is not an Example."""
    from fasttrain.data.example import encode_example
    from fasttrain.data.tfrecord import write_records

    progressive = _pil(skimage.data.astronaut()[:64, :80], progressive=True)
    payloads = [encode_example({"image/encoded": jpeg, "image/class/label": 1}) for _, jpeg, _ in CASES[:4]]
    payloads += [encode_example({"image/encoded": progressive, "image/class/label": 2}), b"\x0a\xff garbage"]
    data = tmp_path / "data"
    data.mkdir()
    path = data / "train-00000-of-00001"
    write_records(path, payloads)
    return path, [c[1] for c in CASES[:4]]


def test_row_index_build_and_open(shard, tmp_path):
    from fasttrain.data.jpeg import row_index
    from fasttrain.data.tfrecord import load_index, masked_crc32c, read_record

    path, jpegs = shard
    cache = tmp_path / "cache"
    assert row_index.RowIndex.open(path, cache) is None
    written = row_index.build_row_index(path, cache)
    assert written == path.with_name(path.name + ".rows")
    index = row_index.RowIndex.open(path, cache)
    _, entries = load_index(path, cache)
    assert len(index) == len(entries) == 6
    with open(path, "rb") as f:  # each record's data CRC, as TensorFlow's framing defines it
        crcs = [masked_crc32c(read_record(f, int(o), int(s), path)) for o, s in entries]
    np.testing.assert_array_equal(index.crcs, crcs)
    for i, jpeg in enumerate(jpegs):
        got = index.checkpoints(int(entries[i, 0]), crcs[i])
        np.testing.assert_array_equal(got, jpeg_rows.row_checkpoints(jpeg))
        np.testing.assert_array_equal(index.checkpoints_at(i), jpeg_rows.row_checkpoints(jpeg))
        assert index.checkpoints(int(entries[i, 0]), crcs[i] ^ 1) is None  # another record's bytes
    assert index.checkpoints(int(entries[4, 0]), crcs[4]) is None  # progressive
    assert index.checkpoints(int(entries[5, 0]), crcs[5]) is None  # not an Example
    assert index.checkpoints(int(entries[1, 0]) + 1, crcs[1]) is None  # not a record's offset
    rows = sum(jpeg_rows.row_checkpoints(j).shape[0] for j in jpegs)
    # The documented layout: offsets, starts, CRCs, then 10 bytes a checkpoint line.
    assert written.stat().st_size == 56 + 8 * 6 + 8 * 7 + 4 * 6 + 10 * rows


def test_row_index_stale_truncated_or_foreign_is_none(shard, tmp_path):
    from fasttrain.data.jpeg import row_index

    path, _ = shard
    cache = tmp_path / "cache"
    written = row_index.build_row_index(path, cache)
    data = written.read_bytes()
    other_group = data[:12] + (COLUMN_GROUP + 1).to_bytes(4, "little") + data[16:]
    flipped = data[:-7] + bytes([data[-7] ^ 4]) + data[-6:]  # a damaged checkpoint
    for broken in (data[:-1], data[:55], b"", b"NOTROWS!" + data[8:], data + b"\0", other_group, flipped):
        written.write_bytes(broken)
        assert row_index.RowIndex.open(path, cache) is None
    written.write_bytes(data)
    assert row_index.RowIndex.open(path, cache) is not None
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # the shard rewritten
    assert row_index.RowIndex.open(path, cache) is None
    row_index.build_row_index(path, cache)
    assert row_index.RowIndex.open(path, cache) is not None


def test_row_index_read_only_data_dir_uses_the_cache(shard, tmp_path, monkeypatch):
    import tempfile

    from fasttrain.data.jpeg import row_index

    path, jpegs = shard
    cache = tmp_path / "cache"
    mkstemp = tempfile.mkstemp

    def read_only(*args, dir=None, **kwargs):  # the .idx and .rows writers both go through mkstemp
        if Path(dir) == path.parent:
            raise PermissionError(13, "Permission denied")
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    written = row_index.build_row_index(path, cache)
    assert written.parent != path.parent and cache in written.parents
    assert not path.with_name(path.name + ".rows").exists()
    index = row_index.RowIndex.open(path, cache)
    np.testing.assert_array_equal(index.checkpoints_at(0), jpeg_rows.row_checkpoints(jpegs[0]))


def test_row_index_command(shard, tmp_path, capsys):
    from fasttrain.data.jpeg import row_build, row_index

    path, _ = shard
    assert row_build.main([str(path.parent), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert row_index.RowIndex.open(path, tmp_path / "cache") is not None
    assert "1/1 shards" in capsys.readouterr().out
    assert row_build.main([str(tmp_path / "missing")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "missing" in error


def test_the_data_tools_row_checkpoints_subcommand(shard, tmp_path, capsys):
    # The same build as the old spelling above, under the data tools' exit statuses.
    from fasttrain.data.__main__ import main as data_main
    from fasttrain.data.jpeg import row_index

    path, _ = shard
    assert data_main(["row-checkpoints", str(path.parent), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert row_index.RowIndex.open(path, tmp_path / "cache") is not None
    assert "1/1 shards" in capsys.readouterr().out
    assert data_main(["row-checkpoints", str(path.parent), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert "1 of 1 shards up to date, 0 to build" in capsys.readouterr().out
    assert data_main(["row-checkpoints", str(tmp_path / "missing")]) == 2  # not a directory
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert data_main(["row-checkpoints", str(tmp_path / "empty")]) == 1  # bad data: no shards
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "no train-* or validation-* shards" in error


def test_a_re_signed_sidecar_with_impossible_entries_is_not_used(shard, tmp_path):
    # Its own CRC finds damage, not a sidecar written wrong (by a bug, or on purpose) and signed again:
    # such values reached the decode, where a DC predictor is taken as it is (wrong pixels, silently),
    # and a record offset below 4 ended the loader in an OSError (pread at a negative offset).
    from fasttrain.data.jpeg import row_index
    from fasttrain.data.tfrecord import crc32c

    path, _ = shard
    cache = tmp_path / "cache"
    written = row_index.build_row_index(path, cache)
    good = written.read_bytes()
    header = row_index._HEADER
    fields = list(header.unpack_from(good))
    index = row_index.RowIndex.open(path, cache)
    records, lines = len(index), index.rows.shape[0]
    rows_at = header.size + 20 * records + 8  # the layout above: offsets, starts, CRCs, then the lines

    def signed(body: bytearray) -> bytes:
        fields[7] = crc32c(bytes(body))
        return header.pack(*fields) + bytes(body)

    def changed(position: int, value: bytes) -> bytes:
        body = bytearray(good[header.size :])
        body[position - header.size : position - header.size + len(value)] = value
        return signed(body)

    second_line = rows_at + 10  # line 1 of record 0: bit position (two int16), then 3 DC predictors
    cases = {
        "a DC predictor no 8-bit JPEG has": changed(
            second_line + 4, (3000).to_bytes(2, "little", signed=True)
        ),
        "a position before the previous line's": changed(second_line, bytes(4)),
        "record 1 at offset 2": changed(header.size + 8, (2).to_bytes(8, "little")),
        "lines that do not add up": changed(header.size + 8 * records + 8, (lines + 5).to_bytes(8, "little")),
    }
    assert row_index.RowIndex.find(path, cache)[1] is None
    for what, data in cases.items():
        written.write_bytes(data)
        assert row_index.RowIndex.find(path, cache) == (None, row_index.INCONSISTENT), what
    written.write_bytes(signed(bytearray(good[header.size :])))  # signed again, unchanged: used
    assert row_index.RowIndex.open(path, cache) is not None


def test_the_command_says_where_sidecars_of_a_read_only_data_directory_went(
    shard, tmp_path, capsys, monkeypatch
):
    # They went to the cache directory without a word: the user looked for <shard>.rows beside the shard.
    import tempfile

    from fasttrain.data.__main__ import main as data_main

    path, _ = shard
    mkstemp = tempfile.mkstemp

    def read_only(*args, dir=None, **kwargs):
        if Path(dir) == path.parent:
            raise PermissionError(13, "Permission denied")
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    cache = tmp_path / "cache"
    assert data_main(["row-checkpoints", str(path.parent), "--cache-dir", str(cache)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith(f"rows: {path.parent} is not writable: the sidecars of 1 shards are in {cache}/")
    assert line.endswith(f"(give the trainer --data_cache_dir={cache})")
