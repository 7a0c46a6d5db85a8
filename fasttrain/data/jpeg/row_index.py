"""Per-shard sidecar files of JPEG checkpoints (fasttrain.data.jpeg.scan), memory-mapped by the loader.

A shard's sidecar lives where its tfrecord2idx index does (fasttrain.data.tfrecord.index_candidates:
beside the shard, else in the cache directory for a read-only data directory), named
`<shard>.rows` instead of `<shard>.idx`. Format, little-endian:

    header (56 bytes)  magic b"FTROWS\\0\\0", u32 version (1), u32 COLUMN_GROUP (scan.py's, checked),
                       u64 shard size, i64 shard mtime (ns), u64 records R, u64 checkpoint lines N,
                       u32 CRC32C of everything after the header, u32 0
    i64[R]             each record's offset in the shard (ascending, as in the .idx file)
    i64[R + 1]         first checkpoint line of record i; its lines are [start[i], start[i + 1])
                       (none: a progressive JPEG, a corrupt record, anything the scan leaves out)
    i16[N, 5]          the checkpoint lines (10 bytes each: fasttrain.data.jpeg.scan's format; about
                       2.7 kB per photo of the bench's set, 4% of its JPEG)

A sidecar is used only if the shard's size and mtime equal the header's, the file has exactly the
length the header implies and its CRC matches (0.5 ms for an ImageNet shard's; a damaged checkpoint
would give wrong pixels); else it is stale, truncated or damaged and `RowIndex.open` returns None (the
loader then decodes as before). `python -m fasttrain.data row-checkpoints DATA_DIR [--workers N]`
(`build_sidecars`) builds the sidecars of every train-* / validation-* shard.
"""

from __future__ import annotations

import argparse
import array
import bisect
import mmap
import multiprocessing
import os
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from google.protobuf.message import DecodeError

from fasttrain.data.errors import DataError
from fasttrain.data.example import parse_example
from fasttrain.data.imagenet import SPLITS, find_shards
from fasttrain.data.jpeg.scan import COLUMN_GROUP, row_checkpoints
from fasttrain.data.tfrecord import crc32c, index_candidates, load_index, read_record

MAGIC, VERSION = b"FTROWS\0\0", 1
_HEADER = struct.Struct("<8sIIQqQQII")


def sidecar_candidates(shard_path, cache_dir=None) -> list[Path]:
    """Where the sidecar of `shard_path` may live, in the order tfrecord's index files are looked for."""
    return [c.with_name(c.name[: -len(".idx")] + ".rows") for c in index_candidates(shard_path, cache_dir)]


class RowIndex:
    """The checkpoints of one shard's records, memory-mapped."""

    def __init__(self, path: Path, buffer, records: int, rows: int):
        self.path = path
        self._mmap = buffer
        at = _HEADER.size
        self.offsets = np.frombuffer(buffer, np.int64, records, at)
        self.starts = np.frombuffer(buffer, np.int64, records + 1, at + 8 * records)
        self.rows = np.frombuffer(buffer, np.int16, rows * 5, at + 16 * records + 8).reshape(rows, 5)
        # Lookups bisect array.array copies (8 bytes a record): 0.5 us, where np.searchsorted took 6.
        self._offsets = array.array("q", self.offsets.tobytes())
        self._starts = array.array("q", self.starts.tobytes())

    @classmethod
    def open(cls, shard_path, cache_dir=None) -> RowIndex | None:
        """The shard's sidecar, or None when there is none that matches the shard as it is now."""
        try:
            stat = os.stat(shard_path)
        except OSError:
            return None
        for candidate in sidecar_candidates(shard_path, cache_dir):
            index = cls._open_file(candidate, stat)
            if index is not None:
                return index
        return None

    @classmethod
    def _open_file(cls, path: Path, stat) -> RowIndex | None:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < _HEADER.size:
                    return None
                buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        magic, version, group, shard_size, mtime, records, rows, crc, _ = _HEADER.unpack_from(buffer)
        expected = _HEADER.size + 16 * records + 8 + 10 * rows
        if (magic, version, group) != (MAGIC, VERSION, COLUMN_GROUP) or size != expected:
            return None  # another format, or truncated
        if shard_size != stat.st_size or mtime != stat.st_mtime_ns:
            return None  # the shard changed since the sidecar was built
        if crc32c(buffer[_HEADER.size :]) != crc:  # an mmap slice is a bytes copy
            return None
        return cls(path, buffer, records, rows)

    def __len__(self) -> int:
        return self.offsets.size

    def checkpoints_at(self, i: int) -> np.ndarray | None:
        """The checkpoints of the shard's record number i (in file order), or None."""
        start, end = self._starts[i], self._starts[i + 1]
        return self.rows[start:end] if end > start else None

    def checkpoints(self, record_offset: int) -> np.ndarray | None:
        """The checkpoints of the record at byte `record_offset` of the shard, or None."""
        i = bisect.bisect_left(self._offsets, record_offset)
        if i == len(self._offsets) or self._offsets[i] != record_offset:
            return None
        return self.checkpoints_at(i)


