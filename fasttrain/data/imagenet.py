"""The ImageNet TFRecord layout of TensorFlow models' build_imagenet_data.py: shards, Example keys, labels.

Shards are `train-%05d-of-%05d` and `validation-%05d-of-%05d` (no extension, no compression). Each
record is a tf.train.Example with these features (types as the converter writes them):

    image/encoded        bytes   the JPEG (RGB after the converter's CMYK/PNG fixes; may be grayscale)
    image/class/label    int64   1..1000 (0 = background)                       required
    image/height, image/width, image/channels   int64                           optional here
    image/colorspace ("RGB"), image/format ("JPEG"), image/filename,
    image/class/synset, image/class/text         bytes                           optional here
    image/object/bbox/{xmin,ymin,xmax,ymax}      float lists, normalised, equal lengths (often empty)
    image/object/bbox/label                      int64 list

Only `image/encoded` and `image/class/label` are required (the seeds read nothing else but the boxes);
a key that is present with the wrong type is an error. The training label is the stored label plus
`label_offset` (0: 1001 classes with background 0, the Inception seed; -1: 1000 classes) and must lie
in [0, num_classes).
"""

from __future__ import annotations

import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
from google.protobuf.message import DecodeError

from fasttrain.data import example as wire
from fasttrain.data.errors import DataError, LabelRangeError
from fasttrain.data.example import parse_example

SPLITS = ("train", "validation")
_SHARD = re.compile(r"(train|validation)-(\d{5})-of-(\d{5})")
_BOX_KEYS = (
    "image/object/bbox/ymin",
    "image/object/bbox/xmin",
    "image/object/bbox/ymax",
    "image/object/bbox/xmax",
)


def list_shards(data_dir, split: str, check: bool = True) -> list[Path]:
    """The split's shard files in data_dir, sorted; DataError if the directory or the shards are missing.

    check=True also refuses an incomplete set (see shard_set_problems) and a shard that is empty,
    unreadable or a broken link (shard_file_problem): training on it would quietly see less data.
    """
    names = find_shards(data_dir, split)
    if not names:
        raise DataError(
            f"no {split}-NNNNN-of-NNNNN shards in {data_dir}; give the directory of the converter's output"
            + raw_images_hint(data_dir)
        )
    if check:
        problems = shard_set_problems(names) + [p for p in map(shard_file_problem, names) if p]
        if problems:
            raise DataError(_summary(problems))
    return names


