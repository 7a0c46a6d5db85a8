"""The torch backend's default loader: decode and transform in a pool of threads of the training process.

The records, batches and per-sample random numbers are exactly those of the DataLoader-process loader
(fasttrain.data.torch_pipeline; both build a sample with its `SampleReader`): the epoch's plan comes
from the index files (fasttrain.data.sharding), sample i of the plan draws from a generator seeded
with (seed, epoch, global position), so the images are bit for bit the same, whichever thread makes
which sample. What changes is where the work runs and where the pixels go:

    buffers by default (reuse_buffers=False) each batch gets its own (B, S, S, 3) uint8 and (B,) int64
            tensors (pinned with CUDA) when its first sample is taken: the caller owns what it is
            handed and may keep it (a list of an epoch's batches). With reuse_buffers=True (the
            trainer's) a ring of R = hold + 2 batch buffers is allocated once per epoch and batch j
            lives in slot j mod R (the consumer contract below).
    work    the threads take the plan's samples one at a time, in order, from a shared counter; a
            thread reads the record itself (its own open shards: file read, CRC, Example parsing,
            decode, transform) and writes the image straight into its row of batch j's slot.
    order   the consumer receives batch j once all its samples are done; batches come out in plan
            order whatever the thread count.
    reuse   (ring) slot j mod R is written for batch j only after the consumer has asked for batch
            j - R + hold, i.e. released batch j - R (see `hold` below); with CUDA the writer first
            waits for a CUDA event recorded at that release, so copies the consumer enqueued from
            the pinned buffer (non_blocking .to() / static-input copy_, fasttrain.step) finish
            before the bytes change.

So no batch is pickled or put in shared memory, no process boundary is crossed, and no batch is
copied. The ring's consumer contract: **a yielded batch stays valid until `hold` more batches have
been requested** (hold = grad_accum_steps for training, which is how many micro-batches
fasttrain.train.batch_stream keeps at once; 1 for evaluation); a batch kept longer would show later
batches' pixels, which is why the ring is the trainer's option and not the default. What the default
costs (bench/bench_loader_buffers.py, bench/results/2026-11-27-cpu-loader-buffers/): the fresh
tensors' allocation and first-touch page faults, paid by the threads, 0.7-1.1 CPU ms per batch of 32
x 224 x 224 x 3 (+2.6-3.7%). A thread waits for a slot's event once: the first to see it complete
clears it for the slot's other samples (tests/test_thread_loader_time.py runs the ring with stand-in
events; real CUDA events run only on a GPU).

Where the time goes: each thread keeps its own ThreadTime (fasttrain/data/thread_loader_time.py: wall
and CPU time inside samples, waits for a slot and for the GPU), and the consumer's wait for batches is
added; `ThreadLoader.thread_time()` sums them, for the trainer's input-bound line and
bench/loader_alone.py. A wait going on when it is read counts up to then (the reading's `at`): each
interval's waits fit in the time between its two readings. Per sample that costs two wall-clock and two
thread CPU-clock reads, about 1 us with the GIL held (a CPU-clock read is a system call, 0.45 us on the
project's VM), beside about 49 us of GIL-held work per image (perf, one thread).

Threads and the GIL: the JPEG decoders (simplejpeg; TurboJPEG's decode through ctypes.CDLL, whose
calls drop the GIL, or from the train transforms' fused numba call, fasttrain.data.jpeg.fused), the
transforms' numba kernels (nogil=True) and file reads run without the GIL.
What holds it is small beside them: per image (ResNet 224, one thread, the benchmark's photos) the
read into a reused buffer with both CRCs 0.015 ms, the Example scan 0.004 ms, the seeding and the
crop search 0.001 ms each (one numba kernel each, fasttrain.data.example / seeding / transforms;
calls of a few microseconds keep the GIL, as TurboJPEG's header calls do through a PyDLL, since
handing it over and taking it back costs a thread more), against about 0.75 ms of decode and
0.17 ms of resize. Each thread reads its own records, so reading parallelises with the rest. Each
time a thread drops the GIL it may have to wait for it back behind the others, so the drops per
image count too: 2.04 (perf's count of take_gil per image, one thread, ResNet train transform with
row checkpoints: the record's read, then the doctored stream, the decode and the resize in one call,
fasttrain.data.jpeg.fused; vgg's 2.05, Inception's with colour 2.04), down from 3.88 with those three
as separate calls (Inception's 4.89, 5.90 when its colour draws dropped it too) and 5.89 when the
crop search's kernel and the JPEG header read dropped it as well.

Errors, as in the process loader: a bad record raises DataError naming shard and offset when the
consumer reaches its batch (one line); with skip_corrupt it is counted, reported on stderr, and a
training batch is compacted and topped up with copies of its good images (the same copies the
process loader makes); an evaluation batch shrinks. SIGTERM/SIGINT: the threads start with both
signals blocked, so the kernel delivers them to the main thread, whose handler (fasttrain.monitor)
asks the trainer to stop. Ending the iteration (exhausted, closed, or an exception in the consumer)
stops and joins every thread; a thread finishes the sample it is on first (milliseconds).
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import torch

from fasttrain.config import Config
from fasttrain.data.errors import DataError, LabelRangeError, ShardReadError, error_reason
from fasttrain.data.thread_loader_time import ThreadTime
from fasttrain.data.torch_pipeline import SampleReader, ShardLoader, all_corrupt
from fasttrain.stop_signals import stop_signals_blocked

PREFETCH = 2  # batches made ahead of the consumer: enough to cover one slow sample's jitter


class ThreadLoader(ShardLoader):
    """The torch backend of the loader protocol, threads in this process (uint8 NHWC, pinned with CUDA)."""

    def __init__(
        self,
        cfg: Config,
        split: str,
        training: bool,
        rank: int = 0,
        world_size: int = 1,
        hold: int = 1,
        reuse_buffers: bool = False,
    ):
        """reuse_buffers: the ring of the module docstring (a batch valid until `hold` more are
        requested) instead of fresh tensors per batch."""
        super().__init__(cfg, split, training, rank, world_size)
        # num_workers 0 means "no helper processes" to the process loader: here one thread.
        self.num_threads = 1 if cfg.deterministic else max(1, self.cfg.num_workers)
        self.hold = max(1, hold)
        self.reuse_buffers = reuse_buffers
        self.description = f"torch, {self.num_threads} loader thread{'s' if self.num_threads > 1 else ''}"
        self._spent = ThreadTime()  # the finished epochs' threads, summed
        self._epoch: _Epoch | None = None

    def thread_time(self) -> ThreadTime:
        """Where the loader threads' time went so far, all epochs (see ThreadTime); subtract two
        readings for an interval. Read without locks: a running thread's last sample may be missing."""
        at = time.perf_counter()
        total = ThreadTime(**vars(self._spent))
        if self._epoch is not None:
            total.add(self._epoch.thread_time(at))
        total.at = at
        return total

    def __iter__(self):
        if (plan := self._epoch_plan()) is None:
            return
        positions, start = plan
        epoch = self._epoch = _Epoch(self, positions, start)
        try:
            for j in range(start, self._len):
                images, labels, skipped = epoch.get(j)
                self.skipped += skipped
                self._position += 1
                if len(labels):  # an evaluation batch whose records were all skipped
                    yield images, labels
        finally:
            epoch.close()
            self._spent.add(epoch.thread_time(time.perf_counter()))
            self._epoch = None


