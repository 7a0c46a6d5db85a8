"""CPU cost of the input path: TFRecord reading with CRC, verify, and the train/eval transforms per worker.

    python -m pytest bench/bench_data.py --benchmark-only    # add --benchmark-json=... to keep numbers

Each test reports its rate (records/s, MB/s or images/s for one process) in `extra_info` together with
the environment. Data: synthetic ImageNet-layout shards written to a temporary directory (48..160 px
JPEGs), plus for the transforms a set of 500 x 375 JPEGs (bench/input_rows.py's synthetic_jpeg), the
size of an average ImageNet image, so the per-image cost is close to the real one.
FASTTRAIN_BENCH_DATA=<dir of real shards> reads real data instead (only its first train shard).
"""

import os
import time

import google_crc32c
import numpy as np
import pytest

from bench.input_rows import synthetic_jpeg
from fasttrain.data.imagenet import decode_record, list_shards
from fasttrain.data.synthetic import make_synthetic
from fasttrain.data.tfrecord import iter_records
from fasttrain.data.transforms import eval_transform, train_transform
from fasttrain.data.verify import verify_dataset

REAL = os.environ.get("FASTTRAIN_BENCH_DATA")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    if REAL:
        return REAL
    root = tmp_path_factory.mktemp("bench-data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=400, classes=10, seed=0)
    return str(root)


@pytest.fixture(scope="module")
def shard(data_dir):
    return list_shards(data_dir, "train")[0]


def test_reader_records_per_second_with_crc(benchmark, env_info, shard):
    size = os.path.getsize(shard)

    def read():
        return sum(1 for _ in iter_records(shard, verify=True))

    records = benchmark.pedantic(read, rounds=5, warmup_rounds=1)
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(env_info, data=REAL or "synthetic", crc32c=google_crc32c.implementation)
    benchmark.extra_info.update(
        records=records, records_per_s=records / seconds, mb_per_s=size / seconds / 1e6
    )


def test_verify_records_per_second_one_worker(benchmark, env_info, data_dir, tmp_path):
    shards = list_shards(data_dir, "train")[:2]
    size = sum(os.path.getsize(s) for s in shards)

    def run():
        return verify_dataset(data_dir, splits=["train"], workers=1, write_index=False, cache_dir=tmp_path)

    report = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(env_info, data=REAL or "synthetic", crc32c=google_crc32c.implementation)
    benchmark.extra_info.update(
        records=report.records,
        records_per_s=report.records / seconds,
        mb_per_s=sum(s.bytes for s in report.shards) / seconds / 1e6 if not REAL else size / seconds / 1e6,
    )


def _imagenet_sized_records(n=48):
    """(jpeg, boxes) pairs of 500 x 375 synthetic images, ImageNet's average size."""
    rng = np.random.default_rng(0)
    return [(synthetic_jpeg(rng, 500, 375), np.zeros((0, 4), np.float32)) for _ in range(n)]


@pytest.fixture(scope="module")
def records(shard):
    if REAL:
        return [
            (r.jpeg, r.boxes)
            for r in (decode_record(p, shard, o, 0, 1 << 62) for o, p in iter_records(shard))
        ][:256]
    return _imagenet_sized_records()


CASES = {
    "resnet224": dict(image_size=224, preprocess="resnet", color_distort=False),
    "inception299+colour": dict(image_size=299, preprocess="inception", color_distort=True),
    "demo64": dict(image_size=64, preprocess="resnet", color_distort=False),
}


@pytest.mark.parametrize("case", CASES)
def test_train_transform_images_per_second_per_worker(benchmark, env_info, records, case):
    kwargs = CASES[case]

    def run():
        for i, (jpeg, boxes) in enumerate(records):
            train_transform(jpeg, boxes, np.random.default_rng(i), **kwargs)

    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    benchmark.extra_info.update(env_info, data=REAL or "synthetic", **kwargs)
    benchmark.extra_info["images_per_s"] = len(records) / benchmark.stats.stats.median


@pytest.mark.parametrize("case", ["resnet224", "inception299+colour"])
def test_eval_transform_images_per_second_per_worker(benchmark, env_info, records, case):
    kwargs = {k: v for k, v in CASES[case].items() if k != "color_distort"}

    def run():
        for jpeg, _ in records:
            eval_transform(jpeg, **kwargs)

    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    benchmark.extra_info.update(env_info, data=REAL or "synthetic", **kwargs)
    benchmark.extra_info["images_per_s"] = len(records) / benchmark.stats.stats.median


def test_make_synthetic_demo_size(benchmark, env_info, tmp_path):
    # The demo's set: 4 x 750 train + 750 validation images; must stay well under 20 s on one core.
    def run():
        start = time.perf_counter()
        make_synthetic(tmp_path / str(start), 4, 1, 750, 10, 0)

    benchmark.pedantic(run, rounds=1, warmup_rounds=0)
    benchmark.extra_info.update(env_info, images_per_s=3750 / benchmark.stats.stats.median)