ROW_INDEX_HINT = (
    "fasttrain: the shards have no JPEG row checkpoints; the images are the same without them, but the "
    "torch loader then takes up to a fifth more CPU per image: python -m fasttrain.data row-checkpoints "
    "DATA_DIR builds them once (about 0.6 CPU ms and 3 kB per image)"
)


class RowIndexes:
    """The row checkpoints of a loader's shards, by file id: each sidecar opened on first use, shared by
    the loader's threads (read-only memory maps), and opened afresh in each worker process."""

    def __init__(self, files, cache_dir=None):
        self.files, self.cache_dir = list(files), cache_dir
        self._open: dict[int, RowIndex | None] = {}
        self._lock = threading.Lock()

    def __getstate__(self):  # a worker process opens its own maps
        return {"files": self.files, "cache_dir": self.cache_dir}

    def __setstate__(self, state):
        self.__init__(state["files"], state["cache_dir"])

    def any_built(self) -> bool:
        """Whether the first shard has a current sidecar (they are built for a directory at once)."""
        return not self.files or self._index(0) is not None

    def _index(self, file_id: int) -> RowIndex | None:
        try:
            return self._open[file_id]
        except KeyError:
            with self._lock:
                if file_id not in self._open:
                    self._open[file_id] = RowIndex.open(self.files[file_id], self.cache_dir)
                return self._open[file_id]

    def checkpoints(self, file_id: int, record_offset: int) -> np.ndarray | None:
        index = self._index(file_id)
        return None if index is None else index.checkpoints(record_offset)


def _jpeg_of(payload: bytes) -> bytes | None:
    try:
        return parse_example(payload).features.feature["image/encoded"].bytes_list.value[0]
    except (DecodeError, KeyError, IndexError):
        return None


def build_row_index(shard_path, cache_dir=None, progress=None) -> Path:
    """Build and write the sidecar of `shard_path` (atomically, to the first writable candidate place);
    progress(done, total) is called every 256 records. A record that does not read or parse gets no
    checkpoints: the loader's normal path reports it."""
    shard_path = Path(shard_path)
    stat = os.stat(shard_path)
    _, entries = load_index(shard_path, cache_dir)
    starts, chunks, total = [0], [], 0
    with open(shard_path, "rb", buffering=0) as f:
        for i, (offset, size) in enumerate(entries):
            try:
                jpeg = _jpeg_of(read_record(f, int(offset), int(size), shard_path))
            except DataError:
                jpeg = None
            checkpoints = row_checkpoints(jpeg) if jpeg is not None else None
            if checkpoints is not None:
                chunks.append(checkpoints)
                total += checkpoints.shape[0]
            starts.append(total)
            if progress is not None and (i + 1) % 256 == 0:
                progress(i + 1, len(entries))
    rows = np.concatenate(chunks) if chunks else np.zeros((0, 5), np.int16)
    body = b"".join(
        (
            entries[:, 0].astype("<i8").tobytes(),
            np.asarray(starts, "<i8").tobytes(),
            rows.astype("<i2").tobytes(),
        )
    )
    header = _HEADER.pack(
        MAGIC, VERSION, COLUMN_GROUP, stat.st_size, stat.st_mtime_ns, len(entries), total, crc32c(body), 0
    )
    parts = (header, body)
    errors = []
    for candidate in sidecar_candidates(shard_path, cache_dir):
        try:
            _write_atomically(candidate, parts)
            return candidate
        except OSError as e:  # a read-only data directory: the cache directory next, as tfrecord does
            errors.append(f"{candidate.parent}: {e.strerror}")
    raise DataError(
        f"cannot write the row checkpoints of {shard_path} ({'; '.join(errors)}); "
        "set data_cache_dir to a writable directory",
        settings=("data_cache_dir",),
    )


