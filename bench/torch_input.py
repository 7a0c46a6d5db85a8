"""The PyTorch-side rows of bench/bench_input.py, one per process (the stdin protocol of
bench/input_serve.py):

    fasttrain-torch  fasttrain's loader as the trainer builds it: bench/row_steps.config_for (the
                     recipe's Config: resnet50's for resnet, inception_v3's, colour distortion
                     included, for inception) with data_backend="torch", loader="processes" (the
                     DataLoader worker processes), num_workers=2, then
                     fasttrain.data.build_loader(cfg, split="train", training=True, device=cpu),
                     iterated across epochs by fasttrain.train.batch_stream. Must deliver (N, S, S, 3) uint8.
    fasttrain-threads the same with loader="threads" (fasttrain.data.thread_loader: 2 threads of the
                     row's own process). Both torch rows deliver the same images.
    fasttrain-dali   the same with data_backend="dali" on the CPU device, which DaliLoader runs in
                     DALI's CPU-only mode (device_id=None, CPU decoder and ops, num_threads=2);
                     (N, S, S, 3) float32, already normalised.
    plain-pytorch    what a PyTorch user writes without fasttrain: the PyPI `tfrecord` package's
                     TFRecordDataset per shard (split between the DataLoader's workers by its .idx
                     index, a 256-record shuffle queue) chained together, and per record Pillow:
                     decode, convert("RGB"), torchvision's RandomResizedCrop(S) sampling (scale
                     [0.08, 1], ratio [3/4, 4/3], 10 attempts, else the centre crop) as crop +
                     resize BILINEAR, a flip with p 1/2, for inception a ColorJitter(0.4, 0.4, 0.4,
                     0.1)-like jitter (ImageEnhance brightness, contrast, colour and an HSV hue shift,
                     in a random order), then ToTensor + Normalize (float CHW / 255, ImageNet mean and
                     std); DataLoader(batch_size=N, num_workers=2), a new epoch re-iterating it.
                     (N, 3, S, S) float32. torchvision itself is not installed here, so its
                     transforms are written out with Pillow and NumPy as they do it for PIL images.
                     vgg: Resize(U{256..512}) + RandomCrop(S) + flip instead (PlainVggTransform).

    python -m bench.torch_input --row ROW --data_dir DIR --setting resnet|inception|vgg --image_size S
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import math
import random

import numpy as np
import torch
from PIL import Image, ImageEnhance

from bench.input_serve import serve
from bench.row_steps import RowSpec, config_for
from fasttrain.data import build_loader
from fasttrain.data.imagenet import list_shards
from fasttrain.train import batch_stream

ROWS = ("fasttrain-torch", "fasttrain-dali", "plain-pytorch", "fasttrain-threads", "fasttrain-threads-nocp")
LOADER_OF = {"torch": "processes", "threads": "threads"}  # the row name's suffix -> Config.loader
# fasttrain-threads-nocp: the thread loader ignoring the shards' JPEG row checkpoints (row_checkpoints=False)
MODEL_OF = {"resnet": "resnet50", "inception": "inception_v3", "vgg": "resnet50_v2"}
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
SHUFFLE_QUEUE = 256  # records per worker and shard; tfrecord warns when a shard part holds fewer


def fasttrain_batches(
    backend: str, data_dir: str, setting: str, size: int, batch: int, workers: int, plain: bool = False
):
    cpu = torch.device("cpu")
    torch_loader = LOADER_OF.get(backend)  # None for dali
    kind = "torch" if torch_loader else backend
    spec = RowSpec("a", MODEL_OF[setting], batch, size, input=kind, data_dir=data_dir, num_workers=workers)
    cfg = config_for(spec, cpu)
    if setting == "vgg":  # the ResNet seed's preprocessing (a recipe may already choose it)
        cfg = dataclasses.replace(cfg, preprocess="vgg")
    if torch_loader:
        cfg = dataclasses.replace(cfg, loader=torch_loader, row_checkpoints=not plain)
    # The trainer's loader: the zero-copy ring (fasttrain.train); each batch is checked and dropped.
    loader = build_loader(
        cfg, split="train", training=True, rank=0, world_size=1, device=cpu, reuse_buffers=True
    )
    expected = (torch.float32 if backend == "dali" else torch.uint8, (batch, size, size, 3))
    for [(images, _labels)] in batch_stream(loader, 1):
        if (images.dtype, tuple(images.shape)) != expected:
            raise AssertionError(
                f"{backend} loader gave {images.dtype} {tuple(images.shape)}, not {expected}"
            )
        yield images


def random_resized_crop_box(rng: random.Random, width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision RandomResizedCrop.get_params (scale (0.08, 1), ratio (3/4, 4/3)): (left, top, w, h)."""
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target_area = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    in_ratio = width / height  # fallback: the centre crop at the nearest allowed aspect
    if in_ratio < 3 / 4:
        w, h = width, int(round(width / (3 / 4)))
    elif in_ratio > 4 / 3:
        h, w = height, int(round(height * (4 / 3)))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def _adjust_hue(img: Image.Image, factor: float) -> Image.Image:
    """torchvision F.adjust_hue for PIL images: shift the H channel of HSV by factor * 255."""
    h, s, v = img.convert("HSV").split()
    h = Image.fromarray((np.asarray(h).astype(np.int16) + int(factor * 255)).astype(np.uint8), "L")
    return Image.merge("HSV", (h, s, v)).convert("RGB")


