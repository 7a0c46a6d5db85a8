"""The pieces of the DALI graph in fasttrain/data/dali_ops.py that test_dali_pipeline.py does not reach
(DALI's CPU-only mode): the train crop window of tiny images.

The eval crop and resize are held to TensorFlow's own outputs in test_transforms_tf.py and to the torch
transforms in test_dali_pipeline.py; the ResNet seed's vgg geometry in test_vgg_dali.py.
"""

import io

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed")

from fasttrain.config import make_config  # noqa: E402
from fasttrain.data.dali_pipeline import DaliLoader  # noqa: E402
from fasttrain.data.example import encode_example  # noqa: E402
from fasttrain.data.tfrecord import write_index_file, write_records  # noqa: E402


def _tiny_jpeg(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(width * 10 + height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


@pytest.mark.parametrize("width, height", [(1, 1), (3, 2)])
@pytest.mark.parametrize("preprocess", ["inception", "resnet"])
def test_training_on_tiny_jpegs_takes_at_least_a_pixel_a_side(tmp_path, width, height, preprocess):
    """Valid JPEGs of 1x1 and 3x2 pixels train as TF trains them (sample_distorted_bounding_box draws a
    window of at least one pixel a side). random_bbox_crop's side fractions (at least sqrt(0.05) = 0.22),
    rounded to pixels by DALI, could give a window of no pixel: "Invalid crop window", reported as an
    undecodable record, in the first epoch here for both files and both recipes."""
    boxes = {f"image/object/bbox/{k}": (float, []) for k in ("ymin", "xmin", "ymax", "xmax")}  # none
    records = [encode_example({"image/encoded": _tiny_jpeg(width, height), "image/class/label": 1, **boxes})]
    records *= 16
    shard = tmp_path / "train-00000-of-00001"
    write_index_file(shard.with_name(shard.name + ".idx"), write_records(shard, records))
    cfg = make_config(
        data_dir=str(tmp_path), batch_size=8, image_size=16, preprocess=preprocess, num_classes=2,
        label_offset=0, num_workers=1, seed=3, data_cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    loader = DaliLoader(cfg, "train", True)
    for epoch in range(4):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == 2 and all(images.shape == (8, 16, 16, 3) for images, _ in batches)
        if (width, height) == (1, 1) and preprocess == "resnet":  # no colour: one pixel, one colour
            for images, _ in batches:
                flat = images.reshape(8, -1, 3)
                assert bool((flat == flat[:, :1]).all())