class _Epoch:
    """One epoch's threads and ring; `get(j)` hands out batch j (start <= j < count, in order)."""

    def __init__(self, loader: ThreadLoader, positions: np.ndarray, start: int):
        cfg = loader.cfg
        self.cfg, self.table, self.training, self.epoch = cfg, loader.table, loader.training, loader.epoch
        self.row_indexes = loader.row_indexes
        self.positions, self.start, self.count, self.hold = positions, start, loader._len, loader.hold
        b = cfg.batch_size
        self.batch_size = b
        self.total = min(len(positions), self.count * b) - start * b  # samples left in the epoch
        self.slots = slots = self.hold + PREFETCH  # batches made ahead bound the threads either way
        self.cuda = torch.cuda.is_available()  # pinned buffers
        self.ordered = loader.reuse_buffers and _release_events()  # the ring's reuse waits for CUDA events
        # The ring's buffers (reuse_buffers), made once; else each _Batch allocates its own.
        self.ring = [self._buffers() for _ in range(slots)] if loader.reuse_buffers else None
        self.events: list = [None] * slots  # CUDA, ring: the consumer's copies out of each slot
        self.cond = threading.Condition()
        self.next_sample = 0  # the next sample (counted from batch `start`) a thread takes
        self.released = start  # batches below this one the consumer no longer holds
        self.stopping = False
        self.failure: BaseException | None = None  # a thread that died outside a sample's try
        self.batches: dict[int, _Batch] = {}  # batches being made or ready, by index
        self.threads = []
        self.clocks = [ThreadTime(threads=1) for _ in range(loader.num_threads)]  # each its thread's own
        # Each thread's wait going on now (its clock's field, since when), set and cleared under the lock:
        # a reading counts it up to then, so a wait across two readings is split between their intervals
        # (counted when it ended, the whole of a long one fell in the later one, over 100% of it).
        self.waiting: list[tuple[str, float] | None] = [None] * loader.num_threads
        self.consumer_wait_s = 0.0
        with stop_signals_blocked():  # the threads inherit the mask: signals go to the main thread
            for k in range(len(self.clocks)):
                t = threading.Thread(target=self._work, args=(k,), name=f"fasttrain-loader-{k}", daemon=True)
                t.start()
                self.threads.append(t)

    def get(self, j: int):
        """(images, labels, skipped) of batch j, raising its error; releases batch j - hold."""
        with self.cond:
            released = max(self.released, j - self.hold + 1)
            if released > self.released and self.ordered:
                for i in range(self.released, released):  # the copies enqueued so far come first
                    self.events[i % self.slots] = _recorded_event()
            self.released = released
            self.cond.notify_all()
            if not (j in self.batches and self.batches[j].ready):
                waited = time.perf_counter()
                while not (j in self.batches and self.batches[j].ready):
                    if self.failure is not None:
                        raise self.failure
                    self.cond.wait()
                self.consumer_wait_s += time.perf_counter() - waited
            batch = self.batches.pop(j)
        if batch.error is not None:
            raise batch.error
        images, labels = batch.images, batch.labels
        # An evaluation batch shrinks by its skipped records, and the last one may be partial.
        rows = batch.size if self.training else batch.good
        if rows < len(labels):
            images, labels = images[:rows], labels[:rows]
        return images, labels, batch.skipped

    def thread_time(self, at: float) -> ThreadTime:
        """The threads' clocks summed, with the waits going on counted up to `at` (perf_counter)."""
        total = ThreadTime(consumer_wait_s=self.consumer_wait_s)
        with self.cond:
            for clock, waiting in zip(self.clocks, self.waiting, strict=True):
                total.add(clock)
                if waiting is not None:
                    field, since = waiting
                    setattr(total, field, getattr(total, field) + max(0.0, at - since))
        total.threads = len(self.clocks)
        return total

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for t in self.threads:
            t.join()

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
        """One batch's (images (B, S, S, 3) uint8, labels (B,) int64), pinned with CUDA, and NumPy
        views of them, made once: Tensor.numpy() per sample costs microseconds of GIL."""
        b, s = self.batch_size, self.cfg.image_size
        images = torch.empty((b, s, s, 3), dtype=torch.uint8, pin_memory=self.cuda)
        labels = torch.empty(b, dtype=torch.int64, pin_memory=self.cuda)
        return images, labels, images.numpy(), labels.numpy()

    def _take(self, k: int):
        """(j, i, batch, event) of thread k's next sample to make, or None when there is none or we stop."""
        with self.cond:
            try:
                while True:
                    if self.stopping or self.next_sample >= self.total:
                        return None
                    u = self.next_sample
                    j, i = self.start + u // self.batch_size, u % self.batch_size
                    if j < self.released + self.slots:  # its slot is free (ring), or not too far ahead
                        break
                    if self.waiting[k] is None:
                        self.waiting[k] = ("slot_wait_s", time.perf_counter())
                    self.cond.wait()
            finally:  # a wait the stop ended counts too: a reading may have counted it already
                self._waited(k)
            self.next_sample += 1
            batch = self.batches.get(j)
            if batch is None:
                size = len(self.positions[j * self.batch_size : (j + 1) * self.batch_size])
                # Fresh buffers are allocated here, under the lock: microseconds (pinned ones come
                # from torch's caching host allocator); the pages are touched by the threads' writes.
                buffers = self.ring[j % self.slots] if self.ring is not None else self._buffers()
                batch = self.batches[j] = _Batch(size, *buffers)
            return j, i, batch, self.events[j % self.slots] if self.ordered else None

    def _waited(self, k: int) -> None:
        """Add thread k's wait going on, if any, to its clock (under the lock)."""
        if self.waiting[k] is not None:
            field, since = self.waiting[k]
            clock = self.clocks[k]
            setattr(clock, field, getattr(clock, field) + time.perf_counter() - since)
            self.waiting[k] = None

    def _work(self, k: int) -> None:
        try:
            self._work_on(k)
        except BaseException as e:  # noqa: BLE001 - the consumer would otherwise wait forever
            with self.cond:
                self.failure = self.failure or e
                self.cond.notify_all()

    def _work_on(self, k: int) -> None:
        clock = self.clocks[k]
        reader = SampleReader(self.table, self.cfg, self.epoch, self.training, self.row_indexes)
        try:
            while (task := self._take(k)) is not None:
                j, i, batch, event = task
                if event is not None:
                    with self.cond:  # once a slot, not a sample: the lock costs microseconds here
                        self.waiting[k] = ("gpu_wait_s", time.perf_counter())
                    try:
                        event.synchronize()
                    finally:
                        with self.cond:
                            self._waited(k)
                    # Done: the slot's later samples need not ask (a driver call and a GIL hand-over
                    # each). Its next event comes at batch j's release, after this sample is made.
                    self.events[j % self.slots] = None
                started, cpu = time.perf_counter(), time.thread_time()
                label, error = None, None
                try:
                    position = int(self.positions[j * self.batch_size + i])
                    label = reader.sample(position, batch.image_array[i])
                    batch.label_array[i] = label
                except DataError as e:
                    if not self.cfg.skip_corrupt or isinstance(e, LabelRangeError | ShardReadError):
                        error = e  # a flag mistake, or a shard gone: not a record's fault
                    else:
                        sys.stderr.write(f"skipping: {error_reason(e)}\n")
                except Exception as e:  # noqa: BLE001 - a bug or MemoryError: raised in the consumer
                    error = e
                clock.cpu_s += time.thread_time() - cpu
                clock.work_s += time.perf_counter() - started
                clock.images += 1
                self._done(j, i, batch, label, error)
        finally:
            reader.close()

    def _done(self, j: int, i: int, batch: _Batch, label, error) -> None:
        with self.cond:
            batch.record(i, label, error)
            if batch.finished < batch.size:
                return
        batch.finish(j, self.training)
        with self.cond:
            batch.ready = True
            self.cond.notify_all()