def color_jitter(rng: random.Random, img: Image.Image) -> Image.Image:
    """ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1), ops in a random order."""
    ops = [
        lambda x: ImageEnhance.Brightness(x).enhance(rng.uniform(0.6, 1.4)),
        lambda x: ImageEnhance.Contrast(x).enhance(rng.uniform(0.6, 1.4)),
        lambda x: ImageEnhance.Color(x).enhance(rng.uniform(0.6, 1.4)),
        lambda x: _adjust_hue(x, rng.uniform(-0.1, 0.1)),
    ]
    rng.shuffle(ops)
    for op in ops:
        img = op(img)
    return img


class PlainTransform:
    """The plain user's per-record transform (see the module docstring): features -> (CHW float, label)."""

    def __init__(self, size: int, colour: bool):
        self.size, self.colour = size, colour
        self.rng = random.Random()  # seeded per worker by worker_init

    def __call__(self, features: dict):
        img = Image.open(io.BytesIO(features["image/encoded"])).convert("RGB")
        left, top, w, h = random_resized_crop_box(self.rng, *img.size)
        img = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.BILINEAR)
        if self.rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        if self.colour:
            img = color_jitter(self.rng, img)
        x = (np.asarray(img, dtype=np.float32) / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
        return torch.from_numpy(x.transpose(2, 0, 1).copy()), int(features["image/class/label"][0])


class PlainVggTransform:
    """The plain user's vgg transform: Pillow decode, torchvision Resize(side) with side U{256..512}
    (short side to side, long side int(side * long / short), Pillow's antialiased BILINEAR),
    RandomCrop(S), flip with p 1/2, ToTensor + Normalize(mean = the seed's means / 255, std 1)."""

    MEAN = np.array([123.68, 116.78, 103.94], dtype=np.float32) / 255

    def __init__(self, size: int):
        self.size, self.rng = size, random.Random()

    def __call__(self, features: dict):
        img = Image.open(io.BytesIO(features["image/encoded"])).convert("RGB")
        side, (w, h) = self.rng.randint(256, 512), img.size
        new_w, new_h = (side, int(side * h / w)) if w <= h else (int(side * w / h), side)
        img = img.resize((new_w, new_h), Image.BILINEAR)
        left, top = self.rng.randint(0, new_w - self.size), self.rng.randint(0, new_h - self.size)
        img = img.crop((left, top, left + self.size, top + self.size))
        if self.rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        x = np.asarray(img, dtype=np.float32) / 255.0 - self.MEAN
        return torch.from_numpy(x.transpose(2, 0, 1).copy()), int(features["image/class/label"][0])


def _worker_init(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    for ds in info.dataset.datasets:
        ds.transform.rng.seed(info.seed)


def plain_batches(data_dir: str, setting: str, size: int, batch: int, workers: int):
    from tfrecord.torch.dataset import TFRecordDataset

    transform = PlainVggTransform(size) if setting == "vgg" else PlainTransform(size, setting == "inception")
    keys = {"image/encoded": "byte", "image/class/label": "int"}
    shards = [
        TFRecordDataset(str(p), f"{p}.idx", keys, shuffle_queue_size=SHUFFLE_QUEUE, transform=transform)
        for p in list_shards(data_dir, "train")
    ]
    dataset = torch.utils.data.ChainDataset(shards)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch, num_workers=workers, drop_last=True, worker_init_fn=_worker_init
    )
    while True:
        for images, _labels in loader:
            yield images


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row", choices=ROWS, required=True)
    p.add_argument("--data_dir", required=True)
    p.add_argument("--setting", choices=tuple(MODEL_OF), required=True)
    p.add_argument("--image_size", type=int, required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    a = (args.data_dir, args.setting, args.image_size, args.batch, args.workers)
    if args.row == "plain-pytorch":
        make = lambda: plain_batches(*a)  # noqa: E731
    else:
        make = lambda: fasttrain_batches(args.row.split("-")[1], *a, plain=args.row.endswith("-nocp"))  # noqa: E731
    serve(make, lambda b: dict(shape=list(b.shape), dtype=str(b.dtype).replace("torch.", "")))


if __name__ == "__main__":
    main()
