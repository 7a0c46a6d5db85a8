"""The PyTorch input pipeline in DataLoader worker processes (Config.loader="processes"; the default,
threads in the training process, is fasttrain.data.thread_loader, which shares `SampleReader` and
gives the same batches): TFRecord shards -> the seeds' transforms as TensorFlow computes them
(fasttrain.data.transforms) -> uint8 NHWC batches.

Which records each rank reads, and in which batches, is planned from the index files alone
(fasttrain.data.sharding). DataLoader worker k of K builds batches k, k + K, k + 2K, ... of that plan,
and the DataLoader hands batches back round-robin in worker order, so the batch sequence is the plan's:
identical for any number of workers. Sample i's augmentation draws from a NumPy generator seeded with
(seed, epoch, global position of the record), never from a stream shared between samples, so a run
resumed at batch b (state_dict {'epoch', 'batch'}) reproduces batches b, b+1, ... bit for bit without
reading or decoding batches 0..b-1.

Bad records (CRC, Example, label, JPEG) raise DataError naming the shard and offset, or with
skip_corrupt are counted in `skipped` and left out: a training batch is topped up with copies of its
good images so its shape stays (B, S, S, 3) (static shapes for CUDA graphs); an evaluation batch
shrinks.

Batch assembly makes no extra copy: each worker allocates the batch tensor in shared memory and the
transforms write every image straight into its slot (no per-image arrays, no np.stack), so handing the
batch to the main process moves a handle, not 4.8 MB (32 x 224 x 224 x 3).
"""

from __future__ import annotations

import gc
import sys
import threading
from collections import OrderedDict

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from fasttrain.config import Config
from fasttrain.data import warm
from fasttrain.data.errors import DataError, LabelRangeError, ShardReadError, error_reason
from fasttrain.data.imagenet import SampleDecoder
from fasttrain.data.jpeg import fused
from fasttrain.data.jpeg.row_index import RowIndexes
from fasttrain.data.loader import EpochPosition
from fasttrain.data.seeding import SampleGenerator
from fasttrain.data.sharding import RecordTable, epoch_positions, open_split
from fasttrain.data.tfrecord import RecordBuffer
from fasttrain.data.transforms import eval_transform, train_transform, warm_up
from fasttrain.data.warm import warm_up_reader as _warm_up_reader
from fasttrain.stop_signals import ignore_stop_signals, stop_signals_blocked
from fasttrain.threads import available_cores, local_ranks, resolve_input, shared_memory_free, shm_shortage

_MAX_OPEN_FILES = 16


class _BatchDataset(IterableDataset):
    """One epoch of one rank's batches, from batch `start` on; each worker builds every K-th batch."""

    def __init__(
        self,
        table: RecordTable,
        positions: np.ndarray,
        start: int,
        count: int,
        cfg: Config,
        epoch: int,
        training: bool,
        row_indexes=None,
    ):
        self.table, self.positions, self.start, self.count = table, positions, start, count
        self.row_indexes = row_indexes
        self.cfg, self.epoch, self.training = cfg, epoch, training
        self.batch_size, self.image_size = cfg.batch_size, cfg.image_size
        self.skip_corrupt = cfg.skip_corrupt

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # One per worker (row_indexes opens its sidecars afresh in each worker process).
        self._reader = SampleReader(self.table, self.cfg, self.epoch, self.training, self.row_indexes)
        try:
            for j in range(self.start + worker, self.count, workers):
                try:
                    batch = self._batch(j)
                except DataError as e:
                    # Sent as data, not raised: the DataLoader would wrap it in a multi-line
                    # "Caught DataError in DataLoader worker" message and the workers would linger.
                    yield None, None, 0, e
                    return
                yield batch
        finally:
            self._reader.close()

    def _batch(self, j: int):
        positions = self.positions[j * self.batch_size : (j + 1) * self.batch_size]
        batch = _batch_tensor((len(positions), self.image_size, self.image_size, 3))
        images = batch.numpy()
        labels, skipped = [], 0
        for position in positions:
            try:
                labels.append(self._reader.sample(int(position), images[len(labels)]))
            except DataError as e:
                if not self.skip_corrupt or isinstance(e, LabelRangeError | ShardReadError):  # not a record's
                    raise
                sys.stderr.write(f"skipping: {error_reason(e)}\n")  # one write: workers share the pipe
                skipped += 1
        good = len(labels)
        if self.training and skipped:
            if not good:
                raise all_corrupt(j)
            for k in range(skipped):  # keep the static batch shape: repeat good images of this batch
                images[good + k] = images[k % good]
                labels.append(labels[k % good])
        elif skipped:
            batch = batch[:good]
        # Labels travel as a list: a tensor would cost one more shared-memory segment per batch,
        # whose descriptor the main process fetches over a socket.
        return batch, labels, skipped, None


