"""Which records a rank reads in an epoch, and in which order: a pure function of the index files.

The split is a table of N records (shards in name order, records in file order; a record's position in
this table is its *global position*). For epoch e of a run seeded s, rank r of W, batch B per rank:

    training:   shard order  = permutation of the shards, rng(s, e)
                stream       = records of the shards in that order (N of them)
      input_order rank_slices (fasttrain's):
                rank slice   = stream[r N // W : (r + 1) N // W]    (contiguous: mostly sequential reads)
                rank order   = tf.data's shuffle(buffer) applied to the slice, rng(s, e, r)
                kept         = its first N // W records (every rank the same count), cut into
                               N // W // B batches of B; the tail is dropped
      input_order one_stream (the ResNet seed's imagenet.py make_batch, one machine: files shuffled,
                flat_map(TFRecordDataset), shuffle(1500), batch(B), tower i taking every i-th batch):
                order        = tf.data's shuffle(buffer) applied to the whole stream, rng(s, e): the
                               same on every rank
                batches      = order cut into batches of B; batch k goes to rank k mod W, and every
                               rank keeps N // W // B of them (the records after the last full round
                               are dropped; with W = 1 the whole order is returned, its tail the
                               partial batch the loaders drop)
    evaluation: records[r N // W : (r + 1) N // W] in table order, cut into ceil(count / B) batches,
                the last one partial

so every record appears exactly once per epoch across ranks (up to the tail records dropped in
training), and the order depends only on (seed, epoch, world size, B) and the data, never on the
number of DataLoader workers. Knowing every batch's records without reading any data is what lets a
resumed run skip straight to batch b. `open_split(cfg, ...)` records cfg.input_order and cfg.batch_size
in the table it returns, so every loader's `epoch_positions(table, ...)` follows the run's order.

The seed's distributed mode (several workers) had each worker read the whole data set in its own
order; one_stream deals one stream over all ranks instead, so an epoch is N records on any world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fasttrain.data.errors import DataError, LabelRangeError
from fasttrain.data.imagenet import decode_record, list_shards
from fasttrain.data.tfrecord import load_index, read_record

# Labels read before training starts: the first records of the first shards (64 random reads, about
# 7 MB of ImageNet). The converter shuffles classes across shards, so a --label_offset or
# --num_classes that misfits a large part of the labels shows here; a misfit of one class in 1000
# may not (each record has a 1/1000 chance), and then the pipelines raise the same error mid-run.
_LABEL_CHECK_SHARDS = 8
_LABEL_CHECK_RECORDS = 8


@dataclass
class RecordTable:
    """Every record of a split: shard files and, per global position, (file id, offset, size)."""

    files: list[str]
    file_ids: np.ndarray  # (N,) int32 index into files
    offsets: np.ndarray  # (N,) int64 byte offset of the framed record
    sizes: np.ndarray  # (N,) int64 framed size (payload + 16)
    shard_starts: np.ndarray  # (num_shards + 1,) global position of each shard's first record
    input_order: str = "rank_slices"  # how training epochs are ordered (Config.input_order)
    batch_size: int = 0  # per rank: the unit one_stream deals to the ranks (open_split sets both)

    def __len__(self) -> int:
        return len(self.offsets)


def load_split(data_dir, split: str, cache_dir=None) -> RecordTable:
    """The split's record table, from (validated, built on demand) index files."""
    files, entries = [], []
    for shard in list_shards(data_dir, split):
        try:
            _, index = load_index(shard, cache_dir)
        except OSError as e:  # a shard that went away or became unreadable after it was listed
            raise DataError(f"cannot read shard {shard} ({e.strerror})") from None
        files.append(str(shard))
        entries.append(index)
    counts = np.array([len(e) for e in entries], dtype=np.int64)
    table = np.concatenate(entries) if entries else np.zeros((0, 2), np.int64)
    return RecordTable(
        files=files,
        file_ids=np.repeat(np.arange(len(files), dtype=np.int32), counts),
        offsets=table[:, 0].copy(),
        sizes=table[:, 1].copy(),
        shard_starts=np.concatenate([[0], np.cumsum(counts)]),
    )