def _release_events() -> bool:
    """Whether a reused slot waits for a CUDA event: with CUDA the consumer's copies out of a pinned
    slot are asynchronous."""
    return torch.cuda.is_available()


def _recorded_event():
    """A CUDA event recorded on the current stream: the release of a slot."""
    event = torch.cuda.Event()
    event.record()
    return event


class _Batch:
    """One batch's buffers and its samples done so far: good rows, skips and the first error (by row)."""

    def __init__(self, size: int, images, labels, image_array, label_array):
        self.images, self.labels = images, labels  # (B, S, S, 3) uint8, (B,) int64
        self.image_array, self.label_array = image_array, label_array  # NumPy views of them
        self.size, self.finished, self.ready = size, 0, False
        self.good_rows = np.zeros(size, bool)
        self.error_row, self.error = size, None

    @property
    def good(self) -> int:
        return int(self.good_rows.sum())

    @property
    def skipped(self) -> int:
        return self.size - self.good if self.error is None else 0

    def record(self, i: int, label, error) -> None:
        self.finished += 1
        if error is not None and i < self.error_row:  # the process loader meets row order's first
            self.error_row, self.error = i, error
        self.good_rows[i] = label is not None

    def finish(self, j: int, training: bool) -> None:
        """Move the good rows to the front (in order); top a training batch up as the process loader does."""
        if self.error is not None or self.good == self.size:
            return
        rows = np.flatnonzero(self.good_rows)
        images, labels = self.image_array, self.label_array
        for k, row in enumerate(rows):  # row >= k: copying forwards never overwrites a pending row
            if row != k:
                images[k], labels[k] = images[row], labels[row]
        good = len(rows)
        if not training:
            return
        if not good:
            self.error = all_corrupt(j)
            return
        for k in range(self.size - good):
            images[good + k], labels[good + k] = images[k % good], labels[k % good]
