"""The ResNet seed's vgg_preprocessing (fasttrain.data.vgg) against TensorFlow's own outputs.

References: tests/data/tf-vgg/, made by TensorFlow 2.21 running the seed's imagenet.py parser and
vgg_preprocessing.py ported to tf.compat.v1 (tests/data/make_tf_vgg.py), on every JPEG kind of
tests/data/tf-images/, for given (side, crop offsets, flip) and for the eval crop. They are TF's float
images before the means, times 255, stored as float16 (0.125 resolution above 128); fasttrain's are
uint8. An exact implementation is off by its rounding to uint8 (at most 0.5, about 0.25 on average)
plus the float16 storage (at most 0.0625): the bounds are 0.3 mean and 0.5 + 0.0625 + float noise.
The S = 224 references keep a 57 x 57 lattice of rows and columns (every 4th, and the last).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, JpegImagePlugin

from fasttrain.data import transforms, vgg
from fasttrain.data.jpeg import decode as jpeg
from fasttrain.data.jpeg.decode import CROP_DECODE, decode_jpeg
from fasttrain.data.normalize import normalize_images

FIXTURE = Path(__file__).parent / "data" / "tf-vgg"
IMAGES = Path(__file__).parent / "data" / "tf-images"
FIXED = json.loads((FIXTURE / "cases.json").read_text())
CASES = FIXED["cases"]
LATTICE = np.array(FIXED["lattice"])
QUANTISATION = 0.5 + 0.0625 + 1e-3  # uint8 rounding + float16 storage + float32 noise


def _subsampled(file: str) -> bool:
    """4:2:0 or 4:2:2 chroma (Pillow's reading of the file)."""
    image = Image.open(IMAGES / file)
    return image.mode == "RGB" and JpegImagePlugin.get_sampling(image) > 0


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE / "reference.npz") as npz:
        return {key: npz[key].astype(np.float32) for key in npz.files}


def _jpeg(case) -> bytes:
    return (IMAGES / case["file"]).read_bytes()


def _params(case) -> vgg.VggParams:
    return vgg.VggParams(case["side"], case["top"], case["left"], case["flip"])


def _kept(image: np.ndarray, case) -> np.ndarray:
    """The pixels the reference keeps (the lattice at S = 224)."""
    return image[LATTICE][:, LATTICE] if case["image_size"] == 224 else image


def _uint8(work: np.ndarray) -> np.ndarray:
    out = np.empty(work.shape, np.uint8)
    vgg._store(work, out)
    return out


def test_resize_geometry_is_tensorflows_for_every_listed_size():
    rows = FIXED["geometry"]
    assert sum(min(r[3], r[4]) == r[2] - 1 for r in rows) > 100  # the listed sizes include truncation
    for height, width, side, new_h, new_w in rows:
        assert vgg.smallest_size_at_least(height, width, side) == (new_h, new_w), (height, width, side)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case["key"])
def test_fast_path_is_tensorflows_and_the_full_image_paths_bit_for_bit(case, reference):
    data, size = _jpeg(case), case["image_size"]
    height, width = decode_jpeg(data).shape[:2]
    assert list(vgg.smallest_size_at_least(height, width, case["side"])) == case["resized"]
    if case["mode"] == "eval":
        assert vgg.eval_params(height, width, size) == _params(case)
    fast = vgg.window_float(data, _params(case), size)
    slow = vgg.full_float(decode_jpeg(data), _params(case), size)
    np.testing.assert_array_equal(fast, slow)
    diff = np.abs(_kept(_uint8(fast), case).astype(np.float32) - reference[case["key"]])
    assert diff.mean() < 0.3 and diff.max() <= QUANTISATION, (diff.mean(), diff.max())


def test_the_chroma_margin_is_what_makes_the_fast_path_exact(monkeypatch):
    """Without the widening, a cropped decode's edge column (chroma upsampled as at an image edge) enters
    the window for subsampled JPEGs: the fast path then differs from the full image's."""
    monkeypatch.setattr(vgg, "_CHROMA_MARGIN", 0)
    differs = set()
    for case in CASES:
        data, size = _jpeg(case), case["image_size"]
        fast = vgg.window_float(data, _params(case), size)
        if not np.array_equal(fast, vgg.full_float(decode_jpeg(data), _params(case), size)):
            differs.add(case["file"])
    assert differs and all(_subsampled(file) for file in differs), differs


