"""TFRecord framing: CRC-checked sequential and random-access reads, writing, and index files.

A TFRecord file is a sequence of records, each framed as (little-endian):

    u64 length | u32 masked_crc32c(length bytes) | data[length] | u32 masked_crc32c(data)

    masked_crc32c(b) = (((c >> 15) | (c << 17)) + 0xA282EAD8) mod 2^32,   c = crc32c(b)

so a record occupies length + 16 bytes. CRC32C (Castagnoli) comes from google-crc32c's C
implementation (about 10 GB/s with SSE4.2); a Python loop would make verification CPU bound.

Random access for a loader (`RecordBuffer`): one os.preadv per record into a buffer the reading thread
reuses, the CRCs computed in place by the library's crc32c_value (called through ctypes: the Python
binding takes only bytes), and the payload handed out as a memoryview of that buffer. A fresh bytes
object per record (read_record) cost 30-40 us of a 60 kB record: the allocation's page faults and a
second copy for the payload slice; the reused buffer costs about 10 us.

Index files use DALI's `tfrecord2idx` format: one line `offset size` per record, where `offset` is the
byte offset of the record's length field and `size` is the whole framed record, length + 16 (that is
what DALI's tools/tfrecord2idx writes: `f.tell() - current` after reading all four fields), so DALI's
fn.readers.tfrecord can use the same files. An index is cached beside its shard as `<shard>.idx`, or
under a cache directory when the data directory is not writable, and is checked against the shard
before use: it must not be older than the shard (mtime), its offsets must tile the file exactly and the
length fields of the first, middle and last records must agree with it. A stale or short index is
rebuilt. The mtime rule is what catches a shard rewritten with the same size and different record
boundaries in its middle (the converter re-run with another order): the sampled headers agree, and
reading would blame "length CRC mismatch" on the good shard. Its cost: a copy that leaves an index
older than its shard (cp without -p, the .idx copied first) rebuilds that index once, a header scan.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import google_crc32c
import numpy as np

from fasttrain.data.errors import DataError, ShardReadError

_HEADER = struct.Struct("<QI")  # length, masked CRC of the 8 length bytes
_FOOTER = struct.Struct("<I")  # masked CRC of the data
_U64 = struct.Struct("<Q")
_MASK_DELTA = 0xA282EAD8
FRAMING_BYTES = 16  # header 12 + footer 4


def crc32c(data) -> int:
    """CRC32C (Castagnoli) of a bytes-like object."""
    return google_crc32c.value(data)


def masked_crc32c(data) -> int:
    """TFRecord's masked CRC32C: rotate right by 15 bits, then add 0xA282EAD8 (mod 2^32)."""
    crc = google_crc32c.value(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def frame_record(data: bytes) -> bytes:
    """One record with its framing, as TensorFlow's TFRecordWriter writes it."""
    length = _U64.pack(len(data))
    return b"".join(
        (length, struct.pack("<I", masked_crc32c(length)), data, _FOOTER.pack(masked_crc32c(data)))
    )


def write_records(path, records: Iterable[bytes]) -> list[tuple[int, int]]:
    """Write `records` as a TFRecord file (uncompressed) and return its index [(offset, size)]."""
    index, offset = [], 0
    with open(path, "wb") as f:
        for data in records:
            framed = frame_record(data)
            f.write(framed)
            index.append((offset, len(framed)))
            offset += len(framed)
    return index


def _corrupted(offset: int, path, what: str) -> DataError:
    return DataError(
        f"corrupted record at offset {offset} in {path} ({what}); re-create the shard, "
        "or train with skip_corrupt",
        settings=("skip_corrupt",),
    )


def _truncated(offset: int, path, what: str) -> DataError:
    return DataError(
        f"truncated record at offset {offset} in {path} ({what}); the file is incomplete: re-copy it"
    )


def _stale_index(offset: int, path, actual: int, size: int) -> DataError:
    return DataError(
        f"record at offset {offset} in {path} is {actual} bytes but its index says {size}; delete the "
        "stale index file so it is rebuilt"
    )


def scan_records(
    path, verify: bool = True, read_data: bool = True
) -> Iterator[tuple[int, int, bytes | None]]:
    """Yield (offset, size, data) for each record, checking both CRCs when `verify`.

    With read_data=False only the 12-byte headers are read (data is None, its CRC unchecked).
    Raises DataError at the first bad record; `scan_records_tolerant` goes on past bad data CRCs.
    """
    for offset, size, data, error in scan_records_tolerant(path, verify, read_data):
        if error is not None:
            raise error
        yield offset, size, data


def scan_records_tolerant(
    path, verify: bool = True, read_data: bool = True
) -> Iterator[tuple[int, int, bytes | None, DataError | None]]:
    """Like scan_records, but a record whose data CRC fails is yielded with its error and the scan
    goes on; a bad length field or a truncation ends the scan (the framing after it is lost)."""
    file_size = os.path.getsize(path)
    with open(path, "rb", buffering=1 << 20) as f:
        offset = 0
        while offset < file_size:
            header = f.read(_HEADER.size)
            if len(header) < _HEADER.size:
                yield offset, 0, None, _truncated(offset, path, f"{len(header)} of 12 header bytes")
                return
            length, length_crc = _HEADER.unpack(header)
            if verify and masked_crc32c(header[:8]) != length_crc:
                yield offset, 0, None, _corrupted(offset, path, "length CRC mismatch")
                return
            size = length + FRAMING_BYTES
            if offset + size > file_size:
                yield (
                    offset,
                    0,
                    None,
                    _truncated(
                        offset, path, f"record of {size} bytes, {file_size - offset} left in the file"
                    ),
                )
                return
            if read_data:
                data = f.read(length)
                (data_crc,) = _FOOTER.unpack(f.read(4))
                error = None
                if verify and masked_crc32c(data) != data_crc:
                    error = _corrupted(offset, path, "data CRC mismatch")
                yield offset, size, data, error
            else:
                f.seek(length + 4, os.SEEK_CUR)
                yield offset, size, None, None
            offset += size


def iter_records(path, verify: bool = True) -> Iterator[tuple[int, bytes]]:
    """Yield (offset, payload) for every record of a TFRecord file, checking both CRCs by default."""
    for offset, _, data in scan_records(path, verify):
        yield offset, data


def read_record(f: BinaryIO, offset: int, size: int, path, verify: bool = True) -> bytes:
    """The payload of the framed record of `size` bytes at `offset` in the open file `f`."""
    f.seek(offset)
    framed = f.read(size)
    if len(framed) < size:
        raise _truncated(offset, path, f"{len(framed)} of {size} bytes")
    length, length_crc = _HEADER.unpack_from(framed)
    if verify and masked_crc32c(framed[:8]) != length_crc:
        raise _corrupted(offset, path, "length CRC mismatch")
    if length + FRAMING_BYTES != size:
        raise _stale_index(offset, path, length + FRAMING_BYTES, size)
    data = framed[12 : 12 + length]
    if verify and masked_crc32c(data) != _FOOTER.unpack_from(framed, 12 + length)[0]:
        raise _corrupted(offset, path, "data CRC mismatch")
    return data


def _crc_function():
    """crc32c_value(address, n) of the library google-crc32c's extension links, or None.

    PyDLL keeps the GIL over the call (6 us for a 60 kB record): cheaper than handing it to another
    thread and taking it back.
    """
    try:
        from google_crc32c import _crc32c

        function = ctypes.PyDLL(_crc32c.__file__).crc32c_value
    except (ImportError, OSError, AttributeError):
        return None
    function.restype, function.argtypes = ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t]
    return function


