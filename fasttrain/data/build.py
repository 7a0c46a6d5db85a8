"""`python -m fasttrain.data build`: ImageNet JPEG folders to the seeds' TFRecord shards, without TensorFlow.

    python -m fasttrain.data build --train_directory DIR --validation_directory DIR
        --output_directory DIR --labels_file imagenet_lsvrc_2015_synsets.txt
        --imagenet_metadata_file imagenet_metadata.txt --bounding_box_file imagenet_2012_bounding_boxes.csv
        [--train_shards 1024] [--validation_shards 128] [--num_threads 8]
        [--workers N] [--write_index] [--row_checkpoints] [--on_bad stop|skip]

writes what TensorFlow models' build_imagenet_data.py (research/inception/inception/data/) writes: the
same shard names, the same images in each shard in the same order, each record's features equal to the
script's (checked feature by feature against shards TensorFlow made, tests/test_data_build.py). The
flags and defaults are the script's; `--num_threads` is part of the layout there (each thread writes
num_shards / num_threads shards of its share of the list) and is here too, while the work is spread
over `--workers` processes (default: every core), a shard per job. What goes where:
fasttrain/data/build_lists.py (sorted listing, then the script's seeded shuffle and split); what each
image becomes: fasttrain/data/build_image.py; a shard's job: fasttrain/data/build_shard.py; the jobs
run: fasttrain/data/build_run.py. Two things differ from the script on purpose: the directory listing
is sorted (the script's order depends on the file system), and a split directory left out is not built
(the script's default, /tmp/, only finds nothing).

Built for ImageNet's 1.28 million images:
- resumable: each shard is written as `.<name>.<pid>.tmp` and renamed when complete, so a shard that
  exists is finished and a rerun of the same command keeps it. `.fasttrain-build-<split>.json` holds a
  hash of the split's file list, labels, texts and boxes: shards made from another list or with other
  settings are refused, not mixed. One build at a time per output directory (a lock file).
- bad inputs: where the script's thread dies on an image (leaving a partial shard, exit status 0),
  the run stops on it with one line naming the file, and writes no partial shard; `--on_bad skip`
  names it and leaves it out of its shard instead (the other shards are unchanged). A split directory
  with no images in synset folders (the flat validation folder as ImageNet ships it) stops the run
  the same way, or is skipped.
- `--write_index` writes DALI's `<shard>.idx` beside each shard; `--row_checkpoints` the JPEG row
  checkpoints the torch loader uses (`<shard>.rows`, fasttrain/data/jpeg/row_index.py; with their .idx),
  in the same job, while the shard is in the page cache.
- progress every 10 s: images, images/s, ETA.

Speed (measured, bench/bench_build.py; bench/results/2026-11-27-cpu-build/): 0.84 CPU ms per image
in the jobs, about 1,200 images per second per core, on real photos of 465x415 px and 61 kB on
average (2 workers on a shared 2-core AMD EPYC VM, files in the page cache); TensorFlow's script's
steps took 1.34 ms on the same photos. Most of it is the check that a JPEG decodes (0.11 ms + 0.008
ms per kB): at ImageNet's 108 kB an image, about 1.2 ms (830 images per core-second; extrapolated,
not measured on ImageNet). --row_checkpoints adds about 0.95 ms an image, --write_index nothing
measurable; the command's start costs about 2 CPU seconds.
"""

from __future__ import annotations

import argparse
import fcntl
import json
from pathlib import Path

from fasttrain.data.build_labels import first_mismatch
from fasttrain.data.build_lists import Annotations, EmptySplit, SplitPlan, plan_split, read_annotations
from fasttrain.data.build_run import _run, _write_json
from fasttrain.data.build_shard import ShardJob, find_shards, has_row_checkpoints, load_index
from fasttrain.data.errors import DataError
from fasttrain.errors import SettingError


class BuildFlagError(DataError, SettingError):
    """A build flag that cannot work (exit 2, as argparse's own errors)."""