def test_without_turbojpeg_the_window_of_the_full_decode_is_used_and_exact(monkeypatch):
    monkeypatch.setattr(jpeg, "_turbo", None)
    for case in CASES[::4]:
        data, size = _jpeg(case), case["image_size"]
        fast = vgg.window_float(data, _params(case), size)
        np.testing.assert_array_equal(fast, vgg.full_float(decode_jpeg(data), _params(case), size))


@pytest.mark.skipif(not CROP_DECODE, reason="the turbojpeg wheel (libturbojpeg 3) is not installed")
def test_only_the_rows_and_columns_the_window_reads_are_decoded(monkeypatch):
    decoded = []
    real = vgg.decode_window_rows

    def spy(data, checkpoints, window, file="", offset=0):
        decoded.append(window)
        return real(data, checkpoints, window, file, offset)

    monkeypatch.setattr(vgg, "decode_window_rows", spy)
    data = (IMAGES / "rocket_large.jpg").read_bytes()  # 901 x 1201: side 256 shrinks it 3.5x
    vgg.window_float(data, vgg.VggParams(256, 10, 20, False), 224)
    top, left, h, w = decoded[0]
    assert h * w < 0.8 * 901 * 1201 and top > 0 and left > 0  # a window, not the image


@pytest.mark.parametrize(
    "case", [c for c in CASES if c["key"] + "/final" in np.load(FIXTURE / "reference.npz")]
)
def test_normalized_batch_is_the_seeds_output_after_the_means(case, reference):
    """normalize_images(preprocess="vgg") on the uint8 image against the seed's final float output (means
    subtracted on the [0, 1] scale): within the uint8 rounding, 0.5 / 255, plus float16 storage
    (values below 1 in magnitude: at most 2**-12) and float32 noise."""
    ours = vgg.eval_transform(_jpeg(case), case["image_size"])
    y = normalize_images(torch.from_numpy(ours)[None], "vgg").permute(0, 2, 3, 1)[0].numpy()
    diff = np.abs(y - reference[case["key"] + "/final"])
    assert diff.max() <= 0.5 / 255 + 2**-12 + 1e-6, diff.max() * 255


def test_train_draws_cover_the_seeds_ranges():
    """side uniform in [256, 512], offsets uniform in [0, H' - 224] and [0, W' - 224], flip 1/2."""
    rng = np.random.default_rng(0)
    draws = [vgg.sample_train_params(rng, 375, 500, 224) for _ in range(4000)]
    sides = np.array([p.side for p in draws])
    assert sides.min() == 256 and sides.max() == 512 and abs(sides.mean() - 384) < 3
    for p in draws[:500]:
        new_h, new_w = vgg.smallest_size_at_least(375, 500, p.side)
        assert 0 <= p.top <= new_h - 224 and 0 <= p.left <= new_w - 224
    # offsets uniform over [0, H' - 224]: as a fraction of the range, from 0 to 1 with mean 1/2
    for axis, extent in (("top", 0), ("left", 1)):
        spans = [vgg.smallest_size_at_least(375, 500, p.side)[extent] - 224 for p in draws]
        frac = np.array([getattr(p, axis) for p in draws]) / np.array(spans)
        assert frac.min() == 0 and frac.max() > 0.99 and abs(frac.mean() - 0.5) < 0.02, axis
    assert abs(np.mean([p.flip for p in draws]) - 0.5) < 0.03


def test_loader_transforms_dispatch_vgg_and_write_into_out():
    data = (IMAGES / "chelsea_422.jpg").read_bytes()
    out = np.zeros((224, 224, 3), np.uint8)
    got = transforms.train_transform(data, np.zeros((0, 4)), np.random.default_rng(5), 224, "vgg", out=out)
    params = vgg.sample_train_params(np.random.default_rng(5), 287, 391, 224)
    assert got is out
    np.testing.assert_array_equal(out, _uint8(vgg.full_float(decode_jpeg(data), params, 224)))
    ours = transforms.eval_transform(data, 224, "vgg")
    np.testing.assert_array_equal(ours, transforms.apply_eval(decode_jpeg(data), 224, "vgg"))
    np.testing.assert_array_equal(
        ours, _uint8(vgg.full_float(decode_jpeg(data), vgg.eval_params(287, 391, 224), 224))
    )


