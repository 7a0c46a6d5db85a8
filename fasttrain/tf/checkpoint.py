"""TensorFlow checkpoints without TensorFlow: read V2 bundles and V1 tables, write V2 bundles.

    ckpt = open_checkpoint("runs/tf/model.ckpt-1234")   # a prefix, or a directory with a `checkpoint` file
    ckpt.shapes()  -> {"conv0/weights": ((3, 3, 3, 32), dtype('float32')), "note": ((), None), ...}
    ckpt.get("conv0/weights")  -> np.ndarray (TF's layout, HWIO for a conv kernel)
    write_checkpoint("out/model.ckpt-0", {"global_step": np.int64(0), ...})   # V2, + out/checkpoint

A variable of a dtype not read here (string, ...) is listed by shapes() with dtype None, and get() of
it is an error. Every failure a user can meet (missing or truncated file, bad checksum, a file that is
not TF's, get() of an unsupported dtype) is a CheckpointError in one line naming the file, and the byte
offset where one applies. Source of the layouts: tensorflow/core/lib/io/{format,block,table}.cc,
core/util/tensor_bundle/tensor_bundle.{h,cc,proto}, core/util/saved_tensor_slice{.proto,_util.cc},
core/lib/strings/ordered_code.cc.

The container of both versions is an SSTable (fasttrain/tf/table.py states its layout).

V2 (TF >= 0.12, Saver's default): PREFIX.index is a table. Key "" -> BundleHeaderProto {num_shards=1,
endianness=2 (0 little), version=3 {producer=1, min_consumer=2}}; every other key, a variable's full
name, sorted -> BundleEntryProto {dtype=1, shape=2, shard_id=3, offset=4, size=5, crc32c=6 (fixed32,
masked crc32c of the bytes), slices=7}. The bytes are PREFIX.data-{shard_id:05d}-of-{num_shards:05d}
[offset, offset+size), the tensor in C order, little endian. A partitioned variable (entry.slices, its
parts under keys that start with byte 0) and string tensors are refused by get() with a clear error.

V1 (TF until 2016; `Saver(write_version=V1)` still writes it): read by fasttrain/tf/checkpoint_v1.py,
which states its layout. The protobuf messages are in fasttrain/tf/proto.py.
"""

from __future__ import annotations

import codecs
import math
import os
import re
import struct
from pathlib import Path

import numpy as np

from fasttrain.checkpoint import CheckpointError, os_error_text, write_atomic
from fasttrain.data.tfrecord import masked_crc32c
from fasttrain.tf.checkpoint_v1 import CheckpointV1
from fasttrain.tf.proto import (
    _MSG,
    DTYPE_CODES,
    _dtype,
    _finish,
    _Mapped,
    _parse,
    _read_as,
    _shape,
)
from fasttrain.tf.table import FOOTER_BYTES, TABLE_MAGIC, build_table, read_table

# --- V2 reader -----------------------------------------------------------------------------------


