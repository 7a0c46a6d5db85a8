"""The DALI graph (fasttrain/data/dali_graph.py) in DALI's CPU-only mode (device_id=None): eval images
with TensorFlow's geometry, training batches NHWC float in the recipe's range, the colour distortion the
Inception recipe's only, and train crop windows within the recipe's ranges.

References are independent of fasttrain.data.dali_graph: records come from the TFRecord reader, eval
pixels from the transforms of the torch pipeline (fasttrain.data.transforms) on DALI's own decode and
normalize_images. The data set and its helpers are test_dali_pipeline.py's.
"""

import io

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed")

from nvidia.dali import fn, pipeline_def, types  # noqa: E402
from test_dali_pipeline import EXTREME, _cfg, _labels, _reference_records, write_dataset  # noqa: E402

from fasttrain.data.dali_pipeline import DaliLoader  # noqa: E402
from fasttrain.data.normalize import normalize_images  # noqa: E402
from fasttrain.data.transforms import apply_eval  # noqa: E402


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("dali-data"))


def _dali_decoded(jpegs: list[bytes]) -> list[np.ndarray]:
    """DALI's own CPU decode of each JPEG (libjpeg-turbo's accurate IDCT: about 1 level from TF's)."""

    @pipeline_def(batch_size=len(jpegs), num_threads=1, device_id=None)
    def decode():
        encoded = fn.external_source(source=lambda: [np.frombuffer(j, np.uint8) for j in jpegs], batch=True)
        return fn.decoders.image(encoded, device="cpu", output_type=types.RGB)

    pipe = decode()
    pipe.build()
    (images,) = pipe.run()
    return [np.array(images[i]) for i in range(len(jpegs))]


@pytest.mark.parametrize("preprocess,size", [("inception", 40), ("resnet", 32)])
def test_eval_batches_have_tensorflows_geometry(data_dir, preprocess, size):
    # DALI's eval resize (a shifted ROI, no antialiasing) against TF1's eval transform
    # (fasttrain.data.transforms.apply_eval) applied to DALI's own decode: only rounding may differ.
    cfg = _cfg(data_dir, preprocess=preprocess, image_size=size)
    loader = DaliLoader(cfg, "validation", training=False)
    batches = list(loader)
    records = _reference_records(data_dir, "validation")
    assert loader.normalized and loader.num_records == len(records) == 23 and len(loader) == len(batches) == 3
    assert [len(labels) for _, labels in batches] == [8, 8, 7]
    images = torch.cat([x for x, _ in batches])
    assert images.dtype == torch.float32 and images.shape == (23, size, size, 3) and images.is_contiguous()
    assert torch.cat([y for _, y in batches]).dtype == torch.int64
    assert _labels(batches) == [r.label for r in records]
    decoded = _dali_decoded([r.jpeg for r in records])
    reference = np.stack([apply_eval(image, size, preprocess) for image in decoded])
    reference = normalize_images(torch.from_numpy(reference), preprocess).permute(0, 2, 3, 1)  # NHWC
    levels = (images - reference).abs() * (127.5 if preprocess == "inception" else 1.0)
    # Both round to uint8: one level where they round a value near .5 differently, nothing more
    # (measured: 23 images, mean 0.02 levels for inception, 0.0002 for resnet). A wrong geometry (no ROI
    # shift, or rounding instead of TF's truncated size) gives several levels on average; taps beyond
    # Inception's central crop where it is upscaled (most of these 24-96 px images at 40), up to 6
    # levels at the crop's last rows and columns.
    assert float(levels.mean()) < 0.15 and float(levels.max()) <= 1.0 + 1e-3


@pytest.mark.parametrize("preprocess,color", [("inception", True), ("resnet", False)])
def test_training_batches_are_nhwc_float_in_range(data_dir, preprocess, color):
    cfg = _cfg(data_dir, preprocess=preprocess, color_distort=color)
    images, labels = next(iter(DaliLoader(cfg, "train", True)))
    assert images.shape == (8, 32, 32, 3) and images.dtype == torch.float32 and images.is_contiguous()
    assert (
        labels.shape == (8,) and labels.dtype == torch.int64 and bool(((labels >= 0) & (labels < 69)).all())
    )
    if preprocess == "inception":
        assert float(images.min()) >= -1.0 and float(images.max()) <= 1.0
    else:
        means = torch.tensor([123.68, 116.78, 103.94])
        assert bool((images >= -means).all()) and bool((images <= 255 - means).all())
    half, _ = next(iter(DaliLoader(cfg, "train", True, dtype=torch.float16)))
    assert half.dtype == torch.float16 and half.shape == images.shape


def test_color_distort_is_inception_preprocessing_s_only_as_in_the_torch_backend(data_dir):
    # The torch backend distorts colour for preprocess inception only; DALI distorted resnet's images
    # too, so the same flags trained other images by backend.
    plain, colour = (
        next(iter(DaliLoader(_cfg(data_dir, preprocess="resnet", color_distort=c), "train", True)))[0]
        for c in (False, True)
    )
    assert torch.equal(plain, colour)


def test_train_crop_windows_are_within_the_recipe_ranges(data_dir):
    cfg = _cfg(data_dir)
    loader = DaliLoader(cfg, "train", True)
    records = {r.label: r for r in _reference_records(data_dir, "train")}
    windows = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        positions = loader.epoch_positions()
        pipe = loader._build_pipeline(positions, 0, crop_outputs=True)
        for _ in range(len(loader)):
            _, labels, anchor, extent, image = (np.array(out.as_tensor()) for out in pipe.run())
            windows += zip(labels.tolist(), anchor, extent, image)
    areas, aspects = [], []
    for label, (x, y), (w, h), (width, height) in windows:
        record = records[label]
        assert record.jpeg and (width, height) == Image.open(io.BytesIO(record.jpeg)).size
        assert x >= 0 and y >= 0 and x + w <= 1 + 1e-6 and y + h <= 1 + 1e-6
        if (width, height) == EXTREME:  # TF's fallback: the whole image
            assert (x, y, w, h) == (0, 0, 1, 1)
            continue
        areas.append(w * h)
        aspects.append(w * width / (h * height))  # in pixels, as TF's aspect_ratio_range
        boxes = record.boxes if len(record.boxes) else np.array([[0, 0, 1, 1]], np.float32)
        ih = np.clip(np.minimum(y + h, boxes[:, 2]) - np.maximum(y, boxes[:, 0]), 0, None)
        iw = np.clip(np.minimum(x + w, boxes[:, 3]) - np.maximum(x, boxes[:, 1]), 0, None)
        covered = ih * iw / ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))
        assert covered.max() >= 0.1 - 1e-4  # min_object_covered of some box
    areas, aspects = np.array(areas), np.array(aspects)
    assert len(areas) > 150
    assert areas.min() >= 0.05 - 1e-4 and areas.max() <= 1.0 + 1e-4
    assert aspects.min() >= 0.75 - 1e-3 and aspects.max() <= 1.33 + 1e-3
    # The windows spread over the ranges rather than sitting at one end.
    assert areas.min() < 0.2 and areas.max() > 0.7 and aspects.min() < 0.85 and aspects.max() > 1.2
