"""A synthetic ImageNet: TFRecord shards laid out and typed exactly as build_imagenet_data.py writes them.

Class c (0-based; stored label c + 1) has a fixed pair of colours of hue c / classes, a stripe
orientation and a stripe period; every image is filled with its class's stripes at a random phase plus
Gaussian noise (sigma 16 of 255) and a random brightness gain, so the class survives any crop (the
train crop keeps as little as 5% of the area), flips and a resize to 64 px: a small CNN learns it from
colour alone within a few hundred steps. Images are 48..160 px on each side independently (aspect
ratios 0.3..3.3), encoded as RGB JPEG (quality 90); each carries 0..3 random boxes. Shards are written
under a temporary name and renamed when complete, with their DALI index files beside them. A directory
that already holds shards is refused (DataError): a second set written over part of the first would
leave one directory mixing two sets, or two set sizes.

`ensure_synthetic` builds a set once per directory even when several processes ask at once (two first
demo runs sharing a cache): one builds under a file lock, the others wait for it and use its set.
"""

from __future__ import annotations

import colorsys
import fcntl
import io
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from fasttrain.data.errors import DataError
from fasttrain.data.example import encode_example
from fasttrain.data.imagenet import SPLITS, find_shards
from fasttrain.data.tfrecord import write_index_file, write_records

MIN_SIDE, MAX_SIDE = 48, 160


def _class_styles(classes: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, float, float]]:
    rng = np.random.default_rng([seed, 0xC1A55])
    styles = []
    for c in range(classes):
        hue = c / classes
        bright = np.array(colorsys.hsv_to_rgb(hue, 0.85, 0.95), dtype=np.float32) * 255
        dark = np.array(colorsys.hsv_to_rgb(hue, 0.9, 0.45), dtype=np.float32) * 255
        angle = float(rng.uniform(0, np.pi))
        period = float(rng.uniform(6, 20))  # pixels
        styles.append((bright, dark, angle, period))
    return styles


def _image(rng: np.random.Generator, style, height: int, width: int) -> np.ndarray:
    """(height, width, 3) uint8 image of the class style."""
    bright, dark, angle, period = style
    yy = np.arange(height, dtype=np.float32)[:, None]
    xx = np.arange(width, dtype=np.float32)[None, :]
    phase = (xx * np.cos(angle) + yy * np.sin(angle)) * np.float32(2 * np.pi / period) + rng.uniform(
        0, 2 * np.pi
    )
    mix = (0.5 + 0.5 * np.sin(phase))[:, :, None]  # (H, W, 1)
    img = dark + mix * (bright - dark)
    img *= np.float32(rng.uniform(0.8, 1.2))
    img += rng.standard_normal((height, width, 3), dtype=np.float32) * 16
    return np.clip(img, 0, 255).astype(np.uint8)


def _boxes(rng: np.random.Generator) -> list[list[float]]:
    """0..3 random boxes as [ymin, xmin, ymax, xmax] lists, normalised."""
    boxes = []
    for _ in range(int(rng.integers(0, 4))):
        y0, x0 = rng.uniform(0, 0.7, size=2)
        y1, x1 = y0 + rng.uniform(0.1, 1 - y0), x0 + rng.uniform(0.1, 1 - x0)
        boxes.append([float(y0), float(x0), float(min(y1, 1.0)), float(min(x1, 1.0))])
    return boxes


def converter_example(
    jpeg: bytes,
    height: int,
    width: int,
    label: int,
    synset: str,
    text: str,
    filename: str,
    boxes: list[list[float]],
) -> bytes:
    """A serialized Example with every key and type build_imagenet_data.py writes (boxes as
    [ymin, xmin, ymax, xmax] lists, normalised)."""
    ymin, xmin, ymax, xmax = ([b[i] for b in boxes] for i in range(4))
    return encode_example(
        {
            "image/height": height,
            "image/width": width,
            "image/colorspace": b"RGB",
            "image/channels": 3,
            "image/class/label": label,
            "image/class/synset": synset,
            "image/class/text": text,
            "image/object/bbox/xmin": (float, xmin),
            "image/object/bbox/xmax": (float, xmax),
            "image/object/bbox/ymin": (float, ymin),
            "image/object/bbox/ymax": (float, ymax),
            "image/object/bbox/label": (int, [label] * len(boxes)),
            "image/format": b"JPEG",
            "image/filename": filename,
            "image/encoded": jpeg,
        }
    )