class CheckpointV2:
    """A V2 bundle: PREFIX.index and its PREFIX.data-* shards."""

    version = "V2"

    def __init__(self, prefix: Path):
        self.prefix = prefix
        index = Path(f"{prefix}.index")
        self.index_path = index
        self.entries, header = {}, None
        for key, value, offset in read_table(_Mapped(index).data, index):
            if key == b"":
                header = _parse("BundleHeaderProto", value, index, offset)
            elif not key.startswith(b"\x00"):  # keys from byte 0 are a partitioned variable's parts
                name = key.decode("utf-8", "replace")
                if name in self.entries:  # two keys that are not UTF-8, decoded alike: one would be lost
                    raise CheckpointError(
                        f"{index} is corrupt: the key at offset {offset} names {name!r} again (not UTF-8)"
                    )
                self.entries[name] = _parse("BundleEntryProto", value, index, offset)
        if header is None:
            raise CheckpointError(f"{index} has no bundle header: not a TensorFlow V2 checkpoint index")
        if header.endianness != 0:
            raise CheckpointError(f"{index} was written big-endian, which is not supported")
        if header.version.min_consumer > 1:
            raise CheckpointError(
                f"{index} needs a newer reader (bundle min_consumer {header.version.min_consumer})"
            )
        self.num_shards = max(1, header.num_shards)
        self._shards: dict[int, _Mapped] = {}

    def shapes(self) -> dict[str, tuple[tuple[int, ...], np.dtype | None]]:
        return {n: (_shape(e.shape, n, self.index_path), _read_as(e.dtype)) for n, e in self.entries.items()}

    def get(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        if entry.slices:
            raise CheckpointError(
                f"{self.index_path}: variable {name} is partitioned, which is not supported"
            )
        dtype, shape = _dtype(entry.dtype, name, self.index_path), _shape(entry.shape, name, self.index_path)
        if entry.shard_id >= self.num_shards or entry.shard_id < 0:
            raise CheckpointError(
                f"{self.index_path} is corrupt: variable {name} names shard {entry.shard_id}"
            )
        if entry.size != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(
                f"{self.index_path} is corrupt: variable {name} of shape {shape} has {entry.size} bytes"
            )
        if entry.shard_id not in self._shards:
            path = Path(f"{self.prefix}.data-{entry.shard_id:05d}-of-{self.num_shards:05d}")
            if not path.is_file():
                raise CheckpointError(f"{path} is missing (the data of checkpoint {self.prefix})")
            self._shards[entry.shard_id] = _Mapped(path)
        shard = self._shards[entry.shard_id]
        start, end = entry.offset, entry.offset + entry.size
        if start < 0 or end > len(shard.data):
            raise CheckpointError(
                f"{shard.path} is truncated: variable {name} needs bytes [{start}, {end}) of its "
                f"{len(shard.data)}"
            )
        raw = shard.data[start:end]
        if masked_crc32c(raw) != entry.crc32c:
            raise CheckpointError(
                f"{shard.path} is corrupt: variable {name} at offset {start} does not match its checksum"
            )
        array = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)
        return _finish(array, entry.dtype)


# --- finding a checkpoint ------------------------------------------------------------------------

_STATE_LINE = re.compile(r'^model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"\s*$', re.M)


def newest_in_directory(directory: Path) -> Path:
    """The prefix a TF train directory's `checkpoint` file names (model_checkpoint_path)."""
    state = directory / "checkpoint"
    try:
        text = state.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise CheckpointError(
            f"{directory} has no readable `checkpoint` file naming a TensorFlow checkpoint ({exc.strerror})"
        ) from None
    match = _STATE_LINE.search(text)
    if not match:
        raise CheckpointError(f"{state} names no model_checkpoint_path")
    # A text-format string: C escapes, non-ASCII bytes as octal \NNN (protobuf's CEscape).
    named = Path(codecs.escape_decode(match.group(1).encode())[0].decode("utf-8", "replace"))
    # A sharded V1 Saver names the files' pattern, "model.ckpt-0-?????-of-00002" (saver.py
    # _GetShardedFileName): the prefix is what comes before it.
    named = named.with_name(_strip_shard(named.name))
    prefix = named if named.is_absolute() else directory / named
    # A run directory moved since TF wrote an absolute path: the checkpoint is beside the state file.
    if named.is_absolute() and not _exists(prefix) and _exists(directory / named.name):
        prefix = directory / named.name
    return prefix


# A V1 shard's name after its prefix (TF's "%s-%05d-of-%05d"), or the pattern a sharded Saver records.
_V1_SHARD = re.compile(r"-(\d{5,}|\?{5})-of-(\d{5,})")


def _strip_shard(name: str) -> str:
    if (m := _V1_SHARD.search(name)) and m.end() == len(name) and m.start() > 0:
        return name[: m.start()]
    return name


def _exists(prefix: Path) -> bool:
    return Path(f"{prefix}.index").is_file() or prefix.is_file() or bool(_v1_shard_files(prefix))


def _v1_shard_files(prefix: Path) -> dict[Path, tuple[int, int]]:
    """The files named PREFIX-{k:05d}-of-{n:05d} beside `prefix`: path -> (k, n)."""
    out = {}
    try:
        found = list(prefix.parent.iterdir())
    except OSError:
        return {}
    for path in found:
        m = _V1_SHARD.fullmatch(path.name[len(prefix.name) :]) if path.name.startswith(prefix.name) else None
        if m and "?" not in m.group(1):
            out[path] = (int(m.group(1)), int(m.group(2)))
    return out


