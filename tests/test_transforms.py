"""The seeds' crop sampler, train/eval transforms, colour distortion, JPEG modes, and normalisation."""

import colorsys
import io

import numpy as np
import pytest
import torch
from PIL import Image

from fasttrain.data import DataError
from fasttrain.data.color import _saturation_hue, distort_color, hsv_to_rgb, rgb_to_hsv
from fasttrain.data.normalize import normalize_images
from fasttrain.data.transforms import eval_transform, sample_distorted_bounding_box, train_transform


def _encode(array: np.ndarray, fmt="PNG", mode=None, quality=95) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(array)
    if mode:
        img = img.convert(mode)
    img.save(buf, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
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


# --- train and eval transforms ---------------------------------------------------------------------


def _two_colour_image(height, width, split_x):
    img = np.zeros((height, width, 3), np.uint8)
    img[:, :split_x] = (255, 0, 0)
    img[:, split_x:] = (0, 0, 255)
    return img


@pytest.mark.parametrize("height, width", [(300, 400), (400, 300)])
def test_eval_geometry_resnet(height, width):
    # Short side to 256, central 224 crop: an edge at x = width / 2 lands at column
    # (width / 2) * (new_w / width) - (new_w - 224) // 2, computed here from the definition.
    split = width // 2
    out = eval_transform(_encode(_two_colour_image(height, width, split)), 224, "resnet")
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8
    new_w = 256 if width < height else round(width * 256 / height)
    edge = split * new_w / width - (new_w - 224) // 2
    red = out[112, :, 0].astype(int)
    assert np.all(red[: int(edge) - 2] > 250) and np.all(red[int(edge) + 3 :] < 5)


def test_eval_geometry_inception_central_crop():
    # central_crop(0.875) of 400 columns keeps [25, 375); an edge at x = 100 lands at (100 - 25) * 299 / 350.
    out = eval_transform(_encode(_two_colour_image(300, 400, 100)), 299, "inception")
    assert out.shape == (299, 299, 3)
    edge = (100 - 25) * 299 / 350
    red = out[150, :, 0].astype(int)
    assert np.all(red[: int(edge) - 2] > 250) and np.all(red[int(edge) + 3 :] < 5)


def test_eval_equals_resize_then_crop():
    rng = np.random.default_rng(3)
    smooth = np.kron(rng.integers(0, 256, (9, 12, 3)), np.ones((25, 25, 1))).astype(np.uint8)  # 225 x 300
    png = _encode(smooth)
    resized = np.asarray(Image.open(io.BytesIO(png)).resize((round(300 * 146 / 225), 146), Image.BILINEAR))
    top, left = (146 - 128) // 2, (resized.shape[1] - 128) // 2
    reference = resized[top : top + 128, left : left + 128].astype(int)
    # One rounding of the (fractional) source box against two separate resamplings: 1 level allowed.
    assert np.abs(eval_transform(png, 128, "resnet").astype(int) - reference).max() <= 1


def test_draft_decoding_keeps_the_geometry():
    # libjpeg's reduced-size decode of a large smooth image: same content as the full decode.
    yy, xx = np.mgrid[0:600, 0:800]
    img = np.stack([xx * 255 // 800, yy * 255 // 600, (xx + yy) * 255 // 1400], -1).astype(np.uint8)
    jpeg = _encode(img, "JPEG")
    fast, full = eval_transform(jpeg, 64, "resnet"), eval_transform(jpeg, 64, "resnet", draft=False)
    assert np.abs(fast.astype(int) - full.astype(int)).mean() < 1.5
    a = train_transform(jpeg, np.zeros((0, 4)), np.random.default_rng(5), 64)
    b = train_transform(jpeg, np.zeros((0, 4)), np.random.default_rng(5), 64, draft=False)
    assert np.abs(a.astype(int) - b.astype(int)).mean() < 1.5


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


def test_hsv_matches_colorsys():
    rgb = np.random.default_rng(7).random((300, 3)).astype(np.float32)
    rgb[:3] = [[0.5, 0.5, 0.5], [0, 0, 0], [1, 0, 0]]
    hsv = rgb_to_hsv(rgb)
    reference = np.array([colorsys.rgb_to_hsv(*map(float, p)) for p in rgb])
    np.testing.assert_allclose(hsv, reference, atol=1e-6)  # float32 arithmetic, values in [0, 1]
    back = np.array([colorsys.hsv_to_rgb(*map(float, p)) for p in reference])
    np.testing.assert_allclose(hsv_to_rgb(hsv), back, atol=1e-6)


def test_hue_shift_of_a_third_rotates_the_channels():
    rgb = np.random.default_rng(8).random((10, 10, 3)).astype(np.float32)
    np.testing.assert_allclose(_saturation_hue(rgb, 1.0, 1 / 3), rgb[..., [2, 0, 1]], atol=1e-5)


def test_distort_color_on_grey_is_only_brightness():
    # A uniform grey image has zero saturation (hue and saturation do nothing) and equals its channel
    # means (contrast does nothing): only the brightness shift of at most 32 levels remains.
    grey = np.full((8, 8, 3), 128, np.uint8)
    outs = np.stack([distort_color(grey, np.random.default_rng(s)) for s in range(100)]).astype(int)
    assert np.all(outs == outs[:, :1, :1, :1])
    assert np.abs(outs - 128).max() <= 32 and np.abs(outs - 128).max() > 25


def test_distort_color_varies_colour():
    img = np.full((20, 20, 3), 128, np.uint8)
    img[:10] = (250, 20, 20)
    outs = [distort_color(img, np.random.default_rng(s)) for s in range(50)]
    assert all(o.dtype == np.uint8 and o.shape == img.shape for o in outs)
    assert len({o.tobytes() for o in outs}) == 50
    hues = [rgb_to_hsv(o[2, 2].astype(np.float32) / 255)[0] for o in outs]
    assert max(abs((h + 0.5) % 1 - 0.5) for h in hues) > 0.1  # red's hue moved by the random hue shift


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
