"""The training record order input_order=one_stream (fasttrain/data/sharding.py): the ResNet seed's
imagenet.py make_batch (shard files shuffled, read one after another, one shuffle buffer, batch(B), tower
i taking every i-th batch), as a function of seed, epoch and world size, and carried to the loader by
open_split's table, without the loader being told.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fasttrain.data.sharding import RecordTable, epoch_positions, num_batches, open_split
from fasttrain.flags import parse_args

_SHARD_SIZES = [7, 5, 9, 4, 6, 8]  # N = 39


def _table(order: str, batch: int) -> RecordTable:
    counts = np.array(_SHARD_SIZES)
    n = int(counts.sum())
    return RecordTable(
        files=[f"train-{i:05d}-of-{len(counts):05d}" for i in range(len(counts))],
        file_ids=np.repeat(np.arange(len(counts), dtype=np.int32), counts),
        offsets=np.zeros(n, np.int64),
        sizes=np.zeros(n, np.int64),
        shard_starts=np.concatenate([[0], np.cumsum(counts)]),
        input_order=order,
        batch_size=batch,
    )


def test_without_a_buffer_records_are_read_shard_after_shard_in_shuffled_shard_order():
    # files shuffled, then flat_map(TFRecordDataset): every shard whole, in file order, one after another
    table = _table("one_stream", 3)

    def shard_order(epoch):
        order = epoch_positions(table, True, 5, epoch, 0, 1, 1)
        shards = [int(s) for s in dict.fromkeys(table.file_ids[order].tolist())]  # in reading order
        whole = [np.arange(table.shard_starts[s], table.shard_starts[s + 1]) for s in shards]
        assert sorted(shards) == list(range(len(_SHARD_SIZES)))
        assert np.array_equal(order, np.concatenate(whole))
        return shards

    assert shard_order(0) != shard_order(1)  # reshuffled each epoch (6! orders: a tie is 1 in 720)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_one_stream_deals_the_buffered_streams_batches_to_the_ranks_in_turn(world_size):
    table, batch, buffer = _table("one_stream", 3), 3, 4
    whole = epoch_positions(table, True, 11, 2, 0, 1, buffer)
    batches = [whole[k : k + batch] for k in range(0, len(whole) - batch + 1, batch)]
    rounds = len(whole) // world_size // batch
    seen = []
    for rank in range(world_size):
        mine = epoch_positions(table, True, 11, 2, rank, world_size, buffer)
        expected = batches[rank : rounds * world_size : world_size]  # tower i takes every i-th batch
        assert len(mine) >= num_batches(len(table), True, rank, world_size, batch) * batch
        assert np.array_equal(mine[: rounds * batch], np.concatenate(expected))
        seen += mine[: rounds * batch].tolist()
    assert len(set(seen)) == len(seen)  # no record twice in an epoch
    # One buffer over the whole stream: record i of the order was read at most buffer - 1 records after
    # the i-th (tf.data's shuffle emits only what it holds), on every rank, rank 1's first batch included.
    stream = epoch_positions(table, True, 11, 2, 0, 1, 1)
    read_at = {int(p): i for i, p in enumerate(stream)}
    assert all(read_at[int(p)] <= i + buffer - 1 for i, p in enumerate(whole))


def test_one_stream_is_a_function_of_seed_epoch_and_world_size():
    table = _table("one_stream", 2)
    first = epoch_positions(table, True, 3, 4, 1, 2, 5)
    assert np.array_equal(first, epoch_positions(table, True, 3, 4, 1, 2, 5))
    assert not np.array_equal(first, epoch_positions(table, True, 3, 5, 1, 2, 5))
    # The default is unchanged: each rank's own slice.
    sliced = epoch_positions(_table("rank_slices", 2), True, 3, 4, 1, 2, 5)
    assert not np.array_equal(first, sliced)


def test_open_split_carries_the_runs_order_to_every_loader(synthetic):
    cfg = parse_args(
        [f"--data_dir={synthetic}", "--input_order=one_stream", "--batch_size=4", "--num_classes=4"]
    )
    table, batches = open_split(cfg, "train", True, 1, 2)
    assert (table.input_order, table.batch_size, batches) == ("one_stream", 4, 120 // 2 // 4)
    whole = epoch_positions(table, True, cfg.seed, 0, 0, 1, cfg.shuffle_buffer)
    assert np.array_equal(epoch_positions(table, True, cfg.seed, 0, 1, 2, cfg.shuffle_buffer)[:4], whole[4:8])


def test_the_torch_loader_reads_the_one_stream_order(synthetic):
    # The loader is not told the order: open_split's table carries it. Rank 1 of 2, three batches of 4,
    # against the labels of the planned records read straight from the shards (4 classes: a loader that
    # read another order would match 12 labels by chance about once in 4**12).
    import torch

    from fasttrain.data import build_loader
    from fasttrain.data.imagenet import decode_record
    from fasttrain.data.tfrecord import read_record

    cfg = parse_args(
        [f"--data_dir={synthetic}", "--input_order=one_stream", "--batch_size=4", "--num_classes=4"]
        + ["--data_backend=torch", "--preprocess=resnet", "--image_size=32", "--num_workers=0"]
    )
    loader = build_loader(cfg, "train", training=True, rank=1, world_size=2, device=torch.device("cpu"))
    # Cloned: a batch stays valid only until the next is requested (thread_loader's contract).
    got = [labels.clone() for _, (_, labels) in zip(range(3), loader)]
    table = dataclasses.replace(loader.table, input_order="one_stream", batch_size=4)  # the plan, named
    planned = epoch_positions(table, True, cfg.seed, 0, 1, 2, cfg.shuffle_buffer)[:12]
    expected = []
    for position in planned.tolist():
        path = table.files[table.file_ids[position]]
        with open(path, "rb") as f:
            payload = read_record(f, int(table.offsets[position]), int(table.sizes[position]), path)
        expected.append(decode_record(payload, path, 0, cfg.label_offset, cfg.num_classes).label)
    assert torch.cat(got).tolist() == expected