def _v1_shards(prefix: Path) -> list[Path]:
    """The shards of the V1 checkpoint `prefix` in order, all n of them ([] if it has none); a
    CheckpointError naming the first one missing, or the files of two different shard counts."""
    files = _v1_shard_files(prefix)
    if not files:
        return []
    counts = sorted({n for _, n in files.values()})
    if len(counts) > 1:
        raise CheckpointError(
            f"V1 checkpoint {prefix} has shard files of {len(counts)} different counts ("
            + ", ".join(f"-of-{n:05d}" for n in counts)
            + "): files of two saves; remove the stale ones"
        )
    n = counts[0]
    by_index = {k: path for path, (k, _) in files.items()}
    for k in range(n):
        if k not in by_index:
            raise CheckpointError(
                f"{prefix}-{k:05d}-of-{n:05d} is missing (shard {k + 1} of the {n} of V1 checkpoint {prefix})"
            )
    if len(by_index) != n:  # an index >= n
        extra = min(k for k in by_index if k >= n)
        raise CheckpointError(f"{by_index[extra]} is not a shard of a {n}-shard checkpoint: a stray file")
    return [by_index[k] for k in range(n)]


def checkpoint_prefix(path: str | Path) -> Path:
    """The prefix `path` names: itself, a directory's newest, PREFIX.index / PREFIX.data-* given whole,
    or a V1 shard PREFIX-00000-of-00002 (or the pattern PREFIX-?????-of-00002)."""
    path = Path(path)
    if path.is_dir():
        return newest_in_directory(path)
    text = str(path)
    if text.endswith(".index"):
        return Path(text[: -len(".index")])
    if m := re.fullmatch(r"(.*)\.data-\d{5}-of-\d{5}", text):
        return Path(m.group(1))
    return path.with_name(_strip_shard(path.name))


