"""The seeds' crop sampler, train/eval transforms, colour distortion, JPEG modes, and normalisation."""

import io
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from PIL import Image

from fasttrain.data import DataError
from fasttrain.data.color import (
    ColorParams,
    _saturate,
    _saturate_select,
    _shift_hue,
    _shift_hue_select,
    distort_color,
    sample_color,
)
from fasttrain.data.jpeg.decode import decode_jpeg
from fasttrain.data.normalize import normalize_images
from fasttrain.data.resize import resize
from fasttrain.data.seeding import SampleGenerator
from fasttrain.data.transforms import (
    eval_transform,
    inception_central_crop,
    resnet_resize_size,
    sample_distorted_bounding_box,
    train_transform,
)


def _encode(array: np.ndarray, fmt="JPEG", mode=None, quality=95) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(array)
    if mode:
        img = img.convert(mode)
    # quality 100 without chroma subsampling: sharp colour edges for the geometry tests
    img.save(buf, fmt, **({"quality": quality, "subsampling": 0} if fmt == "JPEG" else {}))
    return buf.getvalue()


# --- sample_distorted_bounding_box -----------------------------------------------------------------


@pytest.mark.parametrize("height, width", [(300, 400), (375, 500), (120, 40), (64, 64)])
def test_crop_area_and_aspect_statistics(height, width):
    rng = np.random.default_rng(0)
    crops = np.array(
        [sample_distorted_bounding_box(rng, height, width, np.zeros((0, 4))) for _ in range(3000)]
    )
    top, left, h, w = crops.T
    assert np.all((top >= 0) & (left >= 0) & (top + h <= height) & (left + w <= width))
    whole = (h == height) & (w == width)
    area = h * w / (height * width)
    # TF's sampler rejects any rounded crop outside the area range; w = round(h * aspect) moves the
    # ratio by at most 0.5 / h from a sampled aspect in [0.75, 1.33].
    assert np.all(area[~whole] >= 0.05 - 1e-6) and np.all(area <= 1.0)
    ratio = w / h
    assert np.all(ratio[~whole] >= 0.75 - 0.5 / h[~whole]) and np.all(ratio[~whole] <= 1.33 + 0.5 / h[~whole])
    if (height, width) == (300, 400):
        # With no boxes the whole image is the object, so min_object_covered 0.1 raises the smallest
        # area from 0.05 to 0.1 (TF's semantics); the rest of the range is used.
        assert 0.1 <= area.min() < 0.11 and area.max() > 0.9 and 0.3 < np.median(area) < 0.6
        assert ratio[~whole].min() < 0.77 and ratio[~whole].max() > 1.3
        assert whole.mean() < 0.01


def test_crop_covers_at_least_min_object_covered_of_a_box():
    rng = np.random.default_rng(1)
    height, width = 200, 300
    box = np.array([[0.05, 0.7, 0.25, 0.95]], np.float32)  # a small object in a corner
    y0, x0, y1, x1 = int(0.05 * height), int(0.7 * width), int(0.25 * height), int(0.95 * width)
    covered = []
    for _ in range(2000):
        top, left, h, w = sample_distorted_bounding_box(rng, height, width, box)
        inter = max(0, min(top + h, y1) - max(top, y0)) * max(0, min(left + w, x1) - max(left, x0))
        covered.append(inter / ((y1 - y0) * (x1 - x0)))
    assert min(covered) >= 0.1
    assert np.mean(np.array(covered) < 0.9) > 0.2  # not just the whole image every time


def test_impossible_constraints_fall_back_to_the_whole_image():
    rng = np.random.default_rng(2)
    crop = sample_distorted_bounding_box(
        rng, 100, 100, np.zeros((0, 4)), aspect_ratio_range=(3.0, 4.0), area_range=(0.9, 1.0)
    )
    assert crop == (0, 0, 100, 100)


def _search_cases(count: int):
    """Seeded random (height, width, boxes, min_object_covered, aspect range, area range, attempts)."""
    rng = np.random.default_rng(5)
    for trial in range(count):
        height, width = int(rng.integers(1, 1500)), int(rng.integers(1, 1500))
        k = int(rng.integers(0, 4))
        boxes = rng.random((k, 4)).astype(np.float32) * 1.4 - 0.2  # some outside [0, 1]: clipped
        if trial % 3 == 0:
            boxes = np.sort(rng.random((k, 4)).astype(np.float32), axis=1)
        aspect = (0.75, 1.33) if trial % 2 else (float(rng.uniform(0.2, 1)), float(rng.uniform(1, 3)))
        area = (0.05, 1.0) if trial % 4 else (float(rng.uniform(0, 0.5)), float(rng.uniform(0.5, 1)))
        cover = float(rng.choice([0.1, 0.0, 0.5, 1.0, 0.7]))  # float32(0.7) < 0.7
        yield height, width, boxes, cover, aspect, area, 100 if trial % 5 else int(rng.integers(1, 5))