class SampleReader:
    """One worker's (process or thread) record reading and transforms: its own open shards and scratch."""

    def __init__(self, table: RecordTable, cfg: Config, epoch: int, training: bool, row_indexes=None):
        self.table, self.epoch, self.training = table, epoch, training
        self.row_indexes = row_indexes  # RowIndexes, or None: decode without checkpoints
        self.image_size, self.preprocess, self.color_distort = (
            cfg.image_size,
            cfg.preprocess,
            cfg.color_distort,
        )
        self.label_offset, self.num_classes, self.seed = cfg.label_offset, cfg.num_classes, cfg.seed
        self._files: OrderedDict = OrderedDict()
        self._scratch = np.empty((self.image_size, self.image_size, 3), np.float32)
        self._generator = SampleGenerator()  # reseeded per sample: default_rng's state, 3x cheaper
        self._buffer = RecordBuffer()  # each record is read into it: no allocation per record
        self._decoder = SampleDecoder(self.label_offset, self.num_classes)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _file(self, file_id: int):
        # A small LRU of open shards: the shuffle buffer keeps each worker within a few shards.
        f = self._files.pop(file_id, None)
        if f is None:
            if len(self._files) >= _MAX_OPEN_FILES:
                self._files.popitem(last=False)[1].close()
            path = self.table.files[file_id]
            try:
                f = open(path, "rb")  # noqa: SIM115 - closed by the LRU / close()
            except OSError as e:  # deleted, moved or unreadable since the split was listed
                raise ShardReadError(f"cannot read shard {path} ({e.strerror})") from None
        self._files[file_id] = f
        return f

    def sample(self, position: int, out: np.ndarray) -> int:
        """Writes the record's transformed image into `out` (S, S, 3) uint8; returns its label."""
        table = self.table
        file_id, offset = int(table.file_ids[position]), int(table.offsets[position])
        path = table.files[file_id]
        payload = self._buffer.read(self._file(file_id), offset, int(table.sizes[position]), path)
        # jpeg may be a view into the record buffer: used up before the next read.
        jpeg, label, boxes = self._decoder.decode(self._buffer, payload, path, offset)
        if self.training:
            rng = self._generator.seeded((self.seed, self.epoch, position))  # = default_rng([...])
            rows = self.row_indexes
            # A sidecar's entry only for the bytes it was built for: the data CRC just read and checked.
            checkpoints = None if rows is None else rows.checkpoints(file_id, offset, self._buffer.data_crc)
            train_transform(
                jpeg,
                boxes,
                rng,
                self.image_size,
                self.preprocess,
                self.color_distort,
                path,
                offset,
                out=out,
                scratch=self._scratch,
                checkpoints=checkpoints,
            )
        else:
            eval_transform(
                jpeg, self.image_size, self.preprocess, path, offset, out=out, scratch=self._scratch
            )
        return label


# Seconds after which a warm-up still running says that it compiles (from numba's disk cache it takes
# about 1 s; a cold compile about a minute, bench/results/2026-11-27-cpu-numba-warm-up/).
COMPILE_NOTE_AFTER_S = 5.0


COLD_NOTE = (
    "compiling the input pipeline's numba kernels (the first run on this machine or of this fasttrain "
    "version: about a minute; cached for the runs after it; `python -m fasttrain.data warm-up` compiles "
    "them ahead, on several cores) ..."
)


def warm_up_kernels(rank: int = 0) -> None:
    """Compile (or load from numba's disk cache) every kernel the loaders run, here, before their
    workers or threads call them.

    Where the cache is cold (a first run on this machine or of a new fasttrain version: numba compiled
    colour's small kernels just now, fasttrain.data.warm.cold) and this process is its node's only rank
    with 4 or more cores, the kernels compile in fasttrain.data.warm's parts, several processes at once;
    else here, on one core. Past COMPILE_NOTE_AFTER_S, or at once where the parts run, rank 0 says on
    stderr that it compiles, rather than leaving the trainer silent for a minute before its first step."""
    say = (lambda line: print(f"fasttrain: {line}", file=sys.stderr, flush=True)) if rank == 0 else None
    note = threading.Timer(COMPILE_NOTE_AFTER_S, lambda: say(COLD_NOTE))
    note.daemon = True
    if say is not None:
        note.start()
    try:
        jobs = warm.parallel_jobs(local_ranks(), available_cores())
        if jobs > 1 and warm.cold():
            note.cancel()
            if say is not None:
                say(
                    "compiling the input pipeline's numba kernels (the first run on this machine or of "
                    f"this fasttrain version; cached for the runs after it) in {len(warm.PARTS)} parts, "
                    f"{jobs} processes at once ..."
                )
            try:
                warm.warm_up_parallel(jobs)  # then this process's warm-up, from the cache they leave
                return
            except OSError as e:  # no process could start (a limit, no interpreter at sys.executable)
                if say is not None:
                    say(f"the parts could not start ({e}); compiling here, on one core ...")
        warm_up()
        _warm_up_reader()
    finally:
        note.cancel()