_crc_at = _crc_function()


class RecordBuffer:
    """One reading thread's reused buffer: `read` returns a record's payload as a view into it, valid
    until the next `read` (the errors are read_record's); `data_crc` is that record's footer, the masked
    CRC32C of its data as stored (what a row-checkpoint sidecar ties its entry to)."""

    data_crc = 0

    def __init__(self, size: int = 1 << 20):
        self._allocate(size)

    def _allocate(self, size: int) -> None:
        self.data = bytearray(size)
        self.view = memoryview(self.data)
        self.array = np.frombuffer(self.data, np.uint8)  # the same bytes, for NumPy and numba readers
        self.address = self.array.ctypes.data

    def _masked_crc(self, start: int, n: int) -> int:
        if _crc_at is None:
            crc = google_crc32c.value(bytes(self.view[start : start + n]))
        else:
            crc = _crc_at(self.address + start, n)
        return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF

    def read(self, f: BinaryIO, offset: int, size: int, path, verify: bool = True) -> memoryview:
        """The payload of the framed record of `size` bytes at `offset` in the open file `f`."""
        if size > len(self.data):
            self._allocate(max(size, 2 * len(self.data)))
        framed = self.view[:size]
        try:
            if _preadv is not None:  # one call (no shared file position), more only after a short read
                got, fd = 0, f.fileno()
                while got < size and (n := _preadv(fd, [framed[got:]], offset + got)):
                    got += n  # (a network file system may return less than asked before the end)
            else:
                f.seek(offset)
                got = f.readinto(framed) or 0
        except OSError as e:  # EIO from a failing disk, a network file system gone
            raise ShardReadError(f"cannot read shard {path} at offset {offset} ({e.strerror})") from None
        if got < size:
            raise _truncated(offset, path, f"{got} of {size} bytes")
        length, length_crc = _HEADER.unpack_from(framed)
        if verify and self._masked_crc(0, 8) != length_crc:
            raise _corrupted(offset, path, "length CRC mismatch")
        if length + FRAMING_BYTES != size:
            raise _stale_index(offset, path, length + FRAMING_BYTES, size)
        (self.data_crc,) = _FOOTER.unpack_from(framed, 12 + length)
        if verify and self._masked_crc(12, length) != self.data_crc:
            raise _corrupted(offset, path, "data CRC mismatch")
        return framed[12 : 12 + length]


