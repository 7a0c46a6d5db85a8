"""The pieces of the DALI graph in fasttrain/data/dali_ops.py that test_dali_pipeline.py and
test_dali_graph.py do not reach (DALI's CPU-only mode): the train crop window of tiny images, and
records without box keys.

The eval crop and resize are held to TensorFlow's own outputs in test_transforms_tf.py and to the torch
transforms in test_dali_graph.py; the ResNet seed's vgg geometry in test_vgg_dali.py.
"""

import io

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed")

from fasttrain.config import make_config  # noqa: E402
from fasttrain.data.dali_pipeline import DaliLoader  # noqa: E402
from fasttrain.data.errors import DataError  # noqa: E402
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


def _photo_shards(directory, with_box_keys: list[bool]) -> None:
    """One train shard per entry, 8 records each (distinct sizes), with the four box keys as empty lists
    (as build_imagenet_data.py writes an image without boxes) or without them (other converters)."""
    boxes = {f"image/object/bbox/{k}": (float, []) for k in ("ymin", "xmin", "ymax", "xmax")}
    for i, keys in enumerate(with_box_keys):
        records = [
            encode_example(
                {
                    "image/encoded": _tiny_jpeg(40 + j, 30 + i),
                    "image/class/label": 1,
                    **(boxes if keys else {}),
                }
            )
            for j in range(8)
        ]
        shard = directory / f"train-{i:05d}-of-{len(with_box_keys):05d}"
        write_index_file(shard.with_name(shard.name + ".idx"), write_records(shard, records))


@pytest.mark.parametrize("preprocess", ["inception", "resnet"])
def test_records_without_box_keys_train_on_the_whole_image_box(tmp_path, preprocess):
    """DALI's reader does not give a missing VarLenFeature its default: the boxes were whatever its buffer
    held ('box ... is out of bounds', reported as an undecodable record, or a crop to garbage inside the
    image). Records without the keys now train exactly as the same records with empty box lists."""
    batches = {}
    for keys in (True, False):
        directory = tmp_path / f"keys-{keys}"
        directory.mkdir()
        _photo_shards(directory, [keys, keys])
        cfg = make_config(
            data_dir=str(directory), batch_size=8, image_size=16, preprocess=preprocess, num_classes=2,
            label_offset=0, num_workers=1, seed=3, data_cache_dir=str(directory / "cache"),
        )  # fmt: skip
        loader = DaliLoader(cfg, "train", True)
        assert loader.box_keys is keys
        batches[keys] = [images for epoch in range(2) for images, _ in (loader.set_epoch(epoch) or loader)]
    assert len(batches[True]) == 4
    for with_keys, without in zip(batches[True], batches[False]):
        assert torch.equal(with_keys, without)


def test_shards_with_and_without_box_keys_are_one_error(tmp_path):
    _photo_shards(tmp_path, [True, False])
    cfg = make_config(
        data_dir=str(tmp_path), batch_size=8, image_size=16, preprocess="inception", num_classes=2,
        label_offset=0, num_workers=1, data_cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    with pytest.raises(
        DataError, match=r"train-00001-of-00002 have no image/object/bbox keys and those of .*train-00000"
    ):
        DaliLoader(cfg, "train", True)
