"""The Inception seed's train transform in one call (fasttrain/data/jpeg/fused.py's
crop_resize_inception): the crop's rows with the whole decode's pixels, the resize method drawn and the
colour distortion, in one GIL-free call.

References, as in test_jpeg_fused.py: TensorFlow's own train images (the committed fixture,
tests/data/tf-images), and the calls the fused one replaces (doctor.decode_full_window_rows, then
transforms.apply_train), which it must equal bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import simplejpeg
from test_jpeg_doctor import CASES as PHOTOS
from test_transforms_tf import CASES, FIXTURE, QUANTISATION, _levels, _train_params, reference  # noqa: F401

from fasttrain.data import transforms
from fasttrain.data.color import sample_color
from fasttrain.data.jpeg import decode, doctor, fused
from fasttrain.data.resize import METHODS
from fasttrain.data.transforms import TrainParams, apply_train, train_transform

pytestmark = pytest.mark.skipif(not fused.FUSED, reason="needs libjpeg-turbo's TurboJPEG library")


def _usual_inception(jpeg, checkpoints, window, width, method, flip, color, size):
    """The Inception train transform's separate calls: the crop's rows with the whole decode's pixels
    (doctor.decode_full_window_rows), then resize and colour (transforms.apply_train)."""
    rows, x = doctor.decode_full_window_rows(jpeg, checkpoints, window, width)
    _, left, h, w = window
    params = TrainParams((0, left - x, h, w), flip, method, color)
    return apply_train(rows.reshape(h, -1, 3), params, size, "inception")


def _fused_inception(jpeg, checkpoints, window, width, method, flip, color, size):
    out, work = np.full((size, size, 3), 7, np.uint8), np.empty((size, size, 3), np.float32)
    done = fused.crop_resize_inception(jpeg, checkpoints, window, width, method, flip, color, out, work)
    assert done, window
    return out


@pytest.mark.parametrize(
    "case", [c for c in CASES["train"] if c["preprocess"] == "inception"], ids=lambda c: c["key"]
)
def test_inception_train_images_are_tensorflows(case, reference):  # noqa: F811 (the fixture)
    jpeg = (FIXTURE / case["file"]).read_bytes()
    width = decode.jpeg_size(jpeg)[1]
    params = _train_params(case)
    if case["file"] == "coffee_cmyk.jpg":  # the usual path's (CMYK: fasttrain/data/jpeg/fused.py's docstring)
        return
    ours = _fused_inception(
        jpeg,
        doctor.row_checkpoints(jpeg),
        params.crop,
        width,
        params.method,
        params.flip,
        params.color,
        case["image_size"],
    )
    mean, worst = _levels(ours, np.clip(reference[case["key"]], 0, 255))
    assert mean < 0.3, mean
    assert worst <= QUANTISATION, worst


@pytest.mark.parametrize("name,jpeg,mcu_h", PHOTOS, ids=[c[0] for c in PHOTOS])
def test_inception_equals_the_decode_resize_and_colour_it_replaces(name, jpeg, mcu_h):
    """Every resize method, with and without colour, both flips, with and without checkpoints."""
    checkpoints = doctor.row_checkpoints(jpeg)
    height, width = simplejpeg.decode_jpeg_header(jpeg)[:2]
    rng = np.random.default_rng(len(jpeg) + 1)
    for i in range(24):
        h, w = int(rng.integers(1, height + 1)), int(rng.integers(1, width + 1))
        window = (int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w)
        method, flip, color = METHODS[i % 4], bool(i // 4 % 2), sample_color(rng) if i // 8 % 2 else None
        for cp in (checkpoints, None):
            args = (jpeg, cp, window, width, method, flip, color, 21)
            np.testing.assert_array_equal(_fused_inception(*args), _usual_inception(*args), str(args[2:]))


def test_the_inception_transform_goes_through_the_fused_call(monkeypatch):
    jpeg = (FIXTURE / "rocket_444.jpg").read_bytes()
    boxes = np.zeros((0, 4), np.float32)

    def images():
        return [
            train_transform(jpeg, boxes, np.random.default_rng(s), 48, "inception", color_distort=s % 2 == 1)
            for s in range(8)
        ]

    expected = images()

    def refused(*args, **kwargs):
        raise AssertionError("the separate decode ran")

    monkeypatch.setattr(transforms, "decode_full_window_rows", refused)
    for got, want in zip(images(), expected, strict=True):
        np.testing.assert_array_equal(got, want)