def refuse_empty_shards(plan: SplitPlan) -> None:
    """BuildFlagError when the script's split of the images would leave a shard without any.

    The script writes such a shard (a 0-byte file, as TF's TFRecordWriter leaves it), and the trainer
    and `verify` refuse 0-byte shards, which are far more often a copy that failed: a build that ends
    well should not hand over a directory the trainer then refuses."""
    empty = sum(1 for a, b in plan.shard_ranges() if a == b)
    if not empty:
        return
    n, threads = len(plan.files), plan.num_threads
    most = n // threads * threads  # the most shards, a multiple of --num_threads, that leave none empty
    advice = (
        f"give --{plan.split}_shards {most} or fewer (a multiple of --num_threads {threads})"
        if most
        else f"give --num_threads {n} or fewer and --{plan.split}_shards at most {n}"
    )
    raise BuildFlagError(
        f"--{plan.split}_shards {plan.num_shards} is more than the {n} images of the {plan.split} split "
        f"can fill: {empty} shard{'s' * (empty != 1)} would be empty (0 bytes), which the trainer refuses; "
        f"{advice}"
    )


LABELS_RECORD = ".fasttrain-build-labels.json"  # the synsets, in label order, of the shards in a directory


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The build subcommand's flags: build_imagenet_data.py's names and defaults, then fasttrain's."""
    p.add_argument(
        "--train_directory", default="", help="folder of train synset folders ('' or absent: none)"
    )
    p.add_argument("--validation_directory", default="", help="folder of validation synset folders")
    p.add_argument("--output_directory", required=True, help="where the shards go")
    p.add_argument("--train_shards", type=int, default=1024)
    p.add_argument("--validation_shards", type=int, default=128)
    p.add_argument("--num_threads", type=int, default=8, help="part of the script's shard layout")
    p.add_argument("--labels_file", default="imagenet_lsvrc_2015_synsets.txt")
    p.add_argument("--imagenet_metadata_file", default="imagenet_metadata.txt")
    p.add_argument(
        "--bounding_box_file",
        default="./imagenet_2012_bounding_boxes.csv",
        help="process_bounding_boxes.py's output ('': no boxes)",
    )
    p.add_argument("--workers", type=at_least_one, default=None, help="processes (default: every core)")
    p.add_argument("--write_index", action="store_true", help="write DALI's <shard>.idx files too")
    p.add_argument(
        "--row_checkpoints", action="store_true", help="write the JPEG row checkpoints (<shard>.rows) too"
    )
    p.add_argument("--on_bad", choices=("stop", "skip"), default="stop", help="on a bad image or empty split")


def _lock(output: Path):
    lock = open(output / ".fasttrain-build.lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise DataError(
            f"another build is writing to {output}; wait for it to end or give another --output_directory"
        ) from None
    return lock  # held until the process exits


def _jobs_for(plan: SplitPlan, annotations: Annotations, output: Path, args) -> tuple[list[ShardJob], int]:
    """The split's jobs (shards not yet written, sidecars missing) and how many shards are kept."""
    digest_file = output / f".fasttrain-build-{plan.split}.json"
    digest = plan.digest(annotations)
    existing = find_shards(output, plan.split)
    for stale in output.glob(f".{plan.split}-*.tmp"):  # left by a build that was killed (we hold the lock)
        stale.unlink(missing_ok=True)
    if existing:
        try:
            held = json.loads(digest_file.read_text())["digest"]
        except (OSError, ValueError, KeyError):
            held = None
        if held != digest:
            raise DataError(
                f"{output} already holds {len(existing)} {plan.split} shards ({existing[0].name}, ...) that "
                "another file list or other settings made; delete them or give an empty --output_directory"
            )
    else:
        summary = {"digest": digest, "images": len(plan.files), "shards": plan.num_shards}
        summary["num_threads"] = plan.num_threads
        digest_file.write_text(json.dumps(summary) + "\n")
    jobs, kept = [], 0
    for shard, (start, end) in enumerate(plan.shard_ranges()):
        path = output / plan.shard_name(shard)
        if path.exists():
            kept += 1
            if args.write_index and not args.row_checkpoints:
                load_index(path)  # validates or rebuilds <shard>.idx (a header scan)
            if args.row_checkpoints and not has_row_checkpoints(path):
                records = len(load_index(path)[1])  # what its progress counts (a header scan, or the .idx)
                jobs.append(ShardJob(path, plan.directory, False, records, False, True, False))  # rows only
            continue
        skip_bad = args.on_bad == "skip"
        jobs.append(
            ShardJob(
                path, plan.directory, True, end - start, args.write_index, args.row_checkpoints, skip_bad
            )
        )
        jobs[-1].plan, jobs[-1].first = plan, start
    return jobs, kept


