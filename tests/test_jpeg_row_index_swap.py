"""A row-checkpoint sidecar (fasttrain.data.jpeg.row_index) never decodes another shard's images.

The case that motivated it: a shard replaced by another of the same size and modification time (an
rsync that keeps times, `touch -r`) after its sidecar was built. Here the replacement holds the same
records in another order: every record the same size (an Example padded to one length), every JPEG the
same header (one size, one quality, standard tables), so the .idx stays valid, size and mtime agree,
and a sidecar entry found by offset belongs to another image whose scan starts at the same bit, which
is all the doctor itself can check. The reference for the batches is the same loader with
row_checkpoints=False: the plain cropped decode, which tests/test_thread_loader.py and
tests/test_transforms_tf.py hold to the process loader and to TensorFlow's pixels.
"""

from __future__ import annotations

import io
import os
import shutil
import struct

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image
from test_thread_loader import _cfg as loader_cfg
from test_thread_loader import _doctored

from fasttrain.data.example import encode_example
from fasttrain.data.jpeg import CROP_DECODE
from fasttrain.data.tfrecord import build_index, write_index_file, write_records
from fasttrain.data.thread_loader import ThreadLoader

pytestmark = pytest.mark.skipif(not CROP_DECODE, reason="needs libjpeg-turbo's TurboJPEG library")

RECORDS = 12
SIDE = (192, 256)  # rows, columns: 12 MCU rows of 16 at 4:2:0


def _jpegs() -> list[bytes]:
    photos = [skimage.data.astronaut(), skimage.data.coffee(), skimage.data.chelsea(), skimage.data.rocket()]
    jpegs = []
    for k in range(RECORDS):
        photo = photos[k % len(photos)]
        top, left = 9 * k, 13 * k
        buffer = io.BytesIO()
        crop = np.ascontiguousarray(photo[top : top + SIDE[0], left : left + SIDE[1]])
        Image.fromarray(crop).save(buffer, "JPEG", quality=90, subsampling=2)
        jpegs.append(buffer.getvalue())
    return jpegs


def _payloads(jpegs) -> list[bytes]:
    """Examples padded (a feature the loader ignores) to one length: every record the same size."""

    def payload(k, pad):
        return encode_example({"image/encoded": jpegs[k], "image/class/label": k % 4 + 1, "pad": b"p" * pad})

    # Pads of 300 bytes and more: every varint length stays 2 bytes, so a pad byte is a payload byte.
    target = max(len(payload(k, 0)) for k in range(len(jpegs))) + 300
    payloads = []
    for k in range(len(jpegs)):
        pad = target - len(payload(k, 0))
        pad += target - len(payload(k, pad))
        payloads.append(payload(k, pad))
    assert {len(p) for p in payloads} == {target}
    return payloads


def _write_shard(path, payloads) -> None:
    write_records(path, payloads)
    write_index_file(path.with_name(path.name + ".idx"), build_index(path))


def _replace_keeping_size_and_mtime(path, payloads) -> None:
    before = os.stat(path)
    write_records(path, payloads)
    assert os.stat(path).st_size == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # as `touch -r` or `rsync -t`


@pytest.fixture
def data(tmp_path):
    payloads = _payloads(_jpegs())
    root = tmp_path / "data"
    root.mkdir()
    _write_shard(root / "train-00000-of-00001", payloads)
    return root, payloads


def _cfg(root, **overrides):
    return loader_cfg(root, **{"batch_size": 4, "shuffle_buffer": 4, "seed": 5, **overrides})


def _epochs(cfg, epochs=3):
    loader = ThreadLoader(cfg, "train", True)
    batches = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        batches += [(images.clone(), labels.clone()) for images, labels in loader]
    return loader, batches


def _same(a, b) -> None:
    assert len(a) == len(b)
    for (ia, la), (ib, lb) in zip(a, b, strict=True):
        assert torch.equal(la, lb)
        assert torch.equal(ia, ib), f"max |diff| {(ia.int() - ib.int()).abs().max()}"


