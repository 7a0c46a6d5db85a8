"""Input-pipeline measurements: the rate each backend delivers training batches at, alone.

Data: the shards of --data_dir when given (train-*-of-*); otherwise `write_dataset` writes a
synthetic set to a temporary directory: `unique` distinct JPEGs (quality 90) of width x height px,
smooth colour fields plus uniform noise in [-20, 20], each with one random box, repeated to `records`
records over `shards` shards, with DALI index files. Its JPEGs are not ImageNet's (the mean encoded
size is recorded), so the decode cost is an estimate: rerun with --data_dir for the real figure.

    pipeline_rate(spec, device, warmup, repeats, batches):
        the loader of spec.input ("torch" or "dali") iterated on its own: `warmup` batches untimed,
        then `repeats` windows of `batches` batches, wall clock (device batches synchronised);
        images/s per window = batches * batch_size / seconds
    headroom = pipeline images/s / training images/s of row (a) on synthetic input, same model,
        batch and size: at 1 or more the pipeline keeps up with training.

    nvjpeg_rate(spec, device, data_dir, warmup, repeats, batches):
        GPU decoding where DALI's GPU (mixed) decoder cannot run (DALI not installed):
        torchvision.io.decode_jpeg(..., device="cuda") (nvJPEG) on a batch of the shards' JPEGs,
        then per image the seed's bounding-box crop (sample_distorted_bounding_box) and a bilinear
        resize to spec.image_size, stacked into the (N, H, W, 3) uint8 batch the step takes. The
        encoded bytes are read from the shards once beforehand (no file reading in the window, one
        host thread): an estimate of what GPU decoding sustains, not a full loader.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from bench.common import one_line, summarize, synchronize
from bench.row_steps import RowSpec, config_for
from fasttrain.data import build_loader
from fasttrain.data.imagenet import decode_record, list_shards
from fasttrain.data.synthetic import converter_example
from fasttrain.data.tfrecord import iter_records, write_index_file, write_records
from fasttrain.data.transforms import sample_distorted_bounding_box
from fasttrain.train import batch_stream


def synthetic_jpeg(rng: np.random.Generator, width: int, height: int) -> bytes:
    """A quality-90 JPEG of a smooth random colour field plus uniform noise in [-20, 20]."""
    field = rng.integers(0, 256, (max(2, height // 32), max(2, width // 32), 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(field).resize((width, height), Image.BICUBIC), dtype=np.int16)
    img = img + rng.integers(-20, 21, img.shape, dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _example(jpeg: bytes, width: int, height: int, label: int, box: list[float], name: str) -> bytes:
    synset, text = f"n{label:08d}", f"synthetic class {label}"
    return converter_example(jpeg, height, width, label, synset, text, name, [box])


@contextlib.contextmanager
def pipeline_data(data_dir: str, smoke: bool):
    """(data_dir, its description for results.json): the given directory, or a synthetic set written to
    a temporary directory for the run's pipeline part and removed afterwards."""
    if data_dir:
        yield data_dir, dict(data_dir=data_dir, synthetic=False)
        return
    shape = (
        dict(records=256, unique=16, width=96, height=72, shards=2)
        if smoke  # 32 batches of 8, enough for every smoke measurement within one epoch
        # 192 batches of 256: a fed row's warm-up and timed windows stay inside one epoch
        # (an epoch's end restarts the loader's workers, seconds that are no training speed).
        else dict(records=49152, unique=512, width=500, height=375, shards=32)
    )
    tmp = tempfile.mkdtemp(prefix="fasttrain-bench-data-")
    try:
        yield tmp, write_dataset(tmp, **shape)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_dataset(
    out_dir, records: int, unique: int, width: int, height: int, shards: int, seed: int = 0
) -> dict:
    """Write train-%05d-of-%05d shards (see the module docstring); returns what was written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    jpegs = [synthetic_jpeg(rng, width, height) for _ in range(unique)]
    examples = []
    for i in range(unique):
        y0, x0 = rng.uniform(0, 0.5, size=2)
        box = [float(y0), float(x0), float(y0 + rng.uniform(0.3, 0.5)), float(x0 + rng.uniform(0.3, 0.5))]
        label = int(rng.integers(1, 1001))  # stored labels 1..1000, as build_imagenet_data.py writes
        examples.append(_example(jpegs[i], width, height, label, box, f"synthetic_{i}.JPEG"))
    per_shard = -(-records // shards)
    for shard in range(shards):
        count = min(per_shard, records - shard * per_shard)
        path = out_dir / f"train-{shard:05d}-of-{shards:05d}"
        index = write_records(path, (examples[(shard * per_shard + i) % unique] for i in range(count)))
        write_index_file(path.with_name(path.name + ".idx"), index)
    return dict(
        data_dir=str(out_dir),
        synthetic=True,
        records=records,
        unique_images=unique,
        image_px=f"{width}x{height}",
        mean_jpeg_bytes=int(np.mean([len(j) for j in jpegs])),
    )


def pipeline_rate(spec: RowSpec, device: torch.device, warmup: int, repeats: int, batches: int) -> dict:
    """Images/s the loader of spec.input delivers on its own. Never raises: failures are the status."""
    result = dict(spec=vars(spec).copy(), status="ok")
    try:
        cfg = config_for(spec, device)
        # The trainer's loader: the zero-copy ring (fasttrain.train).
        loader = build_loader(
            cfg, split="train", training=True, rank=0, world_size=1, device=device, reuse_buffers=True
        )
        stream = batch_stream(loader, 1)
        t0 = time.perf_counter()
        for _ in range(warmup):
            next(stream)
        synchronize(device)
        result["warmup_seconds"] = time.perf_counter() - t0  # worker start-up, DALI pipeline build
        ips = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(batches):
                images, _labels = next(stream)[0]
            synchronize(device)  # note: DALI's batches are device tensors; count them finished
            ips.append(batches * spec.batch / (time.perf_counter() - t0))
        result.update(batches_per_repeat=batches, images_per_s=summarize(ips))
        result["batch_dtype"] = str(images.dtype).replace("torch.", "")
        result["batch_device"] = images.device.type
    except Exception as exc:  # DALI missing a GPU decoder, a bad --data_dir, ...: reported, not fatal
        result["status"] = "failed"
        result["error"] = one_line(exc)
    return result


def nvjpeg_rate(
    spec: RowSpec, device: torch.device, data_dir: str, warmup: int, repeats: int, batches: int
) -> dict:
    """GPU JPEG decode + crop + resize images/s (see the module docstring). Never raises."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg

        if device.type != "cuda":
            raise RuntimeError("nvJPEG decoding needs a CUDA device")
    except Exception as exc:  # torchvision missing or built for another torch, no CUDA
        error = one_line(exc)
        return dict(spec=vars(spec).copy(), status="failed", error=error)
    # RGB: ImageNet holds some grayscale and CMYK JPEGs; the crop/resize stacks 3-channel images.
    decode = lambda jpegs: decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device)
    return decode_rate(spec, device, data_dir, decode, warmup, repeats, batches)


