"""CPU cost of the ResNet seed's vgg transform (fasttrain.data.vgg) per image, in one thread, by stage.

    python -m pytest bench/bench_vgg_transform.py --benchmark-only    # --benchmark-json=... keeps numbers

Stages, each over the same images and the same draws (side U{256..512}, uniform offsets, flip; the
seed's training transform at 224 px):
- full decode: TensorFlow's decode_jpeg pixels of the whole image (simplejpeg), for scale;
- cropped decode: the rows and columns the 224 x 224 window reads (jpeg.decode_window_rows, libturbojpeg
  3 with a cropping region), as the fast path runs it;
- resample: the window's bilinear taps and the rounding store from an already decoded region
  (vgg._window_bilinear), the uint8 output written in place;
- train transform: the whole per-image call the loaders make (header, draws, decode, resample).
Each test reports, in extra_info, the process CPU time per image (time.process_time over the timed
rounds: steadier than wall time on a shared machine) beside the wall-time images/s.

Data: FASTTRAIN_BENCH_IMAGES (default 400) JPEGs drawn as bench/photo_shards.py draws its set (real
photographs from skimage.data, its sizes and JPEG kinds: 4:2:0 / 4:2:2 / 4:4:4, grayscale, 10%
progressive), made in memory; FASTTRAIN_BENCH_DATA=<dir of train shards> reads that many records of
its first shard instead. FASTTRAIN_BENCH_SMOKE=1 uses 16 images and one round.
"""

import os
import time

import numpy as np
import pytest

from fasttrain.data import vgg
from fasttrain.data.jpeg import decode as jpeg

SMOKE = os.environ.get("FASTTRAIN_BENCH_SMOKE") == "1"
IMAGES = int(os.environ.get("FASTTRAIN_BENCH_IMAGES", "16" if SMOKE else "400"))
ROUNDS = int(os.environ.get("FASTTRAIN_BENCH_ROUNDS", "5"))
REAL = os.environ.get("FASTTRAIN_BENCH_DATA")
SIZE = 224  # the seed's crop; the sides follow from it (vgg.resize_sides)


def _photo_jpegs(count: int) -> list[bytes]:
    from bench.photo_shards import GRAY_FRACTION, cut, encode, load_sources, target_size

    rng = np.random.default_rng([0, 0x9407])  # photo_shards' draws, in its order
    colour, gray = load_sources()
    out = []
    for _ in range(count):
        width, height = target_size(rng)
        sources = gray if rng.uniform() < GRAY_FRACTION else colour
        out.append(encode(rng, cut(rng, sources[int(rng.integers(len(sources)))], width, height))[0])
    return out


def _shard_jpegs(data_dir: str, count: int) -> list[bytes]:
    from fasttrain.data.imagenet import decode_record, list_shards
    from fasttrain.data.tfrecord import iter_records

    shard = list_shards(data_dir, "train")[0]
    out = []
    for offset, payload in iter_records(shard, verify=False):
        out.append(decode_record(payload, shard, offset, 0, 1001).jpeg)
        if len(out) == count:
            break
    return out


@pytest.fixture(scope="module")
def images():
    """(jpegs, per-image (height, width, params, window)): the seed's training draws, fixed."""
    jpegs = _shard_jpegs(REAL, IMAGES) if REAL else _photo_jpegs(IMAGES)
    rng = np.random.default_rng(0)
    draws = []
    for data in jpegs:
        height, width = jpeg.jpeg_size(data)
        params = vgg.sample_train_params(rng, height, width, SIZE)
        draws.append((height, width, params, vgg.source_window(height, width, params, SIZE)))
    vgg.warm_up()
    return jpegs, draws


def _run(benchmark, env_info, images, fn, stage: str) -> None:
    """Time fn (one pass over the images) and report CPU ms per image and images/s."""
    cpu = []

    def timed():
        start = time.process_time()
        fn()
        cpu.append(time.process_time() - start)

    benchmark.pedantic(timed, rounds=ROUNDS, warmup_rounds=1)
    count = len(images[0])
    cpu_ms = 1000 * float(np.median(cpu[1:] or cpu)) / count  # the warm-up round left out
    benchmark.extra_info.update(env_info, data=REAL or "photo_shards draws", images=count, stage=stage)
    benchmark.extra_info.update(
        cpu_ms_per_image=round(cpu_ms, 4), images_per_s=count / benchmark.stats.stats.median
    )


def test_full_decode(benchmark, env_info, images):
    jpegs, _ = images
    _run(benchmark, env_info, images, lambda: [jpeg.decode_jpeg(d) for d in jpegs], "full decode")


def test_cropped_decode(benchmark, env_info, images):
    jpegs, draws = images

    def decode():
        for data, (_, _, _, window) in zip(jpegs, draws):
            jpeg.decode_window_rows(data, window)

    _run(benchmark, env_info, images, decode, "cropped decode")


def test_window_resample(benchmark, env_info, images):
    jpegs, draws = images
    regions = []
    for data, (_, _, _, window) in zip(jpegs, draws):
        rows, col = jpeg.decode_window_rows(data, window)
        regions.append((rows.copy(), col))  # a copy: the thread's decode buffer is reused
    out = np.empty((SIZE, SIZE * 3), np.uint8)

    def resample():
        for (height, width, params, window), (rows, col) in zip(draws, regions):
            new_h, new_w = vgg.smallest_size_at_least(height, width, params.side)
            vgg._window_bilinear(
                rows, window[0], col, height, width, new_h, new_w,
                params.top, params.left, params.flip, out, vgg._NO_FLOATS,
            )  # fmt: skip

    _run(benchmark, env_info, images, resample, "window resample + rounding")


def test_train_transform(benchmark, env_info, images):
    jpegs, _ = images
    out = np.empty((SIZE, SIZE, 3), np.uint8)

    def transform():
        rng = np.random.default_rng(0)
        for data in jpegs:
            vgg.train_transform(data, rng, SIZE, out=out)

    _run(benchmark, env_info, images, transform, "train transform")
