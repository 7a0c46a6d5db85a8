"""bench/photo_shards.py, read back independently, and the plain PyTorch row's transform. No speed
is asserted.

The shard writer is checked against references it does not use: the PyPI `tfrecord` package reads
the shards through their .idx files (framing, CRCs, index offsets), the feature keys and types are
compared with a record TensorFlow itself wrote the way build_imagenet_data.py does
(tests/data/tf-written), and each JPEG's kind (components, progressive, chroma subsampling,
restart interval, EXIF) is read from its markers by a parser written here.
"""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("skimage")
tfrecord_reader = pytest.importorskip("tfrecord.reader")

from bench import photo_shards, torch_input  # noqa: E402
from fasttrain.config import make_config  # noqa: E402
from fasttrain.data import build_loader  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

IMAGES, RECORDS, SHARDS = 200, 400, 3


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    out = tmp_path_factory.mktemp("photos")
    manifest = photo_shards.write_photo_shards(out, IMAGES, RECORDS, SHARDS, seed=3)
    return out, manifest


def _records(out: Path) -> list[dict]:
    records = []
    for shard in sorted(out.glob("train-*-of-*")):
        if shard.suffix != ".idx":
            records.extend(tfrecord_reader.tfrecord_loader(str(shard), f"{shard}.idx", None))
    return records


def _kinds(jpeg: bytes) -> set[str]:
    """The kinds bench/photo_shards.py names, read from the JPEG's markers (ITU T.81 B.1)."""
    kinds, i = set(), 2
    assert jpeg[:2] == b"\xff\xd8"
    while i < len(jpeg):
        assert jpeg[i] == 0xFF, f"no marker at byte {i}"
        marker, length = jpeg[i + 1], int.from_bytes(jpeg[i + 2 : i + 4], "big")
        body = jpeg[i + 4 : i + 2 + length]
        if marker == 0xE1 and body.startswith(b"Exif\0\0"):
            kinds.add("exif")
        elif marker == 0xDD and int.from_bytes(body[:2], "big") > 0:
            kinds.add("restart markers")
        elif marker in (0xC0, 0xC2):  # baseline / progressive frame header
            if marker == 0xC2:
                kinds.add("progressive")
            components = body[5]
            kinds.add("grayscale" if components == 1 else "colour")
            if components == 3:
                luma, chroma = body[7], (body[10], body[13])
                assert chroma == (0x11, 0x11), "chroma planes at full rate in their own header"
                kinds.add({0x11: "4:4:4", 0x21: "4:2:2", 0x22: "4:2:0"}[luma])
        elif marker == 0xDA:  # start of scan: entropy-coded data follows, the header is done
            return kinds
        i += 2 + length
    raise AssertionError("no start of scan")


