"""What goes into which shard, for `python -m fasttrain.data build`: build_imagenet_data.py's text files,
image lists, seeded shuffle and split arithmetic (tensorflow/models research/inception/inception/data/).

The script, read from its code:
- labels file (`imagenet_lsvrc_2015_synsets.txt`): one synset a line, stripped; label = line number,
  from 1 (0 is left for a background class).
- metadata file (`imagenet_metadata.txt`): `synset<TAB>text` a line (stripped, split at tabs, two parts
  required; UTF-8); a later line for the same synset wins. Every synset with images needs one.
- bounding-box file (what process_bounding_boxes.py prints): `name,xmin,ymin,xmax,ymax` a line, split
  at commas into five parts, the name as it is, the numbers by Python's float(); an image's boxes are
  its lines in file order, wherever they stand. Boxes are looked up by file name, in both splits.
- images: for each synset in labels-file order, the files `<split dir>/<synset>/*.JPEG` (the suffix is
  case-sensitive: `.jpeg` and `.jpg` are left out, as is a folder for a synset the labels file does
  not name); then the whole list is shuffled with `random.seed(12345); random.shuffle` of its indices.
- shards: np.linspace(0, N, num_threads + 1).astype(int) cuts the list into one range per thread, and
  np.linspace over each range, num_shards / num_threads + 1 points, cuts it into that thread's shards:
  shard t * (num_shards / num_threads) + s holds the images between cuts s and s + 1. So num_threads
  is part of the layout, and a shard can be empty (fewer images than shards).

One change: the script takes each folder's files in the order the file system lists them (tf.gfile.Glob;
TensorFlow 2.21's tf.io.gfile.glob returned os.listdir's order here, unsorted), which differs from one
machine and file system to the next, so its shards cannot be made again. Here
each folder's names are sorted (by code point, which is UTF-8 byte order) before the same seeded
shuffle: the same inputs give the same shards everywhere. Python 3's random.shuffle is the one used
(Python 2's, which the script met in 2016, draws differently).

Where the script would crash with an assertion or go on silently, these raise a one-line DataError:
a blank or repeated line in the labels file, a metadata or box line of the wrong shape, a box outside
[0, 1] or with a minimum above its maximum, a synset with images but no text, a split directory where
no image is found (a flat validation folder).
"""

from __future__ import annotations

import hashlib
import os
import random
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fasttrain.data.errors import DataError

SHUFFLE_SEED = 12345
_BOX = struct.Struct("<4d")  # xmin, ymin, xmax, ymax: the floats the script parsed, kept exactly


class EmptySplit(DataError):
    """A split directory in which the script's glob finds no image (it would write empty shards)."""


@dataclass
class Annotations:
    """The three text files, read."""

    synsets: list[str]  # labels-file order: label = index + 1
    texts: dict[str, str]  # synset -> human-readable text
    # file name -> its boxes packed as _BOX records (8 bytes a number: ImageNet's 615k boxes take about
    # 40 MB this way, four times less than as lists of Python floats)
    boxes: dict[str, bytes]
    labels_file: str
    metadata_file: str

    def boxes_of(self, name: str) -> list[tuple[float, float, float, float]]:
        return list(_BOX.iter_unpack(self.boxes.get(name, b"")))


@dataclass
class SplitPlan:
    """One split's images in the script's order, and the shards they go to."""

    split: str  # "train" or "validation"
    directory: Path
    num_shards: int
    num_threads: int
    files: list[str]  # "synset/name" under `directory`, in the shuffled order
    notes: list[str]  # what the listing left out, one line each

    def shard_ranges(self) -> list[tuple[int, int]]:
        """[start, end) of files for each shard number."""
        return shard_ranges(len(self.files), self.num_shards, self.num_threads)

    def shard_name(self, shard: int) -> str:
        return f"{self.split}-{shard:05d}-of-{self.num_shards:05d}"

    def digest(self, annotations: Annotations) -> str:
        """A hash of everything the split's shards hold but the pixels: a resumed build keeps finished
        shards only when it equals the hash they were written under."""
        h = hashlib.sha256(f"{self.split} {self.num_shards} {self.num_threads} {len(self.files)}\n".encode())
        labels = {s: i + 1 for i, s in enumerate(annotations.synsets)}
        for relative in self.files:
            synset, name = relative.split("/", 1)
            text = annotations.texts[synset]
            h.update(f"{relative}\0{labels[synset]}\0{text}\0".encode("utf-8", "surrogateescape"))
            h.update(annotations.boxes.get(name, b""))
        return h.hexdigest()