def test_the_loaders_one_kernel_search_is_the_python_search():
    """A loader's generator (SampleGenerator, its PCG64 state mapped) takes the numba search; a plain
    Generator the Python loop above it: the same crop, and the generator left in the same state."""
    generator, whole = SampleGenerator(), 0
    for trial, (height, width, boxes, *rest) in enumerate(_search_cases(3000)):
        ours, reference = generator.seeded((trial, 1, 2)), np.random.default_rng([trial, 1, 2])
        crop = sample_distorted_bounding_box(ours, height, width, boxes, *rest)
        assert crop == sample_distorted_bounding_box(reference, height, width, boxes, *rest), trial
        assert ours.bit_generator.state == reference.bit_generator.state, trial
        whole += crop == (0, 0, height, width)
    assert 300 < whole < 2700  # both outcomes, many times


def test_a_box_that_is_not_finite_leaves_the_kernel_search_unused():
    boxes = np.array([[0.1, 0.1, np.nan, 0.9]], np.float32)
    ours = SampleGenerator().seeded((1, 2, 3))
    with np.errstate(invalid="ignore"):  # the Python path casts NaN to int32 (decode_record refuses it)
        crop = sample_distorted_bounding_box(ours, 50, 60, boxes)
        assert crop == sample_distorted_bounding_box(np.random.default_rng([1, 2, 3]), 50, 60, boxes)


# --- train and eval transforms ---------------------------------------------------------------------


def _two_colour_image(height, width, split_x):
    img = np.zeros((height, width, 3), np.uint8)
    img[:, :split_x] = (255, 0, 0)
    img[:, split_x:] = (0, 0, 255)
    return img


@pytest.mark.parametrize("height, width", [(300, 400), (400, 300), (332, 500)])
def test_eval_geometry_resnet(height, width):
    # Short side to 256 with TF's float32 scale and truncation (332 x 500 -> 255 x 385), central 224
    # crop: an edge at x = split lands at column split * new_w / width - (new_w - 224) // 2.
    split = width // 2
    out = eval_transform(_encode(_two_colour_image(height, width, split), "JPEG", quality=100), 224, "resnet")
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8
    ratio = np.float32(256) / np.float32(min(height, width))
    new_h, new_w = int(np.float32(height) * ratio), int(np.float32(width) * ratio)
    assert resnet_resize_size(height, width, 224) == (new_h, new_w)
    if (height, width) == (332, 500):
        assert (new_h, new_w) == (255, 385)  # round() would give 256 x 386
    edge = split * new_w / width - (new_w - 224) // 2
    red = out[112, :, 0].astype(int)
    assert np.all(red[: int(edge) - 2] > 245) and np.all(red[int(edge) + 3 :] < 10)


def test_eval_geometry_inception_central_crop():
    # central_crop(0.875) of 400 columns keeps [25, 375); an edge at x = 100 lands at (100 - 25) * 299 / 350.
    out = eval_transform(_encode(_two_colour_image(300, 400, 100), "JPEG", quality=100), 299, "inception")
    assert out.shape == (299, 299, 3)
    edge = (100 - 25) * 299 / 350
    red = out[150, :, 0].astype(int)
    assert np.all(red[: int(edge) - 2] > 245) and np.all(red[int(edge) + 3 :] < 10)
    assert inception_central_crop(300, 400) == (18, 25, 264, 350)


def test_resnet_eval_window_equals_resize_then_crop():
    # eval_transform computes only the central window of the aspect-preserving resize.
    rng = np.random.default_rng(3)
    smooth = np.kron(rng.integers(0, 256, (9, 12, 3)), np.ones((25, 25, 1))).astype(np.uint8)  # 225 x 300
    jpeg = _encode(smooth, "JPEG")
    new_h, new_w = resnet_resize_size(225, 300, 128)
    full = resize(decode_jpeg(jpeg), np.empty((new_h, new_w, 3), np.float32), "bilinear")
    top, left = (new_h - 128) // 2, (new_w - 128) // 2
    reference = np.floor(full[top : top + 128, left : left + 128] + 0.5).astype(np.uint8)
    np.testing.assert_array_equal(eval_transform(jpeg, 128, "resnet"), reference)


