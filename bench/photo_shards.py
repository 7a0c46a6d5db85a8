"""A real-photo ImageNet-like shard set for input-pipeline benchmarks (generated, never committed).

Synthetic JPEGs (bench/input_rows.py's write_dataset: smooth colour fields plus noise) decode at a
different cost from photographs. This writes `images` distinct JPEGs cut from the photographs that
scikit-image ships (skimage.data; no download), laid out exactly as TensorFlow models'
build_imagenet_data.py writes ImageNet: shards train-%05d-of-%05d, one tf.train.Example per record
with the converter's keys (fasttrain.data.synthetic.converter_example), records shuffled over the
shards, plus the DALI/tfrecord index file `<shard>.idx` beside each shard.

    sources: colour photographs astronaut, coffee, chelsea, rocket, hubble_deep_field,
        immunohistochemistry, retina, stereo_motorcycle (both views); grayscale photographs camera,
        moon, brick, grass, gravel, coins, clock, cell, page, text. Not used: the synthetic or binary
        images (colorwheel, logo, horse, checkerboard, binary_blobs) and those that need a download.
    size: 50% 500x375 or 375x500 (4:3), 20% long side 500 with aspect 1..1.6 (500x333 ...), 30% long
        side U[200, 800] with short/long U[0.55, 1], short side at least 200 (ImageNet's train images
        are mostly 500 px on the long side, averaging about 400x350)
    content: a random window of the source at the target's aspect (area 50-100% of the largest
        such window, random position, random mirror), resized to the target with Lanczos (some
        sources are smaller than the target: upscaled)
    JPEG kinds (ImageNet holds all of these; the converter keeps the bytes as they are):
        3% grayscale, written as 1-component JPEGs from the grayscale sources (ImageNet's are kept
        1-component; decoders expand them to RGB); chroma subsampling of colour images 70% 4:2:0,
        15% 4:4:4, 15% 4:2:2; 10% progressive; 5% with restart markers (DRI every MCU row, Pillow's
        restart_marker_rows); 10% with an EXIF block (camera make/model/date, no orientation tag);
        quality U[85, 97] (the encoder is Pillow's libjpeg-turbo)
    boxes: 0 (50%), 1 (30%), 2 (12%) or 3 (8%) random boxes [ymin, xmin, ymax, xmax] (about half of
        ImageNet's train images have none), labels U{1..1000}

Deterministic for a seed with a given Pillow/libjpeg (their versions go into photo_shards.json, with
the set's statistics: mean size, mean bytes, the count of each kind).

    python -m bench.photo_shards OUT_DIR [--images 2048] [--records 8192] [--shards 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image, features

from fasttrain.data.synthetic import converter_example
from fasttrain.data.tfrecord import write_index_file, write_records

COLOUR_SOURCES = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "stereo_motorcycle",
)
GRAY_SOURCES = ("camera", "moon", "brick", "grass", "gravel", "coins", "clock", "cell", "page", "text")
GRAY_FRACTION = 0.03
SUBSAMPLING = ((2, "4:2:0", 0.70), (0, "4:4:4", 0.15), (1, "4:2:2", 0.15))  # Pillow's codes
PROGRESSIVE, RESTART, EXIF = 0.10, 0.05, 0.10
BOX_COUNTS = (0.50, 0.30, 0.12, 0.08)  # P(0), P(1), P(2), P(3 boxes)
MANIFEST = "photo_shards.json"
_EXIF_MAKE, _EXIF_MODEL, _EXIF_DATETIME = 0x010F, 0x0110, 0x0132


def load_sources() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(colour (H, W, 3) uint8 photos, grayscale (H, W) uint8 photos) from skimage.data."""
    try:
        import skimage.data as skdata
    except ImportError:
        raise SystemExit("bench.photo_shards needs scikit-image: pip install 'fasttrain[bench]'") from None
    colour = []
    for name in COLOUR_SOURCES:
        img = getattr(skdata, name)()
        views = img[:2] if name == "stereo_motorcycle" else (img,)  # (left, right, disparity)
        colour.extend(np.ascontiguousarray(v[..., :3]) for v in views)
    gray = [np.ascontiguousarray(getattr(skdata, name)()) for name in GRAY_SOURCES]
    return colour, gray


def target_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) drawn as the module docstring says."""
    kind = rng.uniform()
    if kind < 0.5:
        long_side, short_side = 500, 375
    elif kind < 0.7:
        long_side, short_side = 500, int(round(500 / rng.uniform(1.0, 1.6)))
    else:
        long_side = int(rng.integers(200, 801))
        short_side = max(200, int(round(long_side * rng.uniform(0.55, 1.0))))
        long_side = max(long_side, short_side)
    return (long_side, short_side) if rng.uniform() < 0.7 else (short_side, long_side)


def cut(rng: np.random.Generator, src: np.ndarray, width: int, height: int) -> Image.Image:
    """A random window of src at width:height's aspect, resized to (width, height)."""
    sh, sw = src.shape[:2]
    aspect = width / height
    full_w = min(sw, sh * aspect)  # the largest window of this aspect inside the source
    scale = np.sqrt(rng.uniform(0.5, 1.0))
    cw, ch = max(8.0, full_w * scale), max(8.0, full_w * scale / aspect)
    x0, y0 = rng.uniform(0, sw - cw), rng.uniform(0, sh - ch)
    img = Image.fromarray(src).resize((width, height), Image.LANCZOS, box=(x0, y0, x0 + cw, y0 + ch))
    return img.transpose(Image.FLIP_LEFT_RIGHT) if rng.uniform() < 0.5 else img


