"""CPU cost per image of the loader's GIL-held work other than the decode and resize kernels.

    python -m pytest bench/bench_loader_overhead.py --benchmark-only   (FASTTRAIN_BENCH_SMOKE=1: seconds)

Per record, on one thread: read_record with CRC (one shard, records in file order), decode_record
(Example parse and ImageRecord), the sample generator (np.random.default_rng([seed, epoch, position])
against SampleReader's reseeded SampleGenerator, which gives the same state), and the random
parameters (sample_train_params) of the resnet and inception + colour settings, and the lookup of a
record's JPEG row checkpoints (RowIndexes.checkpoints: the record's offset, then the data CRC its
sidecar entry stored against the one just read, fasttrain.data.jpeg.row_index; "offset only" is the
lookup without that comparison, as it was before sidecars carried CRCs; always on a synthetic shard).
Each test reports `us_per_image` in extra_info. Data: synthetic ImageNet-layout shards (0-3 boxes per
record, as the converter writes them), or FASTTRAIN_BENCH_DATA=<dir of real shards> (its first train
shard).
"""

import os

import numpy as np
import pytest

from fasttrain.data.imagenet import decode_record, list_shards
from fasttrain.data.jpeg.row_index import RowIndexes, build_row_index
from fasttrain.data.seeding import SampleGenerator
from fasttrain.data.synthetic import make_synthetic
from fasttrain.data.tfrecord import iter_records, read_record
from fasttrain.data.transforms import sample_train_params

REAL = os.environ.get("FASTTRAIN_BENCH_DATA")
SMOKE = os.environ.get("FASTTRAIN_BENCH_SMOKE") == "1"
RECORDS = 16 if SMOKE else 400
ROUNDS = 1 if SMOKE else 5


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    if REAL:
        shard = list_shards(REAL, "train")[0]
    else:
        root = tmp_path_factory.mktemp("bench-overhead")
        make_synthetic(root, train_shards=1, val_shards=1, per_shard=RECORDS, classes=10, seed=0)
        shard = list_shards(root, "train")[0]
    framed = []
    for offset, payload in iter_records(shard):
        framed.append((offset, len(payload) + 16, payload))
        if len(framed) == RECORDS:
            break
    return shard, framed


def _per_image(benchmark, env_info, fn, count, **info):
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info.update(env_info, data=REAL or "synthetic", images=count, **info)
    benchmark.extra_info["us_per_image"] = benchmark.stats.stats.median / count * 1e6


def test_read_record_with_crc(benchmark, env_info, records):
    shard, framed = records
    with open(shard, "rb") as f:
        _per_image(
            benchmark, env_info, lambda: [read_record(f, o, s, shard) for o, s, _ in framed], len(framed)
        )


def test_decode_record(benchmark, env_info, records):
    shard, framed = records
    _per_image(
        benchmark, env_info, lambda: [decode_record(p, shard, o, -1, 1000) for o, _, p in framed], len(framed)
    )


@pytest.mark.parametrize("how", ["default_rng", "SampleGenerator"])
def test_sample_generator(benchmark, env_info, how):
    generator = SampleGenerator()
    make = generator.seeded if how == "SampleGenerator" else lambda key: np.random.default_rng(list(key))
    _per_image(benchmark, env_info, lambda: [make((42, 3, p)) for p in range(RECORDS)], RECORDS)


@pytest.mark.parametrize("setting", ["resnet", "inception+colour"])
def test_sample_train_params(benchmark, env_info, records, setting):
    shard, framed = records
    boxes = [decode_record(p, shard, o, -1, 1000).boxes for o, _, p in framed]
    rng = np.random.default_rng(0)
    preprocess, colour = ("resnet", False) if setting == "resnet" else ("inception", True)
    _per_image(
        benchmark,
        env_info,
        lambda: [sample_train_params(rng, 375, 500, b, preprocess, colour) for b in boxes],
        len(boxes),
    )


@pytest.fixture(scope="module")
def row_indexes(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-rows")
    make_synthetic(root, train_shards=1, val_shards=1, per_shard=RECORDS, classes=10, seed=0)
    shard = list_shards(root, "train")[0]
    build_row_index(shard)
    indexes = RowIndexes([shard])
    index = indexes._index(0)
    return indexes, [int(o) for o in index.offsets], [int(c) for c in index.crcs]


@pytest.mark.parametrize("check", ["offset and data CRC", "offset only"])
def test_row_checkpoint_lookup(benchmark, env_info, row_indexes, check):
    indexes, offsets, crcs = row_indexes
    if check == "offset only":

        def lookup(file_id, offset, crc):
            index = indexes._index(file_id)
            return index.checkpoints_at(index.find_record(offset))
    else:
        lookup = indexes.checkpoints
    _per_image(benchmark, env_info, lambda: [lookup(0, o, c) for o, c in zip(offsets, crcs)], len(offsets))