def is_tf_checkpoint(path: str | Path) -> bool:
    """Whether `path` looks like a TF checkpoint (a train directory with a `checkpoint` file, a V2
    prefix, or a file ending in the table magic): which reader a restore uses, before reading it."""
    path = Path(path)
    if path.is_dir():
        return (path / "checkpoint").is_file()
    prefix = checkpoint_prefix(path)
    if Path(f"{prefix}.index").is_file() or _v1_shard_files(prefix):
        return True
    try:
        with open(prefix, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < FOOTER_BYTES:
                return False
            f.seek(-8, os.SEEK_END)
            return struct.unpack("<Q", f.read(8))[0] == TABLE_MAGIC
    except OSError:
        return False


def open_checkpoint(path: str | Path) -> CheckpointV1 | CheckpointV2:
    """A reader for the TF checkpoint `path` names (prefix, directory, or PREFIX.index)."""
    prefix = checkpoint_prefix(path)
    if Path(f"{prefix}.index").is_file():
        return CheckpointV2(prefix)
    if prefix.is_file():
        return CheckpointV1(prefix, [prefix])
    if shards := _v1_shards(prefix):
        return CheckpointV1(prefix, shards)
    raise CheckpointError(f"no TensorFlow checkpoint at {prefix} (neither {prefix}.index nor a V1 file)")


# --- writing V2 ----------------------------------------------------------------------------------


def write_checkpoint(prefix: str | Path, tensors: dict[str, np.ndarray], *, state_file: bool = True) -> Path:
    """Write `tensors` (name -> array in TF's layout) as the V2 checkpoint PREFIX.index +
    PREFIX.data-00000-of-00001, and (state_file) the directory's `checkpoint` file naming it.

    Both files are written whole to temporary files first, then renamed into place, the index last: it
    is what makes the checkpoint exist for TF. A failure (a full disk) removes the temporary files and a
    data file this call put in place without its index, and is a CheckpointError naming the file and
    the reason; a checkpoint already at `prefix` is then as it was, unless the renames themselves fail."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    data_path, index = Path(f"{prefix}.data-00000-of-00001"), Path(f"{prefix}.index")
    data_tmp, index_tmp = (p.with_name(f".{p.name}.tmp") for p in (data_path, index))
    data_was_there, placed, current = data_path.exists(), [], data_path  # current: named in an error
    try:
        items = _write_data(data_tmp, tensors)
        current = index
        with open(index_tmp, "wb") as f:
            f.write(build_table(items))
            f.flush()
            os.fsync(f.fileno())
        os.replace(data_tmp, data_path)
        placed.append(data_path)
        os.replace(index_tmp, index)
        placed.append(index)
        if state_file:
            current = prefix.parent / "checkpoint"
            write_state_file(prefix)
    except BaseException as exc:
        for path in (data_tmp, index_tmp):
            path.unlink(missing_ok=True)
        if placed == [data_path] and not data_was_there:
            data_path.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write {current} ({os_error_text(exc)})") from None
        raise
    return prefix


def _write_data(path: Path, tensors: dict[str, np.ndarray]) -> list[tuple[bytes, bytes]]:
    """The tensors' bytes in name order into `path` (fsynced); the index's items (key, entry)."""
    header = _MSG["BundleHeaderProto"](num_shards=1, endianness=0)
    header.version.producer = 1
    items, offset = [(b"", header.SerializeToString())], 0
    with open(path, "wb") as f:
        for name in sorted(tensors, key=lambda n: n.encode()):
            array = np.asarray(tensors[name])  # not ascontiguousarray: it makes a scalar 1-D
            if array.dtype not in DTYPE_CODES:
                raise CheckpointError(f"cannot write {name}: dtype {array.dtype} has no TensorFlow type here")
            raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
            entry = _MSG["BundleEntryProto"](dtype=DTYPE_CODES[array.dtype], offset=offset, size=len(raw))
            entry.crc32c = masked_crc32c(raw)
            for d in array.shape:
                entry.shape.dim.add(size=d)
            f.write(raw)
            offset += len(raw)
            items.append((name.encode(), entry.SerializeToString()))
        f.flush()
        os.fsync(f.fileno())
    return items


_LISTED_LINE = re.compile(r'^all_model_checkpoint_paths:\s*"((?:[^"\\]|\\.)*)"\s*$', re.M)


def write_state_file(prefix: Path) -> None:
    """The directory's `checkpoint` file naming `prefix` (relative) as the newest, written whole or not at
    all. The checkpoints a `checkpoint` file there lists stay in its all_model_checkpoint_paths, oldest
    first and `prefix` last, as TF's Saver keeps them (checkpoint_management.update_checkpoint_state):
    replacing the file dropped them (a TF train directory's, an earlier export's)."""
    state = prefix.parent / "checkpoint"
    name = _c_escape(prefix.name)
    try:
        text = state.read_text(encoding="utf-8", errors="replace")
    except OSError:  # none yet
        text = ""
    newest = _STATE_LINE.search(text)
    listed = _LISTED_LINE.findall(text) + ([newest.group(1)] if newest else [])
    kept = [n for n in dict.fromkeys(listed) if _c_unescape(n) not in (prefix.name, str(prefix))]
    lines = [f'model_checkpoint_path: "{name}"', *(f'all_model_checkpoint_paths: "{n}"' for n in kept)]
    text = "\n".join([*lines, f'all_model_checkpoint_paths: "{name}"']) + "\n"
    write_atomic(state, lambda f: f.write(text.encode()))


def _c_unescape(body: str) -> str:
    """A text-format string's body decoded (_c_escape's inverse)."""
    return codecs.escape_decode(body.encode())[0].decode("utf-8", "replace")


def _c_escape(text: str) -> str:
    """A text-format string's body, as protobuf's CEscape writes it (newest_in_directory's inverse): the
    UTF-8 bytes, quotes, backslashes and control bytes escaped, bytes outside printable ASCII as \\NNN."""
    named = {
        ord("\n"): "\\n",
        ord("\r"): "\\r",
        ord("\t"): "\\t",
        ord('"'): '\\"',
        ord("'"): "\\'",
        ord("\\"): "\\\\",
    }
    return "".join(named.get(b) or (chr(b) if 0x20 <= b < 0x7F else f"\\{b:03o}") for b in text.encode())