def all_corrupt(j: int) -> DataError:
    return DataError(
        f"every record of training batch {j} is corrupt; run python -m fasttrain.data verify on the "
        "data directory"
    )


def _batch_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised uint8 tensor, in shared memory when made in a DataLoader worker.

    The DataLoader would otherwise copy each batch into shared memory to hand it over: allocating it
    there from the start saves that copy (2.4 ms instead of 8 ms for a 32 x 224 x 224 x 3 batch,
    filled, on this project's 2-core machine).
    """
    if get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8)
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # private: fall back without it
    if new_shared is None:
        return torch.empty(shape, dtype=torch.uint8).share_memory_()
    return torch.empty(0, dtype=torch.uint8).set_(new_shared(int(np.prod(shape)))).view(shape)


class ShardLoader(EpochPosition):
    """What the torch backend's two loaders share: this rank's record table, opened and checked once,
    the kernels compiled once (before workers or threads call them), and each epoch's plan."""

    normalized = False

    def __init__(self, cfg: Config, split: str, training: bool, rank: int = 0, world_size: int = 1):
        # --num_workers auto, built directly rather than by build_loader: pinned (CUDA) or not.
        cfg = resolve_input(cfg, torch.cuda.is_available(), "torch")
        self.cfg, self.split, self.training = cfg, split, training
        self.rank, self.world_size = rank, world_size
        self.table, self._len = open_split(cfg, split, training, rank, world_size)
        if not cfg.fused_decode:  # the separate decode and transform calls (fasttrain.data.jpeg.fused)
            fused.FUSED = False
        warm_up_kernels(rank)
        self.num_records = len(self.table)
        # The train decodes read the shards' JPEG row checkpoints where they were built (opened lazily).
        self.row_indexes = None
        if training and cfg.row_checkpoints:
            self.row_indexes = RowIndexes(self.table.files, cfg.data_cache_dir or None)
        # What the trainer prints with its start-up lines (fasttrain.train).
        self.notes = [] if self.row_indexes is None else self.row_indexes.note()

    def __len__(self) -> int:
        return self._len

    def _epoch_plan(self) -> tuple[np.ndarray, int] | None:
        """(the epoch's record positions, the batch to start from), or None when nothing is left."""
        cfg = self.cfg
        positions = epoch_positions(
            self.table, self.training, cfg.seed, self.epoch, self.rank, self.world_size, cfg.shuffle_buffer
        )
        start = self._begin_epoch()
        return None if start >= self._len else (positions, start)


class TorchLoader(ShardLoader):
    """The torch backend of the loader protocol in fasttrain.data (uint8 NHWC, pinned with CUDA)."""

    def __init__(self, cfg: Config, split: str, training: bool, rank: int = 0, world_size: int = 1):
        super().__init__(cfg, split, training, rank, world_size)
        # Deterministic runs use one worker (the config's promise); the batches are identical anyway.
        self.num_workers = min(self.cfg.num_workers, 1) if cfg.deterministic else self.cfg.num_workers
        n = self.num_workers
        self.description = f"torch, {n} DataLoader process{'es' * (n > 1)}" if n else "torch, in-process"
        if n and (short := shm_shortage(self.cfg, n, local_ranks(), shared_memory_free())):
            self.notes.append(f"note: {short}; or --loader threads")

    def __iter__(self):
        cfg = self.cfg
        if (plan := self._epoch_plan()) is None:
            return
        positions, start = plan
        dataset = _BatchDataset(
            self.table, positions, start, self._len, cfg, self.epoch, self.training, self.row_indexes
        )
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=min(self.num_workers, self._len - start),
            pin_memory=torch.cuda.is_available(),
            worker_init_fn=ignore_stop_signals,  # a preempted job's trainer saves; see stop_signals
            # Each iteration draws its workers' base seed from this generator, by default torch's global
            # one: a checkpoint saves that state after the epoch's draw, a resumed run draws again, and
            # the model's dropout masks then part from an uninterrupted run's. The batches use no torch
            # random number (their augmentation is seeded per record), so any fixed generator will do.
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        # The workers are forked here. Garbage the parent has not collected yet would be collected in a
        # child instead, whatever its finalizers need: a dropped DALI pipeline's __del__ waits there for
        # threads that the fork did not copy, and the worker hangs (seen in CI). Collected here, now.
        if loader.num_workers:
            gc.collect()
        with stop_signals_blocked():  # the workers start here
            batches = iter(loader)
        error = None
        for images, labels, skipped, error in batches:
            if error:
                break
            self.skipped += int(skipped)
            self._position += 1
            if len(labels):  # an evaluation batch whose records were all skipped
                # The labels arrive as a list, which the DataLoader's pin thread leaves as it is: pinned
                # here (torch's caching host allocator, microseconds), as the thread loader's are.
                labels = torch.tensor(labels, dtype=torch.int64)
                yield images, (labels.pin_memory() if loader.pin_memory else labels)
        if error:
            del batches  # stop the workers now rather than whenever the traceback is freed
            raise error