_preadv = getattr(os, "preadv", None)


def build_index(path) -> list[tuple[int, int]]:
    """[(offset, size)] of every record, reading only the 12-byte headers (length CRC checked)."""
    return [(offset, size) for offset, size, _ in scan_records(path, verify=True, read_data=False)]


# --- index files -----------------------------------------------------------------------------


def index_candidates(path, cache_dir=None) -> list[Path]:
    """Where the index of shard `path` may live: beside it, then in the cache directory."""
    path = Path(path)
    if cache_dir is None:
        from fasttrain.config import default_cache_dir

        cache_dir = default_cache_dir()
    # One cache subdirectory per data directory, so shards with equal names do not collide.
    key = hashlib.sha1(str(path.resolve().parent).encode()).hexdigest()[:16]
    return [path.with_name(path.name + ".idx"), Path(cache_dir) / "index" / key / (path.name + ".idx")]


def read_index_file(index_path) -> np.ndarray:
    """(R, 2) int64 array of (offset, size) from a tfrecord2idx file; DataError if malformed."""
    text = Path(index_path).read_text(encoding="ascii", errors="replace")
    try:
        values = np.array(text.split(), dtype=np.int64)
    except (ValueError, OverflowError):  # OverflowError: a number beyond int64
        raise DataError(f"index file {index_path} is not lines of 'offset size'; delete it") from None
    if values.size % 2:
        raise DataError(f"index file {index_path} has an odd number of values; delete it")
    return values.reshape(-1, 2)


def check_index(path, entries: np.ndarray) -> str | None:
    """None if `entries` describes shard `path`, else the reason it does not."""
    file_size = os.path.getsize(path)
    if len(entries) == 0:
        return None if file_size == 0 else "empty index for a non-empty file"
    offsets, sizes = entries[:, 0], entries[:, 1]
    if offsets[0] != 0 or np.any(sizes < FRAMING_BYTES) or np.any(offsets[1:] != offsets[:-1] + sizes[:-1]):
        return "offsets do not tile the file"
    if offsets[-1] + sizes[-1] != file_size:
        return f"index covers {offsets[-1] + sizes[-1]} bytes, file has {file_size}"
    with open(path, "rb") as f:
        for i in sorted({0, len(entries) // 2, len(entries) - 1}):
            f.seek(int(offsets[i]))
            header = f.read(_HEADER.size)
            length, length_crc = _HEADER.unpack(header)
            if masked_crc32c(header[:8]) != length_crc or length + FRAMING_BYTES != sizes[i]:
                return f"record {i} at offset {offsets[i]} does not match"
    return None


def index_is_older(path, index_path) -> bool:
    """True if the shard was modified after its index file was written (the index may be stale)."""
    return os.stat(path).st_mtime_ns > os.stat(index_path).st_mtime_ns


def write_index_file(index_path, entries) -> None:
    """Write an index atomically (other ranks may be reading or writing the same file)."""
    index_path = Path(index_path)
    index_path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{int(o)} {int(s)}\n" for o, s in entries)
    fd, tmp = tempfile.mkstemp(dir=index_path.parent, prefix=index_path.name + ".", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the index from other users of shared data
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
        os.replace(tmp, index_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_index(path, cache_dir=None) -> tuple[Path, np.ndarray]:
    """(index path, (R, 2) entries) for shard `path`, validated; built and cached when needed."""
    candidates = index_candidates(path, cache_dir)
    for candidate in candidates:
        if candidate.is_file() and not index_is_older(path, candidate):
            try:
                entries = read_index_file(candidate)
            except DataError:
                continue  # malformed: rebuild below
            if check_index(path, entries) is None:
                return candidate, entries
    entries = np.array(build_index(path), dtype=np.int64).reshape(-1, 2)
    return save_index(path, entries, candidates), entries


def save_index(path, entries, candidates: list[Path]) -> Path:
    """Write the index to the first writable candidate location and return where it went."""
    errors = []
    for candidate in candidates:
        try:
            write_index_file(candidate, entries)
            return candidate
        except OSError as e:  # read-only data directory: fall through to the cache
            errors.append(f"{candidate.parent}: {e.strerror}")
    raise DataError(
        f"cannot write an index file for {path} ({'; '.join(errors)}); "
        "set data_cache_dir to a writable directory",
        settings=("data_cache_dir",),
    )


def ensure_index(path, cache_dir=None) -> Path:
    """Path of a valid tfrecord2idx index for shard `path` (built and cached on demand)."""
    return load_index(path, cache_dir)[0]
