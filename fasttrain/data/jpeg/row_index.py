"""Per-shard sidecar files of JPEG checkpoints (fasttrain.data.jpeg.scan), memory-mapped by the loader.

A shard's sidecar lives where its tfrecord2idx index does (fasttrain.data.tfrecord.index_candidates:
beside the shard, else in the cache directory for a read-only data directory), named
`<shard>.rows` instead of `<shard>.idx`. Format, little-endian:

    header (56 bytes)  magic b"FTROWS\\0\\0", u32 version (2), u32 COLUMN_GROUP (scan.py's, checked),
                       u64 shard size, i64 shard mtime (ns), u64 records R, u64 checkpoint lines N,
                       u32 CRC32C of everything after the header, u32 0
    i64[R]             each record's offset in the shard (ascending, as in the .idx file)
    i64[R + 1]         first checkpoint line of record i; its lines are [start[i], start[i + 1])
                       (none: a progressive JPEG, a corrupt record, anything the scan leaves out)
    u32[R]             each record's data CRC as the shard stored it (the TFRecord footer: the masked
                       CRC32C of the Example, JPEG included)
    i16[N, 5]          the checkpoint lines (10 bytes each: fasttrain.data.jpeg.scan's format; about
                       2.7 kB per photo of the bench's set, 4% of its JPEG)

A sidecar is used only if the shard's size and mtime equal the header's, the file has exactly the
length the header implies, its CRC matches (0.5 ms for an ImageNet shard's; a damaged checkpoint would
give wrong pixels) and so do the data CRCs of the shard's first, middle and last records (three 4-byte
reads); else it is stale, truncated or damaged: `RowIndex.open` returns None, `RowIndex.find` says why,
and the loader decodes as before. Size and mtime alone do not tie it to the bytes: a shard replaced by
another of the same size and mtime (rsync keeping times, `touch -r`) had its crops decoded with other
images' checkpoints, scrambled bands wherever the other scan started at the same bit. So each lookup
also names the record's data CRC, which the loader's reader has just read from its footer (and checked
against the bytes): an entry serves only the record whose CRC it stored, else it is stale (ignored,
counted, noted once). Format 1 (before the CRCs) cannot say which records it indexes: stale, and
`python -m fasttrain.data row-checkpoints DATA_DIR [--workers N]` (`build_sidecars`), which builds the
sidecars of every train-* / validation-* shard, rebuilds it without --force. `python -m fasttrain.data
verify` checks every entry.
"""

from __future__ import annotations

import array
import bisect
import mmap
import os
import struct
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
from google.protobuf.message import DecodeError

from fasttrain.data.errors import DataError
from fasttrain.data.example import parse_example
from fasttrain.data.jpeg.scan import COLUMN_GROUP, checkpoint_bits, row_checkpoints
from fasttrain.data.tfrecord import crc32c, index_candidates, load_index, read_record

