"""fasttrain's images (data/jpeg/decode.py's decode, data/transforms.py's eval and train transforms, their
resize and colour steps, the DALI eval pipeline) against TensorFlow's own, for the same JPEGs and the
same random choices.

The references were made by TensorFlow 2.21 running the seeds' preprocessing (tests/data/make_tf_images.py;
the fixture's own structure is checked by test_transforms_tf_fixture.py). They are float results scaled to
0..255 and stored as float16 (0.125 resolution above 128); fasttrain's are uint8. An exact
implementation is therefore off by its rounding to uint8 (at most 0.5, about 0.25 on average) plus the
float16 storage (at most 0.0625): the bounds below are 0.5 mean and 0.5 + 0.0625 + float noise for the
largest pixel.
"""

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from fasttrain.data import DataError
from fasttrain.data.color import ColorParams
from fasttrain.data.jpeg import decode as jpeg
from fasttrain.data.jpeg.decode import CROP_DECODE, decode_and_crop_jpeg, decode_jpeg, decode_window_rows
from fasttrain.data.transforms import (
    TrainParams,
    apply_eval,
    apply_train,
    inception_central_crop,
    resnet_resize_size,
    sample_train_params,
    train_transform,
)

FIXTURE = Path(__file__).parent / "data" / "tf-images"
CASES = json.loads((FIXTURE / "cases.json").read_text())
QUANTISATION = 0.5 + 0.0625 + 1e-3  # uint8 rounding + float16 storage + float32 noise


# Files whose chroma is subsampled (4:2:0 / 4:2:2): TF's cropped decode differs from a crop of the full
# decode (what fasttrain falls back to without the turbojpeg wheel) in the window's first or last
# column (libjpeg upsamples chroma at the crop edge as at an image edge); 4:4:4, grayscale and CMYK
# crops are identical.
def _subsampled(name: str) -> bool:
    image = Image.open(FIXTURE / name)
    return image.mode == "RGB" and JpegImagePlugin.get_sampling(image) > 0


SUBSAMPLED = {case["file"] for case in CASES["decode"] if _subsampled(case["file"])}


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE / "reference.npz") as npz:
        return {key: npz[key].astype(np.float32) for key in npz.files}


def _jpeg(name: str) -> bytes:
    return (FIXTURE / name).read_bytes()


@pytest.mark.parametrize("case", CASES["decode"], ids=lambda case: case["file"])
def test_decode_is_tensorflows_bit_for_bit(case):
    image = decode_jpeg(_jpeg(case["file"]))
    assert list(image.shape) == case["shape"] and image.dtype == np.uint8
    assert image.reshape(-1, 3).sum(0, dtype=np.int64).tolist() == case["sum"]
    assert hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest() == case["sha256"]


@pytest.mark.skipif(not CROP_DECODE, reason="the turbojpeg wheel (libturbojpeg 3) is not installed")
@pytest.mark.parametrize("case", CASES["decode_crop"], ids=lambda case: case["key"])
def test_cropped_decode_is_tensorflows_decode_and_crop_bit_for_bit(case, reference):
    ours = decode_and_crop_jpeg(_jpeg(case["file"]), case["window"])
    assert ours.shape == reference[case["key"]].shape
    assert np.array_equal(ours, reference[case["key"]])


@pytest.mark.parametrize("case", CASES["decode_crop"], ids=lambda case: case["key"])
@pytest.mark.parametrize("turbo", [True, False], ids=["turbojpeg", "without-turbojpeg"])
def test_window_rows_are_tensorflows_decode_and_crop(case, turbo, reference, monkeypatch):
    """decode_window_rows (the consumers' in-place form of decode_and_crop_jpeg) holds TF's window."""
    if turbo and not CROP_DECODE:
        pytest.skip("the turbojpeg wheel (libturbojpeg 3) is not installed")
    if not turbo:
        monkeypatch.setattr(jpeg, "_turbo", None)
    top, left, h, w = case["window"]
    rows, x = decode_window_rows(_jpeg(case["file"]), case["window"])
    ours = rows.reshape(h, -1, 3)[:, left - x : left - x + w]
    if turbo or case["file"] not in SUBSAMPLED:
        np.testing.assert_array_equal(ours, reference[case["key"]])


@pytest.mark.parametrize("case", CASES["decode_crop"], ids=lambda case: case["key"])
def test_without_turbojpeg_the_window_of_the_full_decode_is_close(case, reference, monkeypatch):
    monkeypatch.setattr(jpeg, "_turbo", None)
    ours = decode_and_crop_jpeg(_jpeg(case["file"]), case["window"]).astype(np.float32)
    diff = np.abs(ours - reference[case["key"]])
    if case["file"] not in SUBSAMPLED:
        assert diff.max() == 0
    else:  # edge columns only, at most 0.1 levels on average over the window (measured: <= 0.09)
        assert diff[:, 1:-1].max() == 0 and diff.mean() < 0.1