def _check_labels(output: Path, annotations: Annotations, out=print) -> None:
    """Refuse a labels file other than the one the shards already in `output` were labelled with.

    Each split's own record (.fasttrain-build-<split>.json) guards that split; this one guards the
    pair: the validation split built in one run and the train split in another, from a labels file in
    another order, gave one synset two labels, and training then scored against the wrong classes.
    Shards without that record (copied in, or TensorFlow's) are checked by their records' synsets."""
    path = output / LABELS_RECORD
    try:
        held = json.loads(path.read_text())["synsets"]
    except (OSError, ValueError, KeyError, TypeError):
        held = None
    shards = [p for split in ("train", "validation") for p in find_shards(output, split)]
    if held is None and shards:  # copied in, or made elsewhere: their records say
        problem = first_mismatch(shards, annotations.synsets, out)
        if problem is not None:
            raise DataError(
                f"{output} holds shards labelled from another labels file than "
                f"{annotations.labels_file}: {problem}; give the labels file they were built with, "
                "or another --output_directory"
            )
    if held is not None and shards and held != annotations.synsets:
        k = next((i for i, (a, b) in enumerate(zip(held, annotations.synsets)) if a != b), None)
        if k is None:
            difference = f"{len(held)} synsets there, {len(annotations.synsets)} in {annotations.labels_file}"
        else:
            difference = (
                f"label {k + 1} is {held[k]} there, {annotations.synsets[k]} in {annotations.labels_file}"
            )
        raise DataError(
            f"{output} holds shards ({shards[0].name}, ...) labelled from another labels file "
            f"({difference}); give the labels file they were built with, or another --output_directory"
        )
    if held != annotations.synsets:
        _write_json(path, {"labels_file": annotations.labels_file, "synsets": annotations.synsets})


def build(args, out=print) -> int:
    """Run the build subcommand; returns the exit status (DataError: the caller prints one line)."""
    splits = [
        (s, d, n)
        for s, d, n in (
            ("validation", args.validation_directory, args.validation_shards),  # the script's order
            ("train", args.train_directory, args.train_shards),
        )
        if d
    ]
    if not splits:
        raise DataError("nothing to build: give --train_directory, --validation_directory or both")
    if not str(args.output_directory).strip():  # Path('') is the current directory: shards went there
        raise DataError("--output_directory is empty; give the directory to write the shards to")
    if args.num_threads < 1:
        raise BuildFlagError(f"--num_threads {args.num_threads} must be at least 1")
    for split, _, shards in splits:
        if shards < 1 or shards % args.num_threads:
            raise BuildFlagError(
                f"--{split}_shards {shards} must be a positive multiple of --num_threads {args.num_threads} "
                "(the script's layout gives each thread the same number of shards)"
            )
    annotations = read_annotations(args.labels_file, args.imagenet_metadata_file, args.bounding_box_file)
    if not args.bounding_box_file:
        out("no --bounding_box_file: every record gets empty box lists")
    plans = []
    for split, directory, shards in splits:
        try:
            plan = plan_split(split, directory, annotations, shards, args.num_threads)
        except EmptySplit as e:
            if args.on_bad == "stop":
                raise
            out(f"skipping the {split} split: {e}")
            continue
        refuse_empty_shards(plan)
        out(f"{split}: {len(plan.files)} images from {directory} -> {shards} shards")
        for note in plan.notes:
            out(f"  {note}")
        plans.append(plan)
    if not plans:
        raise DataError("no split has images to build (each was skipped, above); nothing was written")
    output = Path(args.output_directory)
    try:
        output.mkdir(parents=True, exist_ok=True)
        lock = _lock(output)
    except OSError as e:
        raise DataError(
            f"cannot write to {output} ({e.strerror}); give a writable --output_directory"
        ) from None
    _check_labels(output, annotations, out)
    jobs, kept = [], 0
    for plan in plans:
        split_jobs, split_kept = _jobs_for(plan, annotations, output, args)
        jobs += split_jobs
        kept += split_kept
    try:
        return _run(jobs, annotations, kept, args, out)
    finally:
        lock.close()