def shard_ranges(n: int, num_shards: int, num_threads: int) -> list[tuple[int, int]]:
    """The script's split of n shuffled images: threads first, then each thread's shards."""
    if num_shards % num_threads:
        raise ValueError(f"num_shards {num_shards} is not a multiple of num_threads {num_threads}")
    # np.int64 is the script's astype(np.int) (NumPy's int was the C long); the float64 linspace and
    # the truncation are what decide where a cut falls.
    bounds = np.linspace(0, n, num_threads + 1).astype(np.int64)
    per_thread = num_shards // num_threads
    ranges = []
    for t in range(num_threads):
        cuts = np.linspace(bounds[t], bounds[t + 1], per_thread + 1).astype(np.int64)
        ranges += [(int(cuts[s]), int(cuts[s + 1])) for s in range(per_thread)]
    return ranges


def _lines(path: str, what: str, flag: str) -> list[str]:
    """The file's lines as Python's readlines gives them after decoding UTF-8 (split at \\n only)."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        none = " (or --bounding_box_file '' for records without boxes)" if flag == "bounding_box_file" else ""
        raise DataError(f"the {what} {path} does not exist; give it with --{flag}{none}") from None
    except OSError as e:
        raise DataError(f"cannot read the {what} {path} ({e.strerror}); check --{flag}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"the {what} {path} is not UTF-8 text (byte {e.start}); check --{flag}") from None
    # A byte-order mark (an editor's UTF-8 "with BOM") would be part of the first synset's name, whose
    # folder then matched nothing: class 1 was left out with only a count saying so.
    lines = text.removeprefix("\ufeff").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def read_annotations(labels_file: str, metadata_file: str, bounding_box_file: str) -> Annotations:
    """Read the labels, metadata and (unless bounding_box_file is '') bounding-box files."""
    synsets, seen = [], {}
    for number, line in enumerate(_lines(labels_file, "labels file", "labels_file"), start=1):
        synset = line.strip()
        if not synset:  # the script would glob <dir>//*.JPEG for it and shift no label
            raise DataError(f"line {number} of the labels file {labels_file} is blank; delete it")
        if synset in seen:  # the script would store the synset's images twice, under two labels
            raise DataError(
                f"the labels file {labels_file} lists {synset} twice (lines {seen[synset]} and {number}); "
                "keep one"
            )
        seen[synset] = number
        synsets.append(synset)
    if not synsets:
        raise DataError(f"the labels file {labels_file} is empty; give the synsets file with --labels_file")

    texts = {}
    for number, line in enumerate(_lines(metadata_file, "metadata file", "imagenet_metadata_file"), start=1):
        if not line.strip():
            continue  # the script stops at a blank line; it holds nothing to store
        parts = line.strip().split("\t")
        if len(parts) != 2:
            raise DataError(
                f"line {number} of the metadata file {metadata_file} is not 'synset<TAB>text' "
                f"({len(parts)} tab-separated parts); fix that line"
            )
        texts[parts[0]] = parts[1]

    boxes: dict[str, bytearray] = {}
    if bounding_box_file:
        for number, line in enumerate(_lines(bounding_box_file, "bounding-box file", "bounding_box_file"), 1):
            if not line.strip():
                continue
            parts = line.split(",")
            try:
                if len(parts) != 5:
                    raise ValueError
                xmin, ymin, xmax, ymax = (float(v) for v in parts[1:])
            except ValueError:
                raise DataError(
                    f"line {number} of the bounding-box file {bounding_box_file} is not "
                    "'name,xmin,ymin,xmax,ymax'; fix that line"
                ) from None
            # process_bounding_boxes.py orders each box and clips it into the image: a line that is
            # not is from elsewhere (pixels, or another column order), and TensorFlow's crop refuses
            # a coordinate outside [0, 1] in training (so does DALI's), an error only at that image.
            if not (0.0 <= xmin <= xmax <= 1.0 and 0.0 <= ymin <= ymax <= 1.0):
                raise DataError(
                    f"line {number} of the bounding-box file {bounding_box_file} is not a box inside "
                    f"the image (need 0 <= xmin <= xmax <= 1 and 0 <= ymin <= ymax <= 1, as "
                    "process_bounding_boxes.py writes them); fix that line"
                )
            record = _BOX.pack(xmin, ymin, xmax, ymax)
            boxes.setdefault(parts[0], bytearray()).extend(record)
    return Annotations(
        synsets, texts, {k: bytes(v) for k, v in boxes.items()}, str(labels_file), str(metadata_file)
    )


def plan_split(
    split: str, directory, annotations: Annotations, num_shards: int, num_threads: int
) -> SplitPlan:
    """The split's images in the script's order; DataError when the directory yields none."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise DataError(f"the {split} directory {directory} {what}; give the folder of its synset folders")
    files, missing, empty, other, first_other = [], [], [], 0, ""
    for synset in annotations.synsets:
        try:
            entries = list(os.scandir(directory / synset))
        except (FileNotFoundError, NotADirectoryError):
            missing.append(synset)
            continue
        except OSError as e:
            raise DataError(
                f"cannot list {directory / synset} ({e.strerror}); check its permissions"
            ) from None
        names = sorted(e.name for e in entries if e.name.endswith(".JPEG") and not e.is_dir())
        if len(entries) > len(names) and not other:  # the first folder that has any: one is named
            first_other = f"{synset}/" + min(e.name for e in entries if e.name not in set(names))
        other += len(entries) - len(names)
        if not names:
            empty.append(synset)
        files += [f"{synset}/{name}" for name in names]
    if not files:
        raise EmptySplit(_no_images(split, directory, annotations))
    texts = annotations.texts
    if without := sorted({f.split("/", 1)[0] for f in files} - texts.keys()):
        raise DataError(
            f"synset {without[0]} has images in {directory} but no line in the metadata file "
            f"{annotations.metadata_file}"
            + (f" (nor do {len(without) - 1} more)" if len(without) > 1 else "")
            + "; give the full imagenet_metadata.txt with --imagenet_metadata_file"
        )
    order = list(range(len(files)))
    random.Random(SHUFFLE_SEED).shuffle(order)  # the same draws as random.seed(12345); random.shuffle
    notes = []
    if missing or empty:
        kinds = [
            f"no folder: {_first(missing)}" if missing else "",
            f"an empty folder: {_first(empty)}" if empty else "",
        ]
        notes.append(
            f"{len(missing) + len(empty)} of {len(annotations.synsets)} synsets of {annotations.labels_file} "
            f"have no images in {directory} ({'; '.join(k for k in kinds if k)}): no image has their labels"
        )
    if other:
        notes.append(
            f"{other} entries of the synset folders are not *.JPEG files and are left out, as the script "
            f"leaves them (the suffix is case-sensitive there; e.g. {directory / first_other})"
        )
    known = set(annotations.synsets)
    try:
        top = list(os.scandir(directory))
    except OSError:
        top = []
    if extra := sorted(e.name for e in top if e.is_dir() and e.name not in known):
        notes.append(
            f"{len(extra)} folders in {directory} are not synsets of {annotations.labels_file}: "
            f"{_first(extra)}, left out"
        )
    if flat := sum(1 for e in top if e.name.endswith(".JPEG") and not e.is_dir()):
        notes.append(
            f"{flat} *.JPEG files directly in {directory} are left out (only synset folders are read)"
        )
    return SplitPlan(split, directory, num_shards, num_threads, [files[i] for i in order], notes)


def _first(names: list[str], shown: int = 3) -> str:
    """'a, b, c and 7 more': the first few of a list of names, for a note that must name them."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _no_images(split: str, directory: Path, annotations: Annotations) -> str:
    try:
        flat = sum(1 for e in os.scandir(directory) if e.name.lower().endswith((".jpeg", ".jpg")))
    except OSError:
        flat = 0
    if flat:
        return (
            f"the {split} directory {directory} holds {flat} JPEG files but no synset folders of them: move "
            "the images into synset folders first (TensorFlow models' preprocess_imagenet_validation_data.py "
            "with imagenet_2012_validation_synset_labels.txt does that, without TensorFlow)"
        )
    return (
        f"the {split} directory {directory} has no *.JPEG files in folders named as the synsets of "
        f"{annotations.labels_file}; give the folder that holds the synset folders"
    )