def _levels(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    diff = np.abs(ours.astype(np.float32) - theirs)
    return float(diff.mean()), float(diff.max())


@pytest.mark.parametrize("case", CASES["eval"], ids=lambda case: case["key"])
def test_eval_transform_is_tensorflows(case, reference):
    image = decode_jpeg(_jpeg(case["file"]))
    ours = apply_eval(image, case["image_size"], case["preprocess"])
    mean, worst = _levels(ours, reference[case["key"]])
    assert mean < 0.3 and worst <= QUANTISATION, (mean, worst)


def _train_params(case) -> TrainParams:
    color = case["color"]
    if color is not None:
        color = ColorParams(
            color["ordering"], color["brightness"], color["saturation"], color["hue"], color["contrast"]
        )
    return TrainParams(tuple(case["window"]), case["flip"], case["method"], color)


def _train_image(case) -> tuple[np.ndarray, TrainParams]:
    """The decoded image and the parameters for it, as train_transform decodes (the window alone for
    ResNet, as TF's decode_and_crop_jpeg)."""
    params = _train_params(case)
    if case["preprocess"] == "inception":
        return decode_jpeg(_jpeg(case["file"])), params
    _, _, h, w = params.crop
    return decode_and_crop_jpeg(_jpeg(case["file"]), params.crop), replace(params, crop=(0, 0, h, w))


@pytest.mark.parametrize("case", CASES["train"], ids=lambda case: case["key"])
def test_train_transform_for_given_choices_is_tensorflows(case, reference):
    if case["preprocess"] == "resnet" and case["file"] in SUBSAMPLED and not CROP_DECODE:
        pytest.skip("the turbojpeg wheel (libturbojpeg 3) is not installed: the edge column differs")
    image, params = _train_image(case)
    ours = apply_train(image, params, case["image_size"], case["preprocess"])
    # Without colour the seed does not clip: bicubic overshoots past 0..255, which uint8 cannot hold.
    theirs = np.clip(reference[case["key"]], 0, 255)
    mean, worst = _levels(ours, theirs)
    assert mean < 0.3, mean
    assert worst <= QUANTISATION, worst


@pytest.mark.parametrize(
    "case", [c for c in CASES["train"] if c["preprocess"] == "resnet"], ids=lambda c: c["key"]
)
def test_without_turbojpeg_resnet_train_images_are_close(case, reference, monkeypatch):
    monkeypatch.setattr(jpeg, "_turbo", None)
    image, params = _train_image(case)
    ours = apply_train(image, params, case["image_size"], case["preprocess"])
    theirs = np.clip(reference[case["key"]], 0, 255)
    mean, worst = _levels(ours, theirs)
    assert mean < 0.3, mean
    if case["file"] in SUBSAMPLED:
        # TF's cropped decode differs in the window's edge column for subsampled JPEGs (see above);
        # resizing a small window up to S spreads that over a few output columns (measured: at most
        # 1.25% of the pixels beyond rounding, by up to 6.25 levels, on the fixture's small windows).
        beyond = np.abs(ours.astype(np.float32) - theirs) > QUANTISATION
        assert beyond.mean() < 0.02 and worst <= 8, (beyond.mean(), worst)
    else:
        assert worst <= QUANTISATION, worst


def test_eval_geometry_is_tensorflows_for_every_listed_size():
    for height, width, resize_min, new_h, new_w in CASES["geometry"]["resnet"]:
        image_size = {256: 224, 64: 56}[resize_min]  # resize_min = round(S * 256 / 224)
        assert resnet_resize_size(height, width, image_size) == (new_h, new_w), (height, width)
    for height, width, top, left, crop_h, crop_w in CASES["geometry"]["inception"]:
        assert inception_central_crop(height, width) == (top, left, crop_h, crop_w), (height, width)


@pytest.mark.parametrize("preprocess", ["inception", "resnet"])
def test_dali_eval_against_tensorflow(tmp_path, reference, preprocess):
    """DALI's eval images (CPU mode) against TF's: the geometry and resize are TF's (test_dali_graph),
    the decoder is not (libjpeg-turbo's accurate IDCT in DALI, the fast one in TF): about 1 level on
    average, the figure the README gives. The small photos' Inception crops are upscaled to S, where
    the bilinear taps of the crop's last rows and columns clamp at the crop's edge as TF's do."""
    pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed")
    import torch

    from fasttrain.config import make_config
    from fasttrain.data.dali_pipeline import DaliLoader
    from fasttrain.data.normalize import normalize_images
    from fasttrain.data.synthetic import converter_example
    from fasttrain.data.tfrecord import write_index_file, write_records

    cases = [case for case in CASES["eval"] if case["preprocess"] == preprocess]
    records = []
    for label, case in enumerate(cases, start=1):
        height, width = decode_jpeg(_jpeg(case["file"])).shape[:2]
        records.append(
            converter_example(_jpeg(case["file"]), height, width, label, "n0", "x", case["file"], [])
        )
    shard = tmp_path / "validation-00000-of-00001"
    write_index_file(shard.with_name(shard.name + ".idx"), write_records(shard, records))
    cfg = make_config(
        data_dir=str(tmp_path), batch_size=len(cases), image_size=56, preprocess=preprocess,
        num_classes=len(cases), label_offset=-1, num_workers=1, data_cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    ((images, labels),) = list(DaliLoader(cfg, "validation", training=False))
    assert labels.tolist() == list(range(len(cases)))
    theirs = torch.from_numpy(np.stack([reference[case["key"]] for case in cases]))
    # The same normalisation on both sides, then back to levels of 255.
    scale = 127.5 if preprocess == "inception" else 1.0
    diff = (images - normalize_images(theirs, preprocess).permute(0, 2, 3, 1)).abs() * scale
    worst = {case["file"]: float(d.max()) for case, d in zip(cases, diff)}
    print(f"DALI vs TensorFlow, {preprocess} eval: mean {float(diff.mean()):.2f} levels, max {worst}")
    assert float(diff.mean()) < 1.5
    # The two IDCTs' outputs differ by up to 7 levels at a pixel on these photos (DALI's decode against
    # TF's, measured); a bilinear tap is a convex combination of four decoded pixels, so the resize
    # cannot make that worse, and the rest is rounding (0.5 level for each side). Taps read from beyond
    # Inception's crop put the small photos 20 and 26 levels off (up to 139 on a 20x15 photo at 299).
    assert max(worst.values()) <= 8, worst


@pytest.mark.parametrize("name", ["coffee_cmyk.jpg", "coffee_cmyk_plain.jpg"])
def test_dali_decodes_cmyk_with_and_without_adobes_marker_as_tensorflow(name, reference):
    """DALI's CPU decode of the CMYK files against TF's decode_and_crop_jpeg windows (full-resolution
    CMYK: the same pixels as TF's whole decode, "vs_crop_of_decode" 0). The IDCTs differ (as for
    DALI's eval above): at most 8 levels at a pixel over the whole images, 5 in these windows
    (measured); the other CMYK convention is 114 and 126 levels off on average."""
    pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed")
    from nvidia.dali import fn, pipeline_def, types

    data = _jpeg(name)

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def decode():
        encoded = fn.external_source(source=lambda: [np.frombuffer(data, np.uint8)], batch=True)
        return fn.decoders.image(encoded, device="cpu", output_type=types.RGB)

    pipe = decode()
    pipe.build()
    image = np.array(pipe.run()[0][0]).astype(np.float32)
    for case in [c for c in CASES["decode_crop"] if c["file"] == name]:
        top, left, h, w = case["window"]
        diff = np.abs(image[top : top + h, left : left + w] - reference[case["key"]])
        assert diff.mean() < 1.5 and diff.max() <= 8, (case["key"], diff.mean(), diff.max())


@pytest.mark.skipif(not CROP_DECODE, reason="the turbojpeg wheel (libturbojpeg 3) is not installed")
@pytest.mark.parametrize("name", ["chelsea_422.jpg", "astronaut_q90.jpg", "rocket_444.jpg"])
def test_resnet_train_transform_decodes_only_the_window(name):
    """train_transform draws the crop from the header's size and decodes the window alone, as the seed's
    decode_and_crop_jpeg: for subsampled chroma the edge column tells it from a crop of the full decode."""
    jpeg_bytes = _jpeg(name)
    height, width = decode_jpeg(jpeg_bytes).shape[:2]
    differs = 0
    for seed in range(12):
        ours = train_transform(jpeg_bytes, np.zeros((0, 4)), np.random.default_rng(seed), 64)
        params = sample_train_params(
            np.random.default_rng(seed), height, width, np.zeros((0, 4)), "resnet", False
        )
        _, _, h, w = params.crop
        window = decode_and_crop_jpeg(jpeg_bytes, params.crop)
        expected = apply_train(window, replace(params, crop=(0, 0, h, w)), 64, "resnet")
        np.testing.assert_array_equal(ours, expected)
        full = apply_train(decode_jpeg(jpeg_bytes), params, 64, "resnet")
        differs += not np.array_equal(ours, full)
    assert differs == 0 if name not in SUBSAMPLED else differs > 0


def test_truncated_jpeg_fails_where_tensorflow_fails():
    """TF 2.21's decode_and_crop_jpeg on the first half of rocket_large.jpg (measured): a window in the
    intact rows decodes, one below the cut raises "Premature end of JPEG data"; ours does the same."""
    truncated = _jpeg("rocket_large.jpg")[: len(_jpeg("rocket_large.jpg")) // 2]
    if CROP_DECODE:
        assert decode_and_crop_jpeg(truncated, (0, 0, 50, 50)).shape == (50, 50, 3)
    with pytest.raises(DataError, match="undecodable JPEG in record at offset 9 in shard-y"):
        decode_and_crop_jpeg(truncated, (800, 0, 50, 50), "shard-y", 9)
    with pytest.raises(DataError, match="shard-y"):
        decode_and_crop_jpeg(b"not a jpeg", (0, 0, 1, 1), "shard-y", 9)
