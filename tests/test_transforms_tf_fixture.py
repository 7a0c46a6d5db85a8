"""The TensorFlow image fixture of test_transforms_tf.py (tests/data/tf-images, written by
tests/data/make_tf_images.py) is what it claims: every JPEG is of the kind its case names (read with
Pillow and by walking the JPEG markers), and cases.json and reference.npz agree on files, keys, windows
and shapes. No TensorFlow needed."""

import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

FIXTURE = Path(__file__).parent / "data" / "tf-images"
CASES = json.loads((FIXTURE / "cases.json").read_text())
DECODE = {case["file"]: case for case in CASES["decode"]}
METHODS = {"bilinear", "nearest", "bicubic", "area"}
SUBSAMPLING = {"baseline-420-q90": 2, "baseline-420-q75": 2, "baseline-422": 1, "baseline-444": 0}


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE / "reference.npz") as npz:
        return {key: npz[key] for key in npz.files}


def _markers(data):
    """The JPEG's segments as (marker, payload) up to the end of the first scan, and the number of
    restart markers (0xFFD0..0xFFD7) in that scan's entropy-coded data."""
    assert data[:2] == b"\xff\xd8", "no SOI"
    segments, pos = [], 2
    while True:
        marker, length = data[pos + 1], struct.unpack(">H", data[pos + 2 : pos + 4])[0]
        segments.append((marker, data[pos + 4 : pos + 2 + length]))
        pos += 2 + length
        if marker == 0xDA:  # SOS: entropy-coded data follows up to the next non-RST marker
            restarts = 0
            while not (data[pos] == 0xFF and data[pos + 1] not in (0x00, *range(0xD0, 0xD8))):
                restarts += data[pos] == 0xFF and data[pos + 1] != 0x00
                pos += 1
            return segments, restarts


def test_files_and_keys_agree():
    assert sorted(DECODE) == sorted(path.name for path in FIXTURE.glob("*.jpg"))
    for section in ("decode_crop", "eval", "train"):
        assert {case["file"] for case in CASES[section]} <= set(DECODE), section
    with np.load(FIXTURE / "reference.npz") as npz:
        keys = [case["key"] for section in ("decode_crop", "eval", "train") for case in CASES[section]]
        assert sorted(keys) == sorted(npz.files)  # every array used once, none left over
    assert len(DECODE) >= 12