def test_an_image_size_the_resize_cannot_hold_is_one_clear_error():
    # side round(1 * 256 / 224) = 1; in float32, 41 * (1 / 41) is just below 1, truncated to 0
    with pytest.raises(ValueError, match="image_size 1 is larger than the 0x0 resize to side 1"):
        vgg.eval_params(41, 41, 1)


def test_torch_loader_delivers_the_seeds_eval_images(tmp_path):
    """The torch backend end to end (shard -> TorchLoader -> uint8 NHWC batch) with preprocess vgg."""
    from fasttrain.config import make_config
    from fasttrain.data.synthetic import converter_example
    from fasttrain.data.tfrecord import write_index_file, write_records
    from fasttrain.data.torch_pipeline import TorchLoader

    files = list(dict.fromkeys(case["file"] for case in CASES))
    records = []
    for label, file in enumerate(files, start=1):
        data = (IMAGES / file).read_bytes()
        height, width = decode_jpeg(data).shape[:2]
        records.append(converter_example(data, height, width, label, "n0", "x", file, []))
    shard = tmp_path / "validation-00000-of-00001"
    write_index_file(shard.with_name(shard.name + ".idx"), write_records(shard, records))
    cfg = make_config(
        data_dir=str(tmp_path), batch_size=len(files), image_size=224, preprocess="vgg", num_workers=0,
        num_classes=len(files), label_offset=-1, data_backend="torch", data_cache_dir=str(tmp_path / "c"),
    )  # fmt: skip
    ((images, labels),) = list(TorchLoader(cfg, "validation", training=False))
    assert images.dtype == torch.uint8 and labels.tolist() == list(range(len(files)))
    for i, file in enumerate(files):
        data = (IMAGES / file).read_bytes()
        expected = vgg.full_float(decode_jpeg(data), vgg.eval_params(*decode_jpeg(data).shape[:2], 224), 224)
        np.testing.assert_array_equal(images[i].numpy(), _uint8(expected))


def _rounded(work: np.ndarray) -> np.ndarray:
    """round(x * 255) in NumPy's float32 (independent of the kernels' fused store)."""
    scaled = work.astype(np.float32) * np.float32(255) + np.float32(0.5)
    return np.clip(np.floor(scaled), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("case", CASES[::3], ids=lambda case: case["key"])
def test_the_transforms_uint8_is_the_full_image_path_rounded(case, monkeypatch):
    """The loaders' call (resample and rounding fused, written into `out`) against the seed's steps on
    the whole decode, rounded in NumPy: equal (the fused store keeps no float image to compare)."""
    data, size = _jpeg(case), case["image_size"]
    expected = _rounded(vgg.full_float(decode_jpeg(data), _params(case), size))
    monkeypatch.setattr(vgg, "sample_train_params", lambda *args: _params(case))
    out = np.zeros((size, size, 3), np.uint8)
    assert vgg.train_transform(data, np.random.default_rng(0), size, out=out) is out
    np.testing.assert_array_equal(out, expected)
    if case["mode"] == "eval":
        np.testing.assert_array_equal(vgg.eval_transform(data, size), expected)


def test_threads_decoding_at_once_get_their_own_images():
    """Each thread decodes into its own reused buffer (jpeg.decode_window_rows) with its own TurboJPEG
    handle: two threads transforming different images at once get what one thread gets."""
    from concurrent.futures import ThreadPoolExecutor

    files = list(dict.fromkeys(case["file"] for case in CASES))
    datas = [(IMAGES / file).read_bytes() for file in files] * 4
    alone = [vgg.eval_transform(data, 224) for data in datas]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda data: vgg.eval_transform(data, 224), datas))
    for ours, reference_image, file in zip(together, alone, files * 4):
        np.testing.assert_array_equal(ours, reference_image, err_msg=file)