def decode_rate(
    spec: RowSpec, device: torch.device, data_dir: str, decode, warmup: int, repeats: int, batches: int
) -> dict:
    """nvjpeg_rate's measurement with any batch decoder: decode(list of 1-D uint8 CPU tensors) ->
    list of (3, h, w) uint8 tensors on `device`. Never raises."""
    result = dict(spec=vars(spec).copy(), status="ok")
    try:
        records = []
        for shard in list_shards(data_dir, "train"):
            for offset, payload in iter_records(shard):
                records.append(decode_record(payload, shard, offset, label_offset=0, num_classes=1001))
                if len(records) >= spec.batch * 4:
                    break
            if len(records) >= spec.batch * 4:
                break
        if len(records) < spec.batch:
            raise ValueError(f"{data_dir} holds {len(records)} training records, fewer than a batch")
        encoded = [torch.frombuffer(bytearray(r.jpeg), dtype=torch.uint8) for r in records]
        rng = np.random.default_rng(0)

        def one_batch(k: int) -> torch.Tensor:
            start = (k * spec.batch) % (len(encoded) - spec.batch + 1)
            chosen = range(start, start + spec.batch)
            images = decode([encoded[i] for i in chosen])
            return crop_resize_batch(images, [records[i].boxes for i in chosen], rng, spec.image_size)

        t0 = time.perf_counter()
        for k in range(warmup):
            one_batch(k)
        synchronize(device)
        result["warmup_seconds"] = time.perf_counter() - t0
        ips = []
        for r in range(repeats):
            t0 = time.perf_counter()
            for k in range(batches):
                images = one_batch(warmup + r * batches + k)
            synchronize(device)
            ips.append(batches * spec.batch / (time.perf_counter() - t0))
        result.update(batches_per_repeat=batches, images_per_s=summarize(ips))
        result["batch_dtype"] = str(images.dtype).replace("torch.", "")
        result["batch_device"] = images.device.type
        result["note"] = "decode + crop + resize only, bytes in host memory, one host thread"
    except Exception as exc:  # an undecodable JPEG, too few records, out of memory: reported, not fatal
        result["status"] = "failed"
        result["error"] = one_line(exc)
    return result


def crop_resize_batch(
    images: list[torch.Tensor], boxes: list, rng: np.random.Generator, size: int
) -> torch.Tensor:
    """(3, h, w) uint8 images -> the (N, size, size, 3) uint8 batch: per image the seed's bounding-box
    crop (sample_distorted_bounding_box), then a bilinear resize, on the images' device."""
    out = []
    for img, image_boxes in zip(images, boxes, strict=True):
        h, w = img.shape[1:]
        top, left, ch, cw = sample_distorted_bounding_box(rng, h, w, image_boxes)
        crop = img[:, top : top + ch, left : left + cw].unsqueeze(0).float()
        out.append(F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False))
    return torch.cat(out).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