@pytest.mark.parametrize("case", CASES["decode"], ids=lambda case: case["file"])
def test_jpeg_is_the_kind_it_claims(case):
    data = (FIXTURE / case["file"]).read_bytes()
    image = Image.open(io.BytesIO(data))
    segments, restarts = _markers(data)
    markers = [marker for marker, _ in segments]
    kind = case["kind"]
    assert image.format == "JPEG"
    assert "error" not in case and case["shape"] == [image.height, image.width, 3]
    assert len(case["sha256"]) == 64 and len(case["sum"]) == 3
    assert (0xC2 in markers) == ("progressive" in kind) == bool(image.info.get("progressive"))
    assert (image.mode == "L") == kind.startswith("grayscale") == (image.layers == 1)
    assert (image.mode == "CMYK") == kind.startswith("cmyk") == (image.layers == 4)
    if kind.startswith("cmyk"):
        # Adobe APP14: TF's k * c / 255 branch; none: (255 - k) * (255 - c) / 255
        assert (image.info.get("adobe") is not None) == (0xEE in markers) == (kind == "cmyk")
        assert JpegImagePlugin.get_sampling(image) == -1  # Pillow reports -1 for 4 components
    if kind in SUBSAMPLING:
        assert JpegImagePlugin.get_sampling(image) == SUBSAMPLING[kind]
    (dri,) = [payload for marker, payload in segments if marker == 0xDD] or [None]
    assert (dri is not None) == (kind == "restart") == (restarts > 0)
    if kind == "restart":  # 2 MCUs per interval: one RST per interval but the last
        mcus = -(-image.width // 16) * -(-image.height // 16)
        assert struct.unpack(">H", dri)[0] == 2 and restarts == (mcus - 1) // 2
    assert ("exif" in image.info) == (kind == "exif")
    if kind == "exif":
        assert image.getexif()[0x0112] == 6  # Orientation, ignored by TF's decode
    assert ("icc_profile" in image.info) == ("comment" in image.info) == (kind == "icc-comment")
    assert (kind == "large") == (min(image.size) >= 800)
    assert (kind == "tiny") == (max(image.size) <= 8)


def test_decode_crop_windows_and_arrays(reference):
    for case in CASES["decode_crop"]:
        top, left, h, w = case["window"]
        height, width, _ = DECODE[case["file"]]["shape"]
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width, case
        assert reference[case["key"]].dtype == np.uint8
        assert reference[case["key"]].shape == (h, w, 3)
    touching = [c for c in CASES["decode_crop"] if sum(c["window"][0::2]) == DECODE[c["file"]]["shape"][0]]
    assert touching and any(c["window"][0] % 2 and c["window"][1] % 2 for c in CASES["decode_crop"])


def test_eval_cases(reference):
    photos = {f for f, c in DECODE.items() if c["kind"] not in ("large", "tiny", "cmyk", "cmyk-plain")}
    # Inception's eval crop is upscaled (under S on a side) in the small ones, one side at least
    small = [case["shape"] for f, case in DECODE.items() if case["kind"] == "small"]
    assert len(small) >= 3 and all(min(h - 2 * (h // 16), w - 2 * (w // 16)) < 56 for h, w, _ in small)
    for preprocess in ("inception", "resnet"):
        assert {c["file"] for c in CASES["eval"] if c["preprocess"] == preprocess} == photos
    for case in CASES["eval"]:
        s = case["image_size"]
        out = reference[case["key"]]
        assert out.dtype == np.float16 and out.shape == (s, s, 3)
        assert 0 <= out.min() and out.max() <= 255  # bilinear never overshoots
        if case["preprocess"] == "resnet":
            # float32 truncation may leave the short side one below resize_min (332x500 -> 255x385)
            assert min(case["resized_shape"]) in (case["resize_min"] - 1, case["resize_min"])
            assert min(case["resized_shape"]) >= s


def test_train_cases(reference):
    for case in CASES["train"]:
        s = case["image_size"]
        top, left, h, w = case["window"]
        height, width, _ = DECODE[case["file"]]["shape"]
        assert h >= 8 and w >= 8 and 0 <= top and top + h <= height and 0 <= left and left + w <= width
        assert case["method"] in METHODS and isinstance(case["flip"], bool)
        out = reference[case["key"]]
        assert out.dtype == np.float16 and out.shape == (s, s, 3)
        if case["color"] is not None:
            color = case["color"]
            assert case["preprocess"] == "inception" and color["ordering"] in (0, 1)
            for name, (lo, hi) in {"brightness": (-32 / 255, 32 / 255), "saturation": (0.5, 1.5)}.items():
                assert lo <= color[name] <= hi and float(np.float32(color[name])) == color[name]
            for name, (lo, hi) in {"hue": (-0.2, 0.2), "contrast": (0.5, 1.5)}.items():
                assert lo <= color[name] <= hi and float(np.float32(color[name])) == color[name]
            assert 0 <= out.min() and out.max() <= 255  # clipped after the colour ops
    inception = [c for c in CASES["train"] if c["preprocess"] == "inception"]
    for method in METHODS:  # each method upsamples at least once and shrinks at least 3x at least once
        windows = [c["window"] for c in inception if c["method"] == method]
        assert any(max(win[2:]) < 56 for win in windows) and any(min(win[2:]) >= 168 for win in windows)
    assert {c["color"]["ordering"] for c in inception if c["color"]} == {0, 1}
    assert all(c["method"] == "bilinear" and c["color"] is None for c in CASES["train"] if c not in inception)


def test_geometry_rows():
    resnet, inception = CASES["geometry"]["resnet"], CASES["geometry"]["inception"]
    assert len(inception) >= 300 and len(resnet) == 2 * len(inception)
    assert [332, 500, 256, 255, 385] in resnet  # the float32 truncation DESIGN.md names
    for h, w, r, new_h, new_w in resnet:
        assert r in (64, 256) and min(new_h, new_w) in (r - 1, r)
        assert (new_h >= new_w) if h >= w else (new_w >= new_h)
    for h, w, top, left, crop_h, crop_w in inception:
        assert crop_h == h - 2 * top and crop_w == w - 2 * left and crop_h >= 1 and crop_w >= 1