MAGIC, VERSION = b"FTROWS\0\0", 2
_HEADER = struct.Struct("<8sIIQqQQII")
_FOOTER = struct.Struct("<I")  # a record's data CRC, its last 4 bytes
# Why RowIndex.find found a sidecar unusable (the notes and `verify` name it).
OTHER_FORMAT = "not a sidecar this fasttrain reads (another format, or truncated)"
OLDER_FORMAT = "built by an older fasttrain, without the record CRCs that tie it to the shard's records"
SHARD_CHANGED = "the shard changed since it was built (its size or modification time)"
DAMAGED = "damaged (its CRC does not match its contents)"
INCONSISTENT = "damaged (its entries cannot be those of the shard's JPEG scans)"
OTHER_RECORDS = (
    "built for other records than the shard holds now (it was replaced, keeping its size and "
    "modification time)"
)


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
        self.crcs = np.frombuffer(buffer, np.uint32, records, at + 16 * records + 8)
        self.rows = np.frombuffer(buffer, np.int16, rows * 5, at + 20 * records + 8).reshape(rows, 5)
        # Lookups bisect array.array copies (8 bytes a record): 0.5 us, where np.searchsorted took 6.
        self._offsets = array.array("q", self.offsets.tobytes())
        self._starts = array.array("q", self.starts.tobytes())
        self._crcs = array.array("I", self.crcs.tobytes())

    @classmethod
    def open(cls, shard_path, cache_dir=None) -> RowIndex | None:
        """The shard's sidecar, or None when there is none that matches the shard as it is now."""
        return cls.find(shard_path, cache_dir)[0]

    @classmethod
    def find(cls, shard_path, cache_dir=None) -> tuple[RowIndex | None, str | None]:
        """(the shard's current sidecar, None), or (None, why the first sidecar found is stale), or
        (None, None) when the shard has none."""
        try:
            stat = os.stat(shard_path)
        except OSError:
            return None, None
        problem = None
        for candidate in sidecar_candidates(shard_path, cache_dir):
            index, why = cls._open_file(candidate, shard_path, stat)
            if index is not None:
                return index, None
            problem = problem or why
        return None, problem

    @classmethod
    def _open_file(cls, path: Path, shard_path, stat) -> tuple[RowIndex | None, str | None]:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < _HEADER.size:
                    return None, OTHER_FORMAT
                buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError):
            return None, OTHER_FORMAT
        magic, version, group, shard_size, mtime, records, rows, crc, _ = _HEADER.unpack_from(buffer)
        if magic == MAGIC and version < VERSION:
            return None, OLDER_FORMAT
        expected = _HEADER.size + 20 * records + 8 + 10 * rows
        if (magic, version, group) != (MAGIC, VERSION, COLUMN_GROUP) or size != expected:
            return None, OTHER_FORMAT
        if shard_size != stat.st_size or mtime != stat.st_mtime_ns:
            return None, SHARD_CHANGED
        if crc32c(buffer[_HEADER.size :]) != crc:  # an mmap slice is a bytes copy
            return None, DAMAGED
        index = cls(path, buffer, records, rows)
        if not index.consistent(stat.st_size):
            return None, INCONSISTENT
        if records and index.first_mismatch(shard_path, (0, records // 2, records - 1)) is not None:
            return None, OTHER_RECORDS
        return index, None

    def consistent(self, shard_size: int) -> bool:
        """Whether the entries are possible for the shard's records (module docstring's layout): the
        CRC above finds damage, not a file written wrong on purpose or by a bug, whose values would
        reach the decode (which checks each position it uses, but takes the DC predictors as they are).
        Vectorised: about 10 ms for an ImageNet shard's sidecar, once per shard and process."""
        offsets, starts, rows = self.offsets, self.starts, self.rows
        records, lines = offsets.size, rows.shape[0]
        if records and (offsets[0] < 0 or np.any(np.diff(offsets) < 17) or offsets[-1] + 17 > shard_size):
            return False  # records ascending inside the shard, each at least its 16 framing bytes + 1
        if starts[0] != 0 or starts[-1] != lines or np.any(np.diff(starts) < 0):
            return False
        counts = np.diff(starts)
        bit = checkpoint_bits(rows)
        if np.any(bit[starts[:-1][counts > 0]] & 7):
            return False  # a record's first line is its scan's start, a whole byte
        same = np.repeat(np.arange(records), counts)
        if np.any((np.diff(bit) < 2) & (same[1:] == same[:-1])):
            return False  # within a record: forward, by an MCU (a DC code and an EOB: 2 bits) at least
        payload_bits = 8 * (np.diff(np.append(offsets, shard_size)) - 16)
        if np.any(bit >= np.repeat(payload_bits, counts)):
            return False  # inside the record
        return not np.any(np.abs(rows[:, 2:].astype(np.int32)) > 2047)  # 8-bit baseline DC values

    def __len__(self) -> int:
        return self.offsets.size

    def first_mismatch(self, shard_path, records=None) -> int | None:
        """The offset of the first of `records` (record numbers; default all) whose data CRC in the
        shard is not the one this sidecar stored, or None. One 4-byte read per record."""
        ends = list(self._offsets[1:]) + [os.path.getsize(shard_path)]
        with open(shard_path, "rb", buffering=0) as f:
            for i in range(len(self)) if records is None else records:
                footer = os.pread(f.fileno(), 4, max(ends[i] - 4, 0))
                if len(footer) < 4 or _FOOTER.unpack(footer)[0] != self._crcs[i]:
                    return self._offsets[i]
        return None

    def checkpoints_at(self, i: int) -> np.ndarray | None:
        """The checkpoints of the shard's record number i (in file order), or None."""
        start, end = self._starts[i], self._starts[i + 1]
        return self.rows[start:end] if end > start else None

    def find_record(self, record_offset: int) -> int:
        """The number of the record at byte `record_offset` of the shard, or -1."""
        i = bisect.bisect_left(self._offsets, record_offset)
        return i if i < len(self._offsets) and self._offsets[i] == record_offset else -1

    def checkpoints(self, record_offset: int, record_crc: int) -> np.ndarray | None:
        """The checkpoints of the record at byte `record_offset` whose data CRC (its footer's) is
        `record_crc`, or None (no such entry, or one built for other bytes)."""
        i = self.find_record(record_offset)
        return None if i < 0 or self._crcs[i] != record_crc else self.checkpoints_at(i)


def _builder_command(directory, cache_dir, force: bool = False) -> str:
    cache = f" --cache-dir {cache_dir}" if cache_dir else ""
    return f"python -m fasttrain.data row-checkpoints {directory}{' --force' if force else ''}{cache}"


_noted: set[str] = set()  # the start-up notes this process has given (one per data directory and state)


def _start_up_note(directory: Path, problem: str | None, cache_dir) -> str:
    if problem is None:
        return (
            f"fasttrain: the shards in {directory} have no JPEG row checkpoints; the images are the same "
            "without them, but the torch loader then takes up to a fifth more CPU per image: "
            f"{_builder_command(directory, cache_dir)} builds them once (about 0.6 CPU ms and 3 kB per image)"
        )
    return (
        f"fasttrain: the JPEG row checkpoints of the shards in {directory} are stale ({problem}), so the "
        "torch loader does not use them (the same images, up to a fifth more CPU per image): "
        f"{_builder_command(directory, cache_dir)} rebuilds them"
    )


class RowIndexes:
    """The row checkpoints of a loader's shards, by file id: each sidecar opened on first use, shared by
    the loader's threads (read-only memory maps), and opened afresh in each worker process.

    `checkpoints` checks each entry against the record's data CRC first; a stale sidecar or entry is
    not used, is counted in `stale_records` (the records decoded without their checkpoints for it) and
    noted once on stderr (once per worker process with loader=processes), unless the start-up note
    (`note()`) has said it already.
    """

    def __init__(self, files, cache_dir=None, noted: bool = False):
        self.files, self.cache_dir = list(files), cache_dir
        self._open: dict[int, RowIndex | None] = {}
        self._stale: set[int] = set()  # file ids whose sidecar was found stale when opened
        self._lock = threading.Lock()
        self.stale_records = 0
        self._noted = noted

    def __getstate__(self):  # a worker process opens its own maps
        return {"files": self.files, "cache_dir": self.cache_dir, "noted": self._noted}

    def __setstate__(self, state):
        self.__init__(state["files"], state["cache_dir"], state["noted"])

    def note(self) -> list[str]:
        """The trainer's start-up lines on these sidecars, judged by the first shard's (a directory's
        are built at once): none when it is current or this process has said the same already (once
        per data directory), else that they are missing, or stale and why, with the shards' directory
        and the command that builds them for it."""
        if not self.files:
            return []
        with self._lock:
            index, problem = RowIndex.find(self.files[0], self.cache_dir)
            self._open[0] = index  # opened once: the loader's first lookup in shard 0 takes it
            if problem is not None:
                self._stale.add(0)
                self._noted = True  # said at start-up (now or earlier in this process): not again
        if index is not None:
            return []
        note = _start_up_note(Path(self.files[0]).parent, problem, self.cache_dir)
        if note in _noted:
            return []
        _noted.add(note)
        return [note]

    def _index(self, file_id: int) -> RowIndex | None:
        try:
            return self._open[file_id]
        except KeyError:
            with self._lock:
                if file_id not in self._open:
                    index, problem = RowIndex.find(self.files[file_id], self.cache_dir)
                    if problem is not None:
                        self._stale.add(file_id)
                        self._note_once(file_id, f"are stale ({problem})")
                    self._open[file_id] = index
                return self._open[file_id]

    def checkpoints(self, file_id: int, record_offset: int, record_crc: int) -> np.ndarray | None:
        """The checkpoints of the record at `record_offset` of shard `file_id` whose footer holds data
        CRC `record_crc` (what the reader just read and checked), or None."""
        index = self._index(file_id)
        if index is None:
            if file_id in self._stale:
                with self._lock:
                    self.stale_records += 1
            return None
        i = index.find_record(record_offset)
        if i < 0:
            return None
        if index._crcs[i] != record_crc:  # checked before any stream is doctored
            with self._lock:
                self.stale_records += 1
                self._note_once(
                    file_id,
                    f"were built for another record at offset {record_offset} than the shard holds now "
                    "(it was replaced, keeping its size and modification time)",
                    force=True,
                )
            return None
        return index.checkpoints_at(i)

    def _note_once(self, file_id: int, what: str, force: bool = False) -> None:
        if self._noted:
            return
        self._noted = True
        shard = Path(self.files[file_id])
        sys.stderr.write(
            f"fasttrain: the JPEG row checkpoints of {shard} {what}; the torch loader decodes its "
            "images without them (the same images, more CPU) and counts them: "
            f"{_builder_command(shard.parent, self.cache_dir, force)} rebuilds them\n"
        )


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
    starts, chunks, total, crcs = [0], [], 0, []
    with open(shard_path, "rb", buffering=0) as f:
        for i, (offset, size) in enumerate(entries):
            try:
                jpeg = _jpeg_of(read_record(f, int(offset), int(size), shard_path))
            except DataError:
                jpeg = None
            # The record's footer as stored (the loader compares the footer it reads with it).
            footer = os.pread(f.fileno(), 4, int(offset) + int(size) - 4)
            crcs.append(_FOOTER.unpack(footer)[0] if len(footer) == 4 else 0)
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
            np.asarray(crcs, "<u4").tobytes(),
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