def find_shards(data_dir, split: str) -> list[Path]:
    """The split's shard names in data_dir, sorted, maybe none; DataError if the directory is unusable."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use train or validation")
    if not str(data_dir or ""):  # Path("") would silently mean the current directory
        raise DataError(
            "no data directory given; set data_dir to the directory of the TFRecord shards",
            settings=("data_dir",),
        )
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        what = "is not a directory" if data_dir.exists() else "does not exist"
        raise DataError(f"data directory {str(data_dir)!r} {what}; give the directory of the TFRecord shards")
    try:
        entries = os.listdir(data_dir)
    except OSError as e:
        raise DataError(
            f"cannot list the data directory {data_dir} ({e.strerror}); check its permissions"
        ) from None
    return sorted(data_dir / n for n in entries if (m := _SHARD.fullmatch(n)) and m.group(1) == split)


def shard_set_problems(shards: list[Path]) -> list[str]:
    """What is wrong with a split's set of names: counts that differ, or numbers missing or too large.

    The names carry the set's size (`-of-01024`), so a shard that was never copied is visible.
    """
    if not shards:
        return []
    split, folder = _SHARD.fullmatch(shards[0].name).group(1), shards[0].parent
    numbers = [(int(m.group(2)), int(m.group(3))) for m in (_SHARD.fullmatch(p.name) for p in shards)]
    counts = sorted({count for _, count in numbers})
    if len(counts) > 1:
        return [
            f"the {split} shards in {folder} mix set sizes ({', '.join(f'-of-{c:05d}' for c in counts)}): "
            "two conversions share the directory; keep one set"
        ]
    (count,) = counts
    present = {index for index, _ in numbers}
    problems = []
    beyond = sorted(i for i in present if i >= count)
    if beyond:
        names = [f"{split}-{i:05d}-of-{count:05d}" for i in beyond]
        problems.append(f"{_names(names)} in {folder} numbered beyond the set's size {count}")
    missing = [f"{split}-{i:05d}-of-{count:05d}" for i in range(count) if i not in present]
    if missing:
        problems.append(
            f"{len(missing)} of {count} {split} shards missing from {folder}: {_names(missing)}; "
            "copy them (a partial set would train on less data without a word)"
        )
    return problems


def shard_file_problem(path: Path) -> str | None:
    """Why the shard file cannot be read as data (broken link, unreadable, empty), or None."""
    try:
        info = path.stat()
    except FileNotFoundError:
        target = os.readlink(path) if path.is_symlink() else "?"
        return f"shard {path} is a broken symbolic link (to {target}); re-create the link or copy the shard"
    except OSError as e:
        return f"cannot read shard {path} ({e.strerror})"
    if not stat.S_ISREG(info.st_mode):
        return f"shard {path} is not a regular file"
    if info.st_size == 0:
        return (
            f"shard {path} is empty (0 bytes): a copy that failed, or a build with more shards than "
            "images; re-copy it, or build again with fewer shards"
        )
    if not os.access(path, os.R_OK):
        return f"cannot read shard {path} (permission denied)"
    return None


def _names(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _summary(problems: list[str], shown: int = 2) -> str:
    """One line for several problems: the first ones in full, then how many more."""
    more = f" (and {len(problems) - shown} more problems: python -m fasttrain.data verify lists them)"
    return "; ".join(problems[:shown]) + (more if len(problems) > shown else "")


@dataclass
class ImageRecord:
    """One decoded Example (the JPEG itself is not decoded here)."""

    jpeg: bytes
    label: int  # stored label + label_offset, in [0, num_classes)
    boxes: np.ndarray  # (K, 4) float32: ymin, xmin, ymax, xmax, normalised to [0, 1]
    height: int  # from image/height (0 if absent); the decoded JPEG is authoritative
    width: int
    filename: str
    file: str  # the shard
    offset: int  # byte offset of the record in the shard
    stored_label: int = 0  # image/class/label as written
    synset: str = ""
    text: str = ""


def _bad(file, offset, what: str) -> DataError:
    return DataError(
        f"record at offset {offset} in {file}: {what}; re-create the shard or use skip_corrupt",
        settings=("skip_corrupt",),
    )


def _values(feature_map, key: str, kind: str, file, offset, required: bool):
    if key not in feature_map:
        if required:
            raise _bad(file, offset, f"missing key {key!r}")
        return None
    feature = feature_map[key]
    found = feature.WhichOneof("kind")
    if found != kind:
        raise _bad(file, offset, f"key {key!r} is {found or 'empty'}, expected {kind}")
    return getattr(feature, kind).value


def _single(feature_map, key, kind, file, offset, required, default):
    values = _values(feature_map, key, kind, file, offset, required)
    if values is None:
        return default
    if len(values) != 1:
        raise _bad(file, offset, f"key {key!r} has {len(values)} values, expected 1")
    return values[0]


def _text(feature_map, key, file, offset) -> str:
    return _single(feature_map, key, "bytes_list", file, offset, False, b"").decode("utf-8", "replace")


_NO_BOXES = np.zeros((0, 4), np.float32)
_NO_BOXES.flags.writeable = False  # shared by every record without boxes


def decode_record(payload: bytes, file, offset: int, label_offset: int, num_classes: int) -> ImageRecord:
    """Parse one ImageNet Example; DataError naming file and offset for a bad record or label.

    The protobuf runtime's parse is cheap (3 us for a converter record); reading its containers
    element by element from NumPy is not (np.array over four float containers took 23 us), so the
    box lists become Python lists first, and records without boxes share one empty array.
    """
    try:
        feature_map = parse_example(payload).features.feature
    except DecodeError:
        raise _bad(file, offset, "not a tf.train.Example protobuf") from None
    jpeg = _single(feature_map, "image/encoded", "bytes_list", file, offset, True, None)
    stored = _single(feature_map, "image/class/label", "int64_list", file, offset, True, None)
    label = stored + label_offset
    if not 0 <= label < num_classes:
        raise label_range_error(file, offset, stored, label_offset, num_classes)
    coords = [_values(feature_map, k, "float_list", file, offset, False) for k in _BOX_KEYS]
    coords = [[] if c is None else list(c) for c in coords]
    if len({len(c) for c in coords}) != 1:
        raise _bad(file, offset, "bounding-box coordinate lists have different lengths")
    if coords[0]:
        boxes = np.array(coords, dtype=np.float32).T.reshape(-1, 4)
        if not np.isfinite(boxes).all():
            # The crop sampler clips boxes into [0, 1] (TensorFlow rejects them), but NaN has no place.
            raise _bad(file, offset, "a bounding-box coordinate is NaN or infinite")
    else:
        boxes = _NO_BOXES
    return ImageRecord(
        jpeg=jpeg,
        label=label,
        boxes=boxes,
        height=_single(feature_map, "image/height", "int64_list", file, offset, False, 0),
        width=_single(feature_map, "image/width", "int64_list", file, offset, False, 0),
        filename=_text(feature_map, "image/filename", file, offset),
        file=str(file),
        offset=offset,
        stored_label=stored,
        synset=_text(feature_map, "image/class/synset", file, offset),
        text=_text(feature_map, "image/class/text", file, offset),
    )


# The keys decode_record reads, with its rules, for scan_example: (key, kind, values, required).
_B, _F, _I = wire.BYTES_LIST, wire.FLOAT_LIST, wire.INT64_LIST
_SCANNED = [("image/encoded", _B, 1, True), ("image/class/label", _I, 1, True)]
_SCANNED += [(key, _F, -1, False) for key in _BOX_KEYS]  # rows 2-5
_SCANNED += [("image/height", _I, 1, False), ("image/width", _I, 1, False)]
_SCANNED += [(key, _B, 1, False) for key in ("image/filename", "image/class/synset", "image/class/text")]
_KEY_BYTES, _KEY_ENDS, _RULES = wire.key_table(_SCANNED)
_LITTLE_ENDIAN = sys.byteorder == "little"  # the scan reads the packed floats in the host's order


class SampleDecoder:
    """decode_record's (jpeg, label, boxes) for a loader, from a payload in a RecordBuffer, without
    protobuf for a plain record (the jpeg is then a view into the buffer). A record the scan does not
    accept, or whose values decode_record refuses, goes through decode_record, which raises as ever."""

    def __init__(self, label_offset: int, num_classes: int):
        self.label_offset, self.num_classes = label_offset, num_classes
        self.found = np.zeros((len(_SCANNED), 5), np.int64)

    def decode(self, buffer, payload: memoryview, file, offset: int):
        """(jpeg, label, boxes) of the payload that `buffer.read` returned (it starts at byte 12)."""
        found = self.found
        boxes = _scan_sample(buffer.array, 12 + len(payload), found) if _LITTLE_ENDIAN else None
        if boxes is not None:
            label = int(found[1, wire.VALUE]) + self.label_offset
            if 0 <= label < self.num_classes:
                start = int(found[0, wire.START])
                jpeg = buffer.view[start : start + int(found[0, wire.LENGTH])]
                return jpeg, label, boxes if len(boxes) else _NO_BOXES
        record = decode_record(bytes(payload), file, offset, self.label_offset, self.num_classes)
        return record.jpeg, record.label, record.boxes


@numba.njit(cache=True)
def _scan_sample(buf, end, found):
    """The boxes (K, 4) float32 of the Example in buf[12:end] if scan_example accepts it and its box
    lists are equal in length and finite (found then describes the keys), else None."""
    if not wire.scan_example(buf, 12, end, _KEY_BYTES, _KEY_ENDS, _RULES, found):
        return None
    n = found[2, wire.COUNT]
    if found[3, wire.COUNT] != n or found[4, wire.COUNT] != n or found[5, wire.COUNT] != n:
        return None
    boxes = np.empty((n, 4), np.float32)
    for column in range(4):  # ymin, xmin, ymax, xmax: packed little-endian float32
        start = found[2 + column, wire.START]
        values = buf[start : start + 4 * n].copy().view(np.float32)
        for i in range(n):
            if not np.isfinite(values[i]):
                return None
            boxes[i, column] = values[i]
    return boxes


def label_range_error(file, offset: int, stored: int, label_offset: int, num_classes: int) -> LabelRangeError:
    """The error for a stored label that label_offset and num_classes put outside the classifier."""
    return LabelRangeError(
        f"record at offset {offset} in {file}: label {stored} + label_offset {label_offset} is outside "
        f"[0, {num_classes}): label_offset={label_offset} and num_classes={num_classes} do not fit "
        "this data set (the converter's labels run 1..1000: use -1 and 1000, or 0 and 1001 with background)",
        settings=("label_offset", "num_classes"),
    )


CONVERTER = (
    "python -m fasttrain.data build (it writes what TensorFlow models' build_imagenet_data.py writes; "
    "README: Preparing ImageNet TFRecords)"
)


def raw_images_hint(data_dir) -> str:
    """'; <dir> holds JPEG images ...: convert them ...' when data_dir looks like raw ImageNet (image
    files, or class folders such as n01440764/) rather than TFRecord shards; '' otherwise."""
    path = Path(data_dir)
    try:
        names = [p.name for p in path.iterdir()][:2000]
    except OSError:
        return ""
    images = any(n.lower().endswith((".jpeg", ".jpg", ".png")) for n in names)
    folders = any(n in ("train", "val") or (len(n) == 9 and n[0] == "n" and n[1:].isdigit()) for n in names)
    if not (images or folders):
        return ""
    what = "JPEG images" if images else "class or split folders of images"
    return f"; {path} holds {what}: convert them to TFRecord shards first with {CONVERTER}"