def synthetic_example(
    rng: np.random.Generator, style, label: int, synset: str, text: str, filename: str
) -> bytes:
    """One serialized Example with every key and type the converter writes."""
    height, width = (int(v) for v in rng.integers(MIN_SIDE, MAX_SIDE + 1, size=2))
    buf = io.BytesIO()
    Image.fromarray(_image(rng, style, height, width), "RGB").save(buf, "JPEG", quality=90)
    return converter_example(buf.getvalue(), height, width, label, synset, text, filename, _boxes(rng))


def make_synthetic(
    out_dir, train_shards: int, val_shards: int, per_shard: int, classes: int, seed: int
) -> None:
    """Write train-%05d-of-%05d and validation-%05d-of-%05d shards of per_shard records to out_dir."""
    if min(train_shards, val_shards, per_shard) < 0 or classes < 1 or train_shards + val_shards < 1:
        raise ValueError(
            "make_synthetic needs shard counts >= 0 (one at least), per_shard >= 0, classes >= 1"
        )
    out_dir = Path(out_dir)
    if out_dir.is_dir() and (held := [p.name for split in SPLITS for p in find_shards(out_dir, split)]):
        raise DataError(
            f"{out_dir} already holds {len(held)} shard(s) ({held[0]}, ...); write the new set to an empty "
            "directory, or delete those first"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    styles = _class_styles(classes, seed)
    synsets = [f"n{c + 1:08d}" for c in range(classes)]
    counter = 0
    for split, shards in (("train", train_shards), ("validation", val_shards)):
        for shard in range(shards):
            rng = np.random.default_rng([seed, 0 if split == "train" else 1, shard])
            records = []
            for i in range(per_shard):
                counter += 1
                c = int(rng.integers(0, classes))
                name = (
                    f"{synsets[c]}_{shard * per_shard + i}.JPEG"
                    if split == "train"
                    else f"ILSVRC2012_val_{shard * per_shard + i + 1:08d}.JPEG"
                )
                records.append(
                    synthetic_example(rng, styles[c], c + 1, synsets[c], f"synthetic class {c + 1}", name)
                )
            path = out_dir / f"{split}-{shard:05d}-of-{shards:05d}"
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            index = write_records(tmp, records)
            write_index_file(path.with_name(path.name + ".idx"), index)
            os.replace(tmp, path)  # the shard appears complete or not at all


def ensure_synthetic(
    target, train_shards: int, val_shards: int, per_shard: int, classes: int, seed: int
) -> bool:
    """Make `target` a complete synthetic set (marked by target/DONE); True if this call built it.

    Safe for concurrent callers: they serialise on an exclusive flock of `<target>.lock`, the first
    builds into a private temporary directory and renames it to `target` only when complete, the
    others find DONE once they hold the lock. (Before, two runs started in the same second shared one
    temporary name and the second stopped with FileNotFoundError; a later one deleted the set the
    first was reading as "a half-built leftover".)
    """
    target = Path(target)
    if (target / "DONE").exists():  # the common case: no lock needed to read a finished set
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (target / "DONE").exists():
            return False  # another process built it while this one waited
        # A build killed (kill -9) in its temporary directory leaves it: under the lock nobody is using it.
        for stale in target.parent.glob(f".{target.name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the set from the cache's other readers
            make_synthetic(tmp, train_shards, val_shards, per_shard, classes, seed)
            (tmp / "DONE").write_text("ok\n")
            if target.exists():  # left by a build that died before DONE: under the lock nobody reads it
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True