def encode(rng: np.random.Generator, img: Image.Image) -> tuple[bytes, list[str]]:
    """The JPEG bytes of img with randomly chosen encoder settings, and the kinds it has."""
    kinds = ["grayscale" if img.mode == "L" else "colour"]
    opts = dict(quality=int(rng.integers(85, 98)))
    if img.mode == "RGB":
        code, name, _ = SUBSAMPLING[rng.choice(len(SUBSAMPLING), p=[p for _, _, p in SUBSAMPLING])]
        opts["subsampling"] = code
        kinds.append(name)
    if rng.uniform() < PROGRESSIVE:
        opts["progressive"] = True
        kinds.append("progressive")
    if rng.uniform() < RESTART:
        opts["restart_marker_rows"] = 1
        kinds.append("restart markers")
    if rng.uniform() < EXIF:
        exif = Image.Exif()
        exif[_EXIF_MAKE], exif[_EXIF_MODEL] = "fasttrain", f"bench-{int(rng.integers(1, 10))}"
        exif[_EXIF_DATETIME] = "2026:11:23 12:00:00"
        opts["exif"] = exif.tobytes()
        kinds.append("exif")
    buf = io.BytesIO()
    img.save(buf, "JPEG", **opts)
    return buf.getvalue(), kinds


def random_boxes(rng: np.random.Generator) -> list[list[float]]:
    boxes = []
    for _ in range(int(rng.choice(len(BOX_COUNTS), p=BOX_COUNTS))):
        y0, x0 = rng.uniform(0, 0.6, size=2)
        y1, x1 = y0 + rng.uniform(0.2, 1 - y0), x0 + rng.uniform(0.2, 1 - x0)
        boxes.append([float(y0), float(x0), float(min(y1, 1.0)), float(min(x1, 1.0))])
    return boxes


def write_photo_shards(out_dir, images: int = 2048, records: int = 0, shards: int = 8, seed: int = 0) -> dict:
    """Write the shard set (see the module docstring) and its manifest; returns the manifest.

    records: total records (0: 4 x images), each distinct image appearing records / images times.
    """
    records = records or 4 * images
    if images < 1 or shards < 1 or records < shards:
        raise ValueError(f"need images >= 1 and records >= shards >= 1 (got {images}, {records}, {shards})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 0x9407])
    colour, gray = load_sources()
    examples, sizes, nbytes, kinds = [], [], [], {}
    for i in range(images):
        width, height = target_size(rng)
        if rng.uniform() < GRAY_FRACTION:
            img = cut(rng, gray[int(rng.integers(len(gray)))], width, height)
        else:
            img = cut(rng, colour[int(rng.integers(len(colour)))], width, height)
        jpeg, image_kinds = encode(rng, img)
        for k in image_kinds:
            kinds[k] = kinds.get(k, 0) + 1
        boxes = random_boxes(rng)
        kinds[f"{len(boxes)} boxes"] = kinds.get(f"{len(boxes)} boxes", 0) + 1
        label = int(rng.integers(1, 1001))  # stored labels 1..1000, as build_imagenet_data.py writes
        synset, text, name = f"n{label:08d}", f"photo class {label}", f"photo_{i:05d}.JPEG"
        examples.append(converter_example(jpeg, height, width, label, synset, text, name, boxes))
        sizes.append((width, height))
        nbytes.append(len(jpeg))
    order = rng.permutation(records) % images  # build_imagenet_data.py shuffles before sharding
    bounds = np.linspace(0, records, shards + 1).astype(int)
    for shard in range(shards):
        path = out_dir / f"train-{shard:05d}-of-{shards:05d}"
        index = write_records(path, (examples[k] for k in order[bounds[shard] : bounds[shard + 1]]))
        write_index_file(path.with_name(path.name + ".idx"), index)
    manifest = dict(
        generator="bench/photo_shards.py",
        seed=seed,
        images=images,
        records=records,
        shards=shards,
        mean_width=float(np.mean([w for w, _ in sizes])),
        mean_height=float(np.mean([h for _, h in sizes])),
        min_side=int(min(min(s) for s in sizes)),
        max_side=int(max(max(s) for s in sizes)),
        mean_jpeg_bytes=float(np.mean(nbytes)),
        kinds=dict(sorted(kinds.items())),
        pillow=Image.__version__,
        libjpeg_turbo=features.version("jpg"),
        sources=list(COLOUR_SOURCES + GRAY_SOURCES),
    )
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def cached_photo_shards(out_dir, images: int, records: int, shards: int, seed: int = 0) -> dict:
    """The manifest of out_dir's set when it was written with these arguments, else a new set."""
    manifest = Path(out_dir) / MANIFEST
    want = dict(images=images, records=records or 4 * images, shards=shards, seed=seed)
    if manifest.is_file():
        old = json.loads(manifest.read_text())
        if all(old.get(k) == v for k, v in want.items()):
            return old
    return write_photo_shards(out_dir, images, records, shards, seed)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description="Write a real-photo ImageNet-layout shard set (see the docstring)"
    )
    p.add_argument("out_dir")
    p.add_argument("--images", type=int, default=2048, help="distinct JPEGs")
    p.add_argument("--records", type=int, default=0, help="records over all shards (default 4 x images)")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        manifest = write_photo_shards(args.out_dir, args.images, args.records, args.shards, args.seed)
    except ValueError as exc:
        raise SystemExit(f"bench.photo_shards: {exc}") from None
    print(json.dumps(manifest))


if __name__ == "__main__":
    main()