def check_labels(table: RecordTable, label_offset: int, num_classes: int) -> None:
    """LabelRangeError if a label among the first records of the first shards misfits the flags.

    Corrupt records are left to the pipeline (and its --skip_corrupt); only labels are judged here.
    """
    for s in range(min(_LABEL_CHECK_SHARDS, len(table.files))):
        path = table.files[s]
        first, end = int(table.shard_starts[s]), int(table.shard_starts[s + 1])
        try:
            with open(path, "rb") as f:
                for position in range(first, min(end, first + _LABEL_CHECK_RECORDS)):
                    offset = int(table.offsets[position])
                    try:
                        payload = read_record(f, offset, int(table.sizes[position]), path)
                        decode_record(payload, path, offset, label_offset, num_classes)
                    except LabelRangeError:
                        raise
                    except DataError:
                        continue
        except OSError as e:
            raise DataError(f"cannot read shard {path} ({e.strerror})") from None


def shuffle_buffer_order(n: int, buffer_size: int, rng: np.random.Generator) -> np.ndarray:
    """The order in which tf.data's shuffle(buffer_size) emits elements 0..n-1.

    The buffer holds the first buffer_size elements; each step emits a uniformly chosen slot and
    refills it with the next input element; once the input is exhausted the buffer drains at random.
    """
    if buffer_size <= 1 or n <= 1:
        return np.arange(n)
    buffer = list(range(min(buffer_size, n)))
    following = len(buffer)
    uniforms = rng.random(n)
    out = np.empty(n, dtype=np.int64)
    for t in range(n):
        slot = int(uniforms[t] * len(buffer))
        out[t] = buffer[slot]
        if following < n:
            buffer[slot] = following
            following += 1
        else:
            buffer[slot] = buffer[-1]
            buffer.pop()
    return out


def rank_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    return rank * n // world_size, (rank + 1) * n // world_size


def epoch_positions(
    table: RecordTable, training: bool, seed: int, epoch: int, rank: int, world_size: int, shuffle_buffer: int
) -> np.ndarray:
    """Global positions of the records rank `rank` reads in `epoch`, in order (see the module doc)."""
    n = len(table)
    lo, hi = rank_range(n, rank, world_size)
    if not training:
        return np.arange(lo, hi, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch, 0x5A4D])
    starts = table.shard_starts
    stream = np.concatenate(
        [np.arange(starts[s], starts[s + 1]) for s in rng.permutation(len(starts) - 1)]
        or [np.zeros(0, np.int64)]
    )
    if table.input_order == "one_stream" and table.batch_size:
        return _dealt_batches(stream, table.batch_size, seed, epoch, rank, world_size, shuffle_buffer)
    mine = stream[lo:hi]
    mine = mine[
        shuffle_buffer_order(len(mine), shuffle_buffer, np.random.default_rng([seed, epoch, rank, 0x5B]))
    ]
    return mine[: n // world_size]


def _dealt_batches(
    stream: np.ndarray, batch: int, seed: int, epoch: int, rank: int, world_size: int, shuffle_buffer: int
) -> np.ndarray:
    """one_stream (module doc): the whole stream through one buffer, batch k to rank k mod W."""
    order = stream[
        shuffle_buffer_order(len(stream), shuffle_buffer, np.random.default_rng([seed, epoch, 0x1500]))
    ]
    if world_size == 1:
        return order
    rounds = len(stream) // world_size // batch
    return order[: rounds * world_size * batch].reshape(rounds, world_size, batch)[:, rank].reshape(-1)


def num_batches(n: int, training: bool, rank: int, world_size: int, batch_size: int) -> int:
    """Batches per epoch on `rank`: training drops the partial batch, evaluation keeps it."""
    if training:
        return n // world_size // batch_size
    lo, hi = rank_range(n, rank, world_size)
    return -(-(hi - lo) // batch_size)


def open_split(cfg, split: str, training: bool, rank: int, world_size: int) -> tuple[RecordTable, int]:
    """The split's record table and this rank's batches per epoch; DataError when training gets none,
    LabelRangeError when the first labels misfit --label_offset / --num_classes (check_labels)."""
    table = load_split(cfg.data_dir, split, cfg.data_cache_dir or None)
    table.input_order, table.batch_size = cfg.input_order, cfg.batch_size
    check_labels(table, cfg.label_offset, cfg.num_classes)
    batches = num_batches(len(table), training, rank, world_size, cfg.batch_size)
    if training and batches == 0:
        raise DataError(
            f"the {split} split of {cfg.data_dir} has {len(table)} records, fewer than "
            f"one batch per rank ({cfg.batch_size} x {world_size}); lower batch_size",
            settings=("batch_size",),
        )
    return table, batches
