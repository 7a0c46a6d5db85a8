"""The DALI backend's vgg preprocessing (DALI's CPU-only mode) against TensorFlow's.

Run with -s to see the per-kind table the README quotes.

Eval: against TensorFlow's own outputs for the seed's eval (tests/data/tf-vgg/, made by
tests/data/make_tf_vgg.py), per JPEG kind. Train: DALI draws its own side, offsets and flip; the pipeline
also outputs them, and the reference is fasttrain.data.vgg.full_float for those draws, the seed's steps on
the whole image, which equals TensorFlow's within rounding on every fixture case
(tests/test_vgg_preprocessing.py). The geometry is TF's (the sampling points of TF1's resize_bilinear,
no antialiasing); the decoder is not: DALI's libjpeg-turbo uses the accurate integer IDCT where TF uses
the fast one (about 1 level on average; the ResNet and Inception eval settings measure the same,
tests/test_transforms_tf.py). The bounds below are those measured figures with a margin.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed")

from fasttrain.config import make_config  # noqa: E402
from fasttrain.data import vgg  # noqa: E402
from fasttrain.data.dali_pipeline import DaliLoader  # noqa: E402
from fasttrain.data.jpeg.decode import decode_jpeg  # noqa: E402
from fasttrain.data.normalize import RESNET_CHANNEL_MEANS  # noqa: E402
from fasttrain.data.synthetic import converter_example  # noqa: E402
from fasttrain.data.tfrecord import write_index_file, write_records  # noqa: E402

FIXTURE = Path(__file__).parent / "data" / "tf-vgg"
IMAGES = Path(__file__).parent / "data" / "tf-images"
FIXED = json.loads((FIXTURE / "cases.json").read_text())
LATTICE = np.array(FIXED["lattice"])
FILES = list(dict.fromkeys(case["file"] for case in FIXED["cases"]))
KIND = {case["file"]: case["kind"] for case in FIXED["cases"]}
MEANS = torch.tensor(RESNET_CHANNEL_MEANS)


def _write(root: Path, split: str) -> Path:
    records = []
    for label, file in enumerate(FILES, start=1):
        data = (IMAGES / file).read_bytes()
        height, width = decode_jpeg(data).shape[:2]
        records.append(converter_example(data, height, width, label, "n0", "x", file, []))
    shard = root / f"{split}-00000-of-00001"
    write_index_file(shard.with_name(shard.name + ".idx"), write_records(shard, records))
    return root


def _cfg(root: Path, size: int):
    return make_config(
        data_dir=str(root), batch_size=len(FILES), image_size=size, preprocess="vgg", num_classes=len(FILES),
        label_offset=-1, num_workers=1, data_cache_dir=str(root / "cache"),
    )  # fmt: skip


def _levels(images: torch.Tensor) -> np.ndarray:
    """DALI's normalised (N, S, S, 3) float output back on the 0..255 scale of TF's references."""
    return (images * 255 + MEANS).numpy()


def _report(title: str, diffs: dict) -> None:
    print(f"\nDALI (CPU) vs TensorFlow, {title}: per kind mean / max |diff| in levels")
    for file, d in diffs.items():
        print(f"  {KIND[file]:22s} {d.mean():5.2f} / {d.max():5.1f}")


@pytest.mark.parametrize("size", [224, 56])
def test_dali_vgg_eval_against_tensorflow(tmp_path, size):
    with np.load(FIXTURE / "reference.npz") as npz:
        reference = {key: npz[key].astype(np.float32) for key in npz.files}
    ((images, labels),) = list(DaliLoader(_cfg(_write(tmp_path, "validation"), size), "validation", False))
    assert labels.tolist() == list(range(len(FILES)))
    ours = _levels(images)
    cases = {c["file"]: c for c in FIXED["cases"] if c["mode"] == "eval" and c["image_size"] == size}
    diffs = {}
    for i, file in enumerate(FILES):
        got = ours[i][LATTICE][:, LATTICE] if size == 224 else ours[i]
        diffs[file] = np.abs(got - reference[cases[file]["key"]])
    _report(f"eval {size}", diffs)
    assert np.mean([d.mean() for d in diffs.values()]) < 1.5
    assert all(d.mean() < 3 for d in diffs.values())


def test_dali_vgg_train_draws_and_pixels(tmp_path):
    """The seed's ranges for the draws, and for the drawn geometry the seed's image (all but decoding)."""
    loader = DaliLoader(_cfg(_write(tmp_path, "train"), 224), "train", True)
    pipe = loader._build_pipeline(np.arange(len(FILES)), 0, crop_outputs=True)
    images, _, params = pipe.run()
    images = _levels(torch.from_dlpack(images.as_tensor()))
    params = np.array(params.as_tensor())  # (N, 4): side, top, left, flip
    diffs = {}
    for i, file in enumerate(FILES):
        side, top, left, flip = (int(v) for v in params[i])
        drawn = vgg.VggParams(side, top, left, bool(flip))
        image = decode_jpeg((IMAGES / file).read_bytes())
        new_h, new_w = vgg.smallest_size_at_least(*image.shape[:2], side)
        assert 256 <= side <= 512 and 0 <= top <= new_h - 224 and 0 <= left <= new_w - 224, params[i]
        diffs[file] = np.abs(images[i] - vgg.full_float(image, drawn, 224) * 255)
        if KIND[file] != "cmyk":  # DALI converts CMYK its own way
            # The geometry alone: the seed's steps on Pillow's decode (libjpeg-turbo's accurate IDCT,
            # DALI's decoder) leave only DALI's rounding to uint8 (0.5) and float noise (measured 0.0016).
            pillow = np.asarray(Image.open(IMAGES / file).convert("RGB"))
            exact = np.abs(images[i] - vgg.full_float(pillow, drawn, 224) * 255)
            assert exact.max() <= 0.5 + 0.01, (file, exact.max())
    _report("train 224 (for DALI's draws)", diffs)
    assert np.mean([d.mean() for d in diffs.values()]) < 1.5
    assert all(d.mean() < 3 for d in diffs.values())