def test_train_transform_is_a_function_of_the_rng():
    img = np.random.default_rng(4).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    jpeg = _encode(img, "JPEG")
    outs = [
        train_transform(jpeg, np.zeros((0, 4)), np.random.default_rng(s), 32, "inception", True)
        for s in range(8)
    ]
    assert all(o.shape == (32, 32, 3) and o.dtype == np.uint8 for o in outs)
    again = train_transform(jpeg, np.zeros((0, 4)), np.random.default_rng(3), 32, "inception", True)
    np.testing.assert_array_equal(outs[3], again)
    assert len({o.tobytes() for o in outs}) == 8


def test_flip_probability_one_half():
    gradient = np.tile(np.arange(64, dtype=np.uint8)[None, :, None] * 4, (64, 1, 3))
    jpeg = _encode(gradient)
    rng = np.random.default_rng(6)
    flipped = [
        train_transform(jpeg, np.zeros((0, 4)), rng, 16)[:, :, 0].astype(int).mean(0) for _ in range(400)
    ]
    share = np.mean([row[0] > row[-1] for row in flipped])
    assert 0.4 < share < 0.6


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grayscale_and_cmyk_jpegs_decode_to_rgb(mode):
    colour = np.zeros((40, 48, 3), np.uint8)
    colour[...] = (200, 120, 40)
    jpeg = _encode(colour, "JPEG", mode=mode)
    assert Image.open(io.BytesIO(jpeg)).mode == mode
    out = eval_transform(jpeg, 32, "inception")
    assert out.shape == (32, 32, 3)
    if mode == "L":
        grey = 0.299 * 200 + 0.587 * 120 + 0.114 * 40  # ITU-R 601 luma, what convert("L") computes
        assert np.all(np.abs(out.astype(float) - grey) < 3)
    else:
        assert np.all(np.abs(out.reshape(-1, 3).astype(int) - (200, 120, 40)) < 8)
    train = train_transform(jpeg, np.zeros((0, 4)), np.random.default_rng(0), 32)
    assert train.shape == (32, 32, 3)


