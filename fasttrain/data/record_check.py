"""The CRC checks DALI leaves out: each batch's records, checked before the batch is trained on.

DALI's TFRecord reader checks no CRC, so a shard whose bytes changed after it was written (a bad disk,
an interrupted copy that left the length intact) would be decoded and trained on without a word, where
TensorFlow's reader and fasttrain's torch backend stop at the record. `RecordCheck` reads the records
of an epoch in the order the loader will hand them out, in a thread of its own that runs ahead of the
batches, and checks each one's length and data CRCs (fasttrain.data.tfrecord.read_record, the torch
reader's own check). The loader asks before it yields batch b (`check(b)`): it waits only if the thread
has not reached b yet, and raises the record's DataError if b holds a bad record, so the batches
before it train and the bad one never does, as with the torch backend.

Its cost: one read of each record from the page cache (DALI has just read it, or is about to) and its
CRC (google-crc32c's). Measured: 16-18 us of one core per record of 65 kB (photo shards in the page
cache, this project's 2-core VM, in epoch order), so about 30 us for ImageNet's 110 kB: a fifth of
a core at 6,600 images/s.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from fasttrain.data.errors import DataError, error_reason
from fasttrain.data.sharding import RecordTable
from fasttrain.data.tfrecord import read_record

# How far ahead of the batch being handed out the thread may read (batches): enough to stay ahead,
# little enough that a run stopped early has not read much more than it used.
AHEAD = 64
# Shards held open at once, the least recently read closed first (as the torch reader's LRU): holding
# every shard an epoch reaches ran out of file descriptors at ImageNet's 1,024 training shards under
# the common limit of 1,024, and the error named a healthy shard.
MAX_OPEN_SHARDS = 16


class RecordCheck:
    """Checks the records of `batches` (lists of global positions into `table`) in order, in a thread."""

    def __init__(self, table: RecordTable, batches: Sequence[np.ndarray], advice: str, settings=()):
        """advice: what a bad record's error ends with; settings: the Config fields it names."""
        self.table, self.batches, self.advice, self.settings = table, batches, advice, tuple(settings)
        self._checked = 0  # batches whose records are all good
        self._wanted = 0  # the batch the loader is about to hand out
        self._error: tuple[int, DataError] | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="fasttrain-record-check", daemon=True)
        self._thread.start()

    def check(self, b: int) -> None:
        """Return once batch b (an index into `batches`) is checked good; raise its DataError if not."""
        with self._cond:
            self._wanted = b
            self._cond.notify_all()
            while self._checked <= b and self._error is None:
                self._cond.wait()
            if self._error is not None and self._error[0] <= b:
                raise self._error[1]

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        files: OrderedDict[int, object] = OrderedDict()
        try:
            for b, positions in enumerate(self.batches):
                with self._cond:
                    while not self._stop and b > self._wanted + AHEAD:
                        self._cond.wait()
                    if self._stop:
                        return
                problem = self._first_problem(positions, files)
                with self._cond:
                    if problem is not None:
                        self._error = (b, problem)
                        self._cond.notify_all()
                        return
                    self._checked = b + 1
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the loader's thread, never lost here
            with self._cond:
                self._error = (-1, DataError(f"the record check stopped: {type(exc).__name__}: {exc}"))
                self._cond.notify_all()
        finally:
            for f in files.values():
                f.close()

    def _first_problem(self, positions: np.ndarray, files: OrderedDict) -> DataError | None:
        table = self.table
        for position in positions:
            file_id = int(table.file_ids[position])
            try:
                f = files.pop(file_id, None)
                if f is None:
                    if len(files) >= MAX_OPEN_SHARDS:
                        files.popitem(last=False)[1].close()
                    f = open(table.files[file_id], "rb")  # noqa: SIM115 - closed by the LRU or in _run
                files[file_id] = f
                read_record(f, int(table.offsets[position]), int(table.sizes[position]), table.files[file_id])
            except DataError as exc:
                number = int(position - table.shard_starts[file_id])
                reason = error_reason(exc)  # the torch reader's advice is not this backend's
                return DataError(
                    f"{reason}, record {number} of the shard; {self.advice}", settings=self.settings
                )
            except OSError as exc:
                return DataError(f"cannot read shard {table.files[file_id]} ({exc.strerror})")
        return None