@pytest.mark.parametrize("swap", ["whole shard", "two records"])
def test_a_shard_replaced_keeping_size_and_mtime_decodes_its_own_images(data, monkeypatch, capsys, swap):
    from fasttrain.data.jpeg.row_build import main

    root, payloads = data
    shard = root / "train-00000-of-00001"
    assert main([str(root)]) == 0
    doctored = _doctored(monkeypatch)
    _epochs(_cfg(root))
    assert sum(doctored) > len(doctored) // 2  # the sidecar is used: most crops go through the doctor
    # "two records": an exchange the open-time sample of records (first, middle, last) does not see,
    # so only the per-record check stands between the sidecar and the wrong image.
    if swap == "whole shard":
        replaced = payloads[::-1]
    else:
        replaced = list(payloads)
        replaced[1], replaced[2] = payloads[2], payloads[1]
    _replace_keeping_size_and_mtime(shard, replaced)
    capsys.readouterr()
    doctored.clear()
    loader, got = _epochs(_cfg(root))
    _, reference = _epochs(_cfg(root, row_checkpoints=False))
    _same(got, reference)
    err = capsys.readouterr().err
    if swap == "whole shard":  # found when the sidecar is opened: the trainer's start-up note says it
        assert sum(doctored) == 0 and err == ""
        assert len(loader.notes) == 1 and "stale" in loader.notes[0] and str(root) in loader.notes[0]
    else:  # found per record, before the doctor: one note, the records counted, the rest still used
        assert loader.notes == []
        assert err.count("\n") == 1 and "row checkpoints" in err and str(shard) in err
        assert f"python -m fasttrain.data row-checkpoints {root}" in err
        assert loader.row_indexes.stale_records > 0 and sum(doctored) > 0


def test_the_builder_and_verify_see_the_replaced_shard(data, capsys):
    from fasttrain.data.__main__ import main as data_main
    from fasttrain.data.jpeg.row_build import main

    root, payloads = data
    shard = root / "train-00000-of-00001"
    assert main([str(root)]) == 0
    assert data_main(["verify", str(root), "--workers", "1"]) == 0
    assert "row checkpoints: 1 current" in capsys.readouterr().out
    replaced = list(payloads)
    replaced[1], replaced[2] = payloads[2], payloads[1]
    _replace_keeping_size_and_mtime(shard, replaced)
    assert data_main(["verify", str(root), "--workers", "1"]) == 0  # the data is good; the sidecar stale
    out = capsys.readouterr().out
    assert "row checkpoints: 1 stale" in out and str(shard) in out
    assert f"python -m fasttrain.data row-checkpoints {root} --force" in out
    _replace_keeping_size_and_mtime(shard, payloads[::-1])
    assert main([str(root)]) == 0
    assert "0 of 1 shards up to date, 1 to build" in capsys.readouterr().out
    assert data_main(["verify", str(root), "--workers", "1"]) == 0
    assert "row checkpoints: 1 current" in capsys.readouterr().out


def test_a_sidecar_of_the_earlier_format_is_stale_and_rebuilt(data, capsys):
    """Format 1 (before the record CRCs) cannot tell which records it indexes: never used, rebuilt by
    the builder without --force, named as stale (not missing) by the trainer's note and by verify."""
    from fasttrain.data.jpeg import row_index

    root, _ = data
    shard = root / "train-00000-of-00001"
    written = row_index.build_row_index(shard)
    raw = written.read_bytes()
    magic, version, group, size, mtime, records, rows, crc, _ = row_index._HEADER.unpack_from(raw)
    at = row_index._HEADER.size
    body = raw[at : at + 16 * records + 8] + raw[at + 20 * records + 8 :]  # without the CRC column
    from fasttrain.data.tfrecord import crc32c

    header = row_index._HEADER.pack(magic, 1, group, size, mtime, records, rows, crc32c(body), 0)
    written.write_bytes(header + body)
    assert row_index.RowIndex.open(shard) is None
    index, problem = row_index.RowIndex.find(shard)
    assert index is None and "older fasttrain" in problem
    note = ThreadLoader(_cfg(root), "train", True).notes
    assert len(note) == 1 and "stale" in note[0] and str(root) in note[0]
    from fasttrain.data.jpeg.row_build import main

    assert main([str(root)]) == 0
    assert "0 of 1 shards up to date" in capsys.readouterr().out
    assert row_index.RowIndex.open(shard) is not None
    assert struct.unpack_from("<I", written.read_bytes(), 8)[0] == row_index.VERSION


def test_the_note_tells_missing_from_stale_names_the_directory_and_comes_once(data, tmp_path):
    from fasttrain.data.jpeg.row_build import main

    root, payloads = data
    missing = ThreadLoader(_cfg(root), "train", True).notes
    assert len(missing) == 1 and "no JPEG row checkpoints" in missing[0]
    assert f"python -m fasttrain.data row-checkpoints {root}" in missing[0] and "DATA_DIR" not in missing[0]
    assert ThreadLoader(_cfg(root), "train", True).notes == []  # once per data directory
    other = tmp_path / "other"
    shutil.copytree(root, other)
    assert len(ThreadLoader(_cfg(other), "train", True).notes) == 1  # another directory: its own note
    assert main([str(root)]) == 0
    assert ThreadLoader(_cfg(root), "train", True).notes == []  # current: nothing to say
    _replace_keeping_size_and_mtime(root / "train-00000-of-00001", payloads[::-1])
    stale = ThreadLoader(_cfg(root), "train", True).notes
    assert len(stale) == 1 and "stale" in stale[0] and "no JPEG row checkpoints" not in stale[0]