def test_undecodable_jpeg_names_file_and_offset():
    jpeg = _encode(np.zeros((64, 64, 3), np.uint8), "JPEG")
    for bad in (b"not a jpeg", jpeg[: len(jpeg) // 2]):
        with pytest.raises(DataError, match="undecodable JPEG in record at offset 77 in shard-x"):
            train_transform(bad, np.zeros((0, 4)), np.random.default_rng(0), 32, file="shard-x", offset=77)
        with pytest.raises(DataError, match="offset 77 in shard-x"):
            eval_transform(bad, 32, file="shard-x", offset=77)


# --- colour distortion -----------------------------------------------------------------------------


def test_hue_shift_of_a_third_rotates_the_channels():
    rgb = np.random.default_rng(8).random((10, 10, 3)).astype(np.float32)
    out = distort_color(rgb.copy(), ColorParams(0, 0.0, 1.0, 1 / 3, 1.0))
    np.testing.assert_allclose(out, rgb[..., [2, 0, 1]], atol=1e-6)


def test_distort_color_on_grey_is_only_brightness():
    # A uniform grey image has zero saturation (hue and saturation do nothing) and equals its channel
    # means (contrast does nothing): only the brightness shift remains, then the clip to [0, 1].
    rng = np.random.default_rng(0)
    for _ in range(50):
        params = sample_color(rng)
        grey = np.full((8, 8, 3), 0.5, np.float32)
        out = distort_color(grey, params)
        np.testing.assert_allclose(out, np.float32(0.5) + np.float32(params.brightness), atol=1e-6)
    bright = distort_color(np.full((2, 2, 3), 0.99, np.float32), ColorParams(1, 0.1, 1.0, 0.0, 1.0))
    assert np.all(bright == 1.0)


def test_sampled_colour_parameters_cover_the_seed_ranges():
    draws = [sample_color(np.random.default_rng(s)) for s in range(400)]
    for name, lo, hi in [("brightness", -32 / 255, 32 / 255), ("saturation", 0.5, 1.5), ("hue", -0.2, 0.2)]:
        values = np.array([getattr(d, name) for d in draws])
        assert values.min() >= lo - 1e-7 and values.max() <= hi + 1e-7
        assert values.min() < lo + 0.05 * (hi - lo) and values.max() > hi - 0.05 * (hi - lo)
    assert 0.4 < np.mean([d.ordering for d in draws]) < 0.6


# --- normalisation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("preprocess", ["inception", "resnet"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_normalize_matches_float64_reference(preprocess, dtype):
    images = torch.randint(0, 256, (3, 5, 7, 3), dtype=torch.uint8)
    x = images.double().permute(0, 3, 1, 2)
    if preprocess == "inception":
        reference = x / 127.5 - 1
    else:
        reference = x - torch.tensor([123.68, 116.78, 103.94], dtype=torch.float64).view(1, 3, 1, 1)
    out = normalize_images(images, preprocess, dtype)
    assert out.shape == (3, 3, 5, 7) and out.dtype == dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert out.data_ptr() != images.data_ptr()
    # One rounding to `dtype` (half an ulp: rtol), after float32 arithmetic whose operands are at most
    # 256 (resnet: the means themselves round to float32) or 2 (inception) in magnitude: atol.
    eps = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    atol = 2**-24 * (256 if preprocess == "resnet" else 2)
    torch.testing.assert_close(out.double(), reference, rtol=eps, atol=atol)
    assert normalize_images(images, preprocess, dtype, channels_last=False).is_contiguous()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_normalize_on_cuda_keeps_channels_last():
    images = torch.randint(0, 256, (4, 8, 8, 3), dtype=torch.uint8, device="cuda")
    out = normalize_images(images, "resnet", torch.bfloat16)
    assert out.device.type == "cuda" and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.cpu(), normalize_images(images.cpu(), "resnet", torch.bfloat16))


def test_vectorised_colour_steps_equal_the_tf_transcriptions_bit_for_bit():
    # _distort runs branch-free forms of TF's AdjustSaturation / AdjustHue pixel code; the readable
    # transcriptions (_saturate, _shift_hue) are the specification. Ties (r == g, grey, black) take
    # TF's particular branches, and values outside [0, 1] occur after brightness and contrast.
    rng = np.random.default_rng(9)
    pixels = np.concatenate(
        [
            rng.uniform(-0.2, 1.2, (200_000, 3)),
            rng.integers(0, 8, (100_000, 3)) / 7,  # many exact ties
            [[0, 0, 0], [1, 1, 1], [0.5, 0.5, 0.2], [0.2, 0.5, 0.5], [0.5, 0.2, 0.5], [-1e-9, 0, 1e-9]],
        ]
    ).astype(np.float32)
    for factor, delta in [(0.5, -0.2), (1.37, 0.13), (1.5, 0.2), (1.0, -1e-4)]:
        mismatches = _count_mismatches(pixels, np.float32(factor), np.float32(delta))
        assert mismatches == (0, 0)


@numba.njit
def _count_mismatches(pixels, factor, delta):
    saturation = hue = 0
    for i in range(pixels.shape[0]):
        r, g, b = pixels[i, 0], pixels[i, 1], pixels[i, 2]
        if _saturate(r, g, b, factor) != _saturate_select(r, g, b, factor):
            saturation += 1
        if _shift_hue(r, g, b, delta) != _shift_hue_select(r, g, b, delta * np.float32(6)):
            hue += 1
    return saturation, hue


TF_IMAGES = Path(__file__).parent / "data" / "tf-images"


@pytest.mark.parametrize("name", sorted(p.name for p in TF_IMAGES.glob("*.jpg")))
def test_full_window_decode_equals_the_whole_images_decode(name):
    """The Inception train path decodes only its crop; its pixels must be the whole decode's (which
    tests/test_transforms_tf.py holds equal to TensorFlow's decode_jpeg), edges and every JPEG kind, with
    and without the JPEG's row checkpoints."""
    from fasttrain.data.jpeg.doctor import decode_full_window_rows
    from fasttrain.data.jpeg.scan import row_checkpoints

    jpeg = (TF_IMAGES / name).read_bytes()
    full = decode_jpeg(jpeg)
    height, width = full.shape[:2]
    rng = np.random.default_rng(0)
    windows = [(0, 0, height, width), (0, 0, 1, 1), (height - 1, width - 1, 1, 1), (7, 15, 9, 17)]
    windows += [(0, 1, height, width - 2), (1, 0, height - 2, width), (16, 16, 16, 16), (17, 33, 31, 47)]
    for _ in range(40):
        h, w = int(rng.integers(1, height + 1)), int(rng.integers(1, width + 1))
        windows.append((int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w))
    for checkpoints in (None, row_checkpoints(jpeg)):
        for top, left, h, w in windows:
            if not (0 <= top and 0 <= left and 0 < h and 0 < w and top + h <= height and left + w <= width):
                continue  # a fixed window that does not fit a small image
            rows, x = decode_full_window_rows(jpeg, checkpoints, (top, left, h, w), width)
            got = rows.reshape(h, -1, 3)[:, left - x : left - x + w]
            want = full[top : top + h, left : left + w]
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {(top, left, h, w)}")