def _write_atomically(path: Path, parts) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # readable by the other users of shared data, as the .idx files
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _build_job(args) -> tuple[str, int, float]:
    shard, cache_dir = args
    start = time.process_time()
    build_row_index(shard, cache_dir)
    return str(shard), len(load_index(shard, cache_dir)[1]), time.process_time() - start


COMMAND_HELP = (
    "Build the JPEG checkpoint sidecars (<shard>.rows) of every train-* and validation-* shard in "
    "DATA_DIR, so the loader skips the entropy decoding outside crop windows. A sidecar holds for its "
    "shard's size and mtime: rebuild after the shards are rewritten or copied without keeping mtimes."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The build's arguments, for `python -m fasttrain.data row-checkpoints` and the old spelling alike."""
    parser.add_argument("data_dir", metavar="DATA_DIR")
    parser.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--cache-dir", default=None, help="where sidecars go when DATA_DIR is read-only")
    parser.add_argument("--force", action="store_true", help="rebuild sidecars that are up to date")


def build_sidecars(data_dir, *, workers: int = 1, cache_dir=None, force: bool = False) -> None:
    """Build the sidecar of every train-* / validation-* shard in data_dir that has no current one (all
    of them with force), printing progress every 5 s; DataError when there are no shards."""
    shards = [s for split in SPLITS for s in find_shards(data_dir, split)]
    if not shards:
        raise DataError(f"no train-* or validation-* shards in {data_dir}; give the converter's output")
    todo = [s for s in shards if force or RowIndex.open(s, cache_dir) is None]
    counts = {str(s): len(load_index(s, cache_dir)[1]) for s in todo}
    print(
        f"rows: {len(shards) - len(todo)} of {len(shards)} shards up to date, {len(todo)} to build "
        f"({sum(counts.values())} images)",
        flush=True,
    )
    jobs = [(s, cache_dir) for s in todo]
    workers = max(1, min(workers, len(jobs)))
    start, done, images, cpu, shown = time.perf_counter(), 0, 0, 0.0, 0.0
    pool = multiprocessing.Pool(workers) if workers > 1 else None
    try:
        for shard, records, seconds in (
            pool.imap_unordered(_build_job, jobs) if pool else map(_build_job, jobs)
        ):
            done, images, cpu = done + 1, images + records, cpu + seconds
            elapsed = time.perf_counter() - start
            if elapsed - shown < 5 and done < len(jobs):
                continue  # a line every 5 s (an ImageNet shard takes about a second)
            shown = elapsed
            rate = images / max(elapsed, 1e-9)
            left = (sum(counts.values()) - images) / max(rate, 1e-9)
            print(
                f"rows: {done}/{len(jobs)} shards ({Path(shard).name}), {images} images, "
                f"{rate:.0f} images/s, {1e3 * cpu / max(images, 1):.2f} CPU ms/image, "
                f"ETA {left / 60:.1f} min",
                flush=True,
            )
    finally:
        if pool:
            pool.terminate()


def main(argv=None) -> int:
    """The build as `python -m fasttrain.data.jpeg_rows DATA_DIR ...` (the spelling before
    `python -m fasttrain.data row-checkpoints`) has always run it: one line and exit status 2 for a
    DATA_DIR without shards, as before (the data tools' subcommand says 1 for that, 2 for a DATA_DIR
    that is not a directory, as their other subcommands do)."""
    parser = argparse.ArgumentParser(prog="python -m fasttrain.data.jpeg_rows", description=COMMAND_HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        build_sidecars(args.data_dir, workers=args.workers, cache_dir=args.cache_dir, force=args.force)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