def test_shards_are_build_imagenet_data_layout(photos):
    out, manifest = photos
    names = sorted(p.name for p in out.iterdir())
    shards = [f"train-{k:05d}-of-{SHARDS:05d}" for k in range(SHARDS)]
    assert names == sorted(shards + [s + ".idx" for s in shards] + ["photo_shards.json"])
    records = _records(out)  # read by offset from each .idx line, CRCs checked by the tfrecord package
    assert len(records) == RECORDS
    tf_written = next(
        tfrecord_reader.tfrecord_loader(str(ROOT / "tests/data/tf-written/train-00000-of-00001"), None)
    )
    kind = lambda rec: {k: getattr(v, "dtype", type(v)) for k, v in rec.items()}  # noqa: E731
    assert kind(records[0]) == kind(tf_written)  # the same keys, each bytes, int64 or float32 as TF's
    jpegs = {}
    for rec in records:
        assert 1 <= int(rec["image/class/label"][0]) <= 1000
        boxes = [rec[f"image/object/bbox/{k}"] for k in ("ymin", "xmin", "ymax", "xmax")]
        assert len({len(b) for b in boxes}) == 1 and len(boxes[0]) <= 3
        ymin, xmin, ymax, xmax = boxes
        assert np.all((0 <= ymin) & (ymin < ymax) & (ymax <= 1) & (0 <= xmin) & (xmin < xmax) & (xmax <= 1))
        jpegs.setdefault(bytes(rec["image/encoded"]), []).append(rec)
    assert len(jpegs) == IMAGES  # every distinct image written records / images times
    assert sorted(len(v) for v in jpegs.values()) == [RECORDS // IMAGES] * IMAGES
    assert all(len({bytes(r["image/filename"]) for r in v}) == 1 for v in jpegs.values())


def test_jpeg_kinds_and_sizes_are_what_the_manifest_says(photos):
    out, manifest = photos
    seen, sides, nbytes = {}, [], []
    for jpeg, rec in {bytes(r["image/encoded"]): r for r in _records(out)}.items():
        for k in _kinds(jpeg):
            seen[k] = seen.get(k, 0) + 1
        width, height = int(rec["image/width"][0]), int(rec["image/height"][0])
        # the SOF's own size, found independently of the Example's fields
        sof = max(jpeg.find(b"\xff\xc0"), jpeg.find(b"\xff\xc2"))
        sof_size = (
            int.from_bytes(jpeg[sof + 5 : sof + 7], "big"),
            int.from_bytes(jpeg[sof + 7 : sof + 9], "big"),
        )
        assert sof_size == (height, width)
        sides += [width, height]
        nbytes.append(len(jpeg))
    claimed = {k: v for k, v in manifest["kinds"].items() if not k.endswith("boxes")}
    assert seen == claimed
    for k in ("grayscale", "progressive", "restart markers", "exif", "4:4:4", "4:2:2", "4:2:0"):
        assert seen.get(k, 0) > 0, f"no {k} JPEG among {IMAGES}"
    assert 200 <= min(sides) and max(sides) <= 800
    assert manifest["mean_jpeg_bytes"] == pytest.approx(np.mean(nbytes))
    assert sum(manifest["kinds"][f"{n} boxes"] for n in range(4)) == IMAGES


def test_deterministic_for_a_seed(photos, tmp_path):
    out, _ = photos
    photo_shards.write_photo_shards(tmp_path, IMAGES, RECORDS, SHARDS, seed=3)
    for shard in out.glob("train-*"):
        assert (tmp_path / shard.name).read_bytes() == shard.read_bytes()


def test_fasttrain_reads_the_set_and_the_plain_rows_transform(photos):
    out, _ = photos
    cfg = make_config(
        recipe="resnet50", data_dir=str(out), batch_size=8, image_size=64, num_workers=0, data_backend="torch"
    )
    loader = build_loader(cfg, split="train", training=True, device=torch.device("cpu"))
    images, labels = next(iter(loader))
    assert images.shape == (8, 64, 64, 3) and images.dtype == torch.uint8
    transform = torch_input.PlainTransform(48, colour=True)
    x, label = transform(_records(out)[0])
    assert x.shape == (3, 48, 48) and x.dtype == torch.float32 and 1 <= label <= 1000


def test_random_resized_crop_box_stays_inside_with_torchvision_limits():
    rng = random.Random(0)
    for width, height in [(500, 375), (201, 800), (37, 5)]:
        for _ in range(200):
            left, top, w, h = torch_input.random_resized_crop_box(rng, width, height)
            assert 0 <= left and left + w <= width and 0 <= top and top + h <= height and w > 0 and h > 0
            if (w, h) != (width, height) and 3 / 4 <= width / height <= 4 / 3:
                assert 0.08 * width * height * 0.9 <= w * h  # rounding aside, the scale range's floor


def test_manifest_is_reused_only_for_the_same_arguments(photos, tmp_path):
    out, manifest = photos
    assert photo_shards.cached_photo_shards(out, IMAGES, RECORDS, SHARDS, seed=3) == manifest
    small = photo_shards.cached_photo_shards(tmp_path, 8, 16, 2, seed=3)
    assert json.loads((tmp_path / "photo_shards.json").read_text()) == small and small["images"] == 8
