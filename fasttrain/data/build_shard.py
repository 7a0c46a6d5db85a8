"""One job of `python -m fasttrain.data build` (fasttrain/data/build.py): a shard written from its
images, with its sidecars, in a worker process.

The shard is written as `.<name>.<pid>.tmp` and renamed when complete, so a shard file that exists is
finished. Each record is the script's Example (`_convert_to_example` in build_imagenet_data.py),
serialized with its map entries sorted by key: the same bytes in every process (TensorFlow's order
varies from one process to the next, so its shards differ byte-wise between runs, not feature-wise).
With write_index the DALI `<shard>.idx` is written from the offsets in hand; with row_checkpoints the
torch loader's `<shard>.rows` (fasttrain/data/jpeg/row_index.py) is built right after, from the shard in
the page cache. This module holds fasttrain's other data modules' helpers the build uses, in one place.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from fasttrain.checkpoint import write_atomic
from fasttrain.data.build_image import BadImage, stored_image
from fasttrain.data.build_lists import SplitPlan

# The helpers of other modules, in one place (files there may move).
from fasttrain.data.example import Example
from fasttrain.data.imagenet import find_shards
from fasttrain.data.jpeg.row_index import RowIndex, build_row_index
from fasttrain.data.tfrecord import frame_record, load_index, write_index_file
from fasttrain.stop_signals import ignore_sigint

# find_shards and load_index are build.py's, through here.
__all__ = [
    "ShardFailed",
    "ShardJob",
    "ShardResult",
    "example_bytes",
    "find_shards",
    "has_row_checkpoints",
    "init_worker",
    "load_index",
    "run_job",
    "set_counter",
]


def has_row_checkpoints(shard: Path) -> bool:
    """Whether the shard has current JPEG row checkpoints."""
    return RowIndex.open(shard) is not None


@dataclass
class ShardJob:
    """One shard to write, or one finished shard whose row checkpoints are missing (write=False)."""

    path: Path
    directory: Path  # the split's image folder
    write: bool
    images: int  # how many images the plan puts in it
    write_index: bool
    row_checkpoints: bool
    skip_bad: bool
    # (synset/name, label, synset, text, boxes), filled in by _with_entries as the job is handed out, so
    # that ImageNet's 1.28 million entries never sit in memory (or in the pool's queue) all at once
    entries: list[tuple[str, int, str, str, list]] | None = None
    plan: SplitPlan | None = None  # the main process's reference; not sent to a worker
    first: int = 0  # the shard's images are plan.files[first:first + images]


@dataclass
class ShardResult:
    name: str
    images: int
    skipped: list[str]  # one line per image left out
    cpu_seconds: float


class ShardFailed(Exception):
    """A worker's one-line reason to stop the build (a plain message: it crosses process boundaries)."""


_counter = None  # images done, shared by the worker processes (set by init_worker)


def set_counter(counter) -> None:
    global _counter
    _counter = counter


def skipped_path(shard: Path) -> Path:
    """Where a worker records the images --on_bad skip left out of `shard` before naming it: the main
    process folds it into the build's record (fasttrain.data.build_run) and deletes it."""
    return shard.with_name(f".{shard.name}.skipped")


def _count_records():
    """A build_row_index progress hook that adds each call's new records to the shared counter."""
    seen = [0]

    def progress(done: int, _total: int) -> None:
        if _counter is not None:
            with _counter.get_lock():
                _counter.value += done - seen[0]
        seen[0] = done

    return progress


def init_worker(counter) -> None:
    set_counter(counter)
    ignore_sigint()  # the main process ends the pool and removes its temporary files


def example_bytes(
    jpeg: bytes, height: int, width: int, label: int, synset: str, text: str, name: str, boxes
) -> bytes:
    """The script's Example (`_convert_to_example`), boxes as (xmin, ymin, xmax, ymax) tuples.

    Serialized deterministically (map keys sorted): the same record gives the same bytes in every
    process, where TensorFlow's order varies from one process to the next."""
    example = Example()
    feature = example.features.feature
    for key, value in (("image/height", height), ("image/width", width), ("image/channels", 3)):
        feature[key].int64_list.value.append(value)
    feature["image/class/label"].int64_list.value.append(label)
    for key, value in (
        ("image/colorspace", b"RGB"),
        ("image/class/synset", synset.encode()),
        ("image/class/text", text.encode("utf-8")),
        ("image/format", b"JPEG"),
        ("image/filename", os.fsencode(name)),
        ("image/encoded", jpeg),
    ):
        feature[key].bytes_list.value.append(value)
    for i, key in enumerate(("xmin", "ymin", "xmax", "ymax")):  # every list set, empty ones too
        feature[f"image/object/bbox/{key}"].float_list.value.extend(b[i] for b in boxes)
    feature["image/object/bbox/label"].int64_list.value.extend([label] * len(boxes))
    return example.SerializeToString(deterministic=True)


def run_job(job: ShardJob) -> ShardResult:
    """Write one shard (as a temporary file, renamed when complete) and its sidecars."""
    start = time.process_time()
    skipped, images = [], 0
    if job.write:
        tmp = job.path.with_name(f".{job.path.name}.{os.getpid()}.tmp")
        index, offset = [], 0
        try:
            with open(tmp, "wb") as f:
                for relative, label, synset, text, boxes in job.entries:
                    file = job.directory / relative
                    try:
                        jpeg, height, width = stored_image(str(file), relative)
                    except BadImage as e:
                        if not job.skip_bad:
                            raise ShardFailed(
                                f"bad image {file}: it {e}; replace it with a sound copy and run the same "
                                "command again (finished shards are kept), or leave bad images out with "
                                "--on_bad skip"
                            ) from None
                        skipped.append(f"{file}: {e}")
                        continue
                    finally:
                        if _counter is not None:
                            with _counter.get_lock():
                                _counter.value += 1
                    framed = frame_record(
                        example_bytes(
                            jpeg, height, width, label, synset, text, relative.split("/", 1)[1], boxes
                        )
                    )
                    f.write(framed)
                    index.append((offset, len(framed)))
                    offset += len(framed)
                    images += 1
                # On the disk before the rename: after a power loss a shard under its final name would
                # otherwise be able to miss data, and a rerun keeps any shard that exists as finished.
                f.flush()
                os.fsync(f.fileno())
            if skipped:  # before the shard takes its name: a build killed after it still knows them
                write_atomic(
                    skipped_path(job.path), lambda out: out.write((json.dumps(skipped) + "\n").encode())
                )
            os.replace(tmp, job.path)  # the shard appears complete or not at all
        except OSError as e:  # the output side: reading an image is BadImage's
            tmp.unlink(missing_ok=True)
            raise ShardFailed(
                f"cannot write {job.path} ({e.strerror}); free space or give another --output_directory"
            ) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if job.write_index:
            write_index_file(job.path.with_name(job.path.name + ".idx"), index)
    if job.row_checkpoints:
        # A finished shard's records count in the progress as they are read (a written one's counted).
        progress = None if job.write else _count_records()
        build_row_index(job.path, progress=progress)  # reads the .idx, or builds and writes it
        if progress is not None:
            progress(job.images, job.images)  # the last records (it reports every 256)
    return ShardResult(job.path.name, images, skipped, time.process_time() - start)
