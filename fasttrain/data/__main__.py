"""Data tools: python -m fasttrain.data {verify, ls, make-synthetic, row-checkpoints, build, warm-up}.

    verify DIR [--decode] [--split S] [--workers N] [--label-offset 0] [--num-classes 1001]
               [--cache-dir D] [--no-index]
        check every record's CRCs and Example fields (and JPEG with --decode), write or validate the
        index files, print per-split record counts, label ranges and records/s; exit 1 with a per-file
        report when any record is bad, a shard is empty or unreadable, or a shard set is incomplete
        (a number of its -of-NNNNN count missing) or mixes counts
    ls DIR [--split train|validation] [--limit N]
        one JSON object per record: file, offset, size, label (as stored), filename, height, width,
        boxes ([ymin, xmin, ymax, xmax] each), synset, text, jpeg_bytes
    make-synthetic --out DIR [--train-shards N] [--val-shards M] [--per-shard K] [--classes C] [--seed S]
        a small data set in the converter's exact layout (see fasttrain.data.synthetic)
    row-checkpoints DIR [--workers N] [--cache-dir D] [--force]
        build the JPEG row checkpoints (<shard>.rows sidecars) the torch loader decodes crops through
        (fasttrain.data.jpeg.row_index; `python -m fasttrain.data.jpeg_rows DIR`, the older spelling,
        runs the same build)
    build --train_directory D --validation_directory D --output_directory D --labels_file F ...
        ImageNet JPEG folders to the shards build_imagenet_data.py writes (see fasttrain.data.build)
    warm-up [--jobs N]
        compile the loaders' numba kernels into numba's disk cache, N processes at once (default: the
        cores this process may use), so that the first run on a machine does not spend a minute or
        two compiling them on one core (see fasttrain.data.warm)

Exit status: 0 fine, 1 bad data (one line, no traceback), 2 bad arguments (a DIR that is not a
directory too, as for the trainer's --data_dir). Messages name settings as the trainer's flags
(`--skip_corrupt`), as the trainer prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from fasttrain.cli_parser import Parser
from fasttrain.data import warm
from fasttrain.data.build import add_arguments as add_build_arguments
from fasttrain.data.build import build
from fasttrain.data.errors import DataError
from fasttrain.data.imagenet import SPLITS, decode_record, list_shards
from fasttrain.data.jpeg import row_build
from fasttrain.data.synthetic import make_synthetic
from fasttrain.data.tfrecord import scan_records
from fasttrain.data.verify import verify_dataset
from fasttrain.errors import SettingError, flag_text
from fasttrain.threads import available_cores


def _count(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m fasttrain.data", description="TFRecord data tools")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("verify", help="check every record (CRC, Example, label; JPEG with --decode)")
    p.add_argument("data_dir")
    p.add_argument("--decode", action="store_true", help="also decode every JPEG")
    p.add_argument("--split", choices=SPLITS, help="only this split (default: both)")
    p.add_argument("--workers", type=_count(1), default=None, help="processes (default: all cores)")
    # Both spellings: the label error names the trainer's --label_offset / --num_classes.
    p.add_argument(
        "--label-offset",
        "--label_offset",
        type=int,
        default=0,
        choices=(0, -1),
        help="as the trainer's --label_offset",
    )
    p.add_argument(
        "--num-classes",
        "--num_classes",
        type=_count(1),
        default=1001,
        help="labels + offset must be in [0, this)",
    )
    p.add_argument("--cache-dir", default=None, help="where index files go if DIR is read-only")
    p.add_argument("--no-index", action="store_true", help="do not write index files")

    p = commands.add_parser("ls", help="one JSON line per record")
    p.add_argument("data_dir")
    p.add_argument("--split", choices=SPLITS, help="only this split (default: train, then validation)")
    p.add_argument("--limit", type=_count(0), default=0, help="stop after N records (0: all)")

    p = commands.add_parser("make-synthetic", help="write a small data set in the converter's layout")
    p.add_argument("--out", required=True)
    p.add_argument("--train-shards", type=_count(0), default=4)
    p.add_argument("--val-shards", type=_count(0), default=1)
    p.add_argument("--per-shard", type=_count(1), default=750)  # 0 wrote empty shards the trainer refuses
    p.add_argument("--classes", type=_count(1), default=10)
    p.add_argument("--seed", type=int, default=0)

    p = commands.add_parser(
        "row-checkpoints",
        help="build the JPEG row checkpoints the torch loader decodes crops through",
        description=row_build.COMMAND_HELP,
    )
    row_build.add_arguments(p)
    add_build_arguments(
        commands.add_parser("build", help="JPEG folders to TFRecord shards, as TF's converter")
    )
    p = commands.add_parser(
        "warm-up",
        help="compile the loaders' numba kernels into numba's cache, several processes at once",
        description=(
            "Compile the loaders' numba kernels into numba's disk cache (the __pycache__ folders, or "
            "NUMBA_CACHE_DIR), split into parts that compile in processes of their own, several at once. "
            "The first run on a machine, or of a new fasttrain version, otherwise compiles them on one core "
            "before its first step. Run it once per machine (or in a Docker image's build)."
        ),
    )
    p.add_argument(
        "--jobs", type=_count(1), default=None, help="processes at once (default: the cores this one may use)"
    )
    return parser


def _verify(args) -> int:
    report = verify_dataset(
        args.data_dir,
        decode=args.decode,
        splits=[args.split] if args.split else None,
        label_offset=args.label_offset,
        num_classes=args.num_classes,
        cache_dir=args.cache_dir,
        workers=args.workers,
        write_index=not args.no_index,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    for split in SPLITS if not args.split else [args.split]:
        print(report.split_summary(split))
    indexes: dict[str, int] = {}
    for shard in report.shards:
        indexes[shard.index] = indexes.get(shard.index, 0) + 1
    print("index files: " + ", ".join(f"{n} {state}" for state, n in sorted(indexes.items())))
    _print_row_checkpoints(report, args)
    mb = sum(s.bytes for s in report.shards) / 1e6
    print(
        f"checked {report.records} records ({mb:.1f} MB) in {report.seconds:.1f} s: "
        f"{report.records_per_second():.0f} records/s, {mb / max(report.seconds, 1e-9):.1f} MB/s"
    )
    if report.ok:
        return 0
    for problem in report.problems:
        print(problem)
    for shard in report.bad:
        print(f"{shard.file}: {len(shard.bad)} bad record(s)")
        for message in shard.bad:
            print(f"  {message}")
    n_bad = sum(len(s.bad) for s in report.bad)
    sets = f"{len(report.problems)} shard-set problem(s), " if report.problems else ""
    print(f"FAILED: {sets}{n_bad} bad record(s) in {len(report.bad)} file(s)", file=sys.stderr)
    return 1


def _print_row_checkpoints(report, args, most: int = 10) -> None:
    """The shards' row-checkpoint sidecars: how many are current, stale or missing, and the stale ones
    (the loader ignores those, so they are not a failure of the data)."""
    states: dict[str, int] = {}
    for shard in report.shards:
        states[shard.rows] = states.get(shard.rows, 0) + 1
    print("row checkpoints: " + ", ".join(f"{n} {state}" for state, n in sorted(states.items())))
    stale = [s for s in report.shards if s.rows == "stale"]
    for shard in stale[:most]:
        print(f"  {shard.file}: stale row checkpoints, {shard.rows_problem}")
    if len(stale) > most:
        print(f"  ... and {len(stale) - most} more")
    if stale:
        cache = f" --cache-dir {args.cache_dir}" if args.cache_dir else ""
        print(
            "  the loader does not use them (the same images, more CPU); rebuild them: "
            f"python -m fasttrain.data row-checkpoints {args.data_dir} --force{cache}"
        )


def _ls(args) -> int:
    count = 0
    for split in [args.split] if args.split else SPLITS:
        try:
            shards = list_shards(args.data_dir, split, check=False)  # ls shows what there is
        except DataError:
            if args.split:
                raise
            continue
        for shard in shards:
            for offset, size, payload in scan_records(shard):
                # Labels as stored: no offset, and a range wide enough to accept any stored value.
                r = decode_record(payload, shard, offset, label_offset=0, num_classes=1 << 62)
                line = {
                    "file": str(shard),
                    "offset": offset,
                    "size": size,
                    "label": r.stored_label,
                    "filename": r.filename,
                    "height": r.height,
                    "width": r.width,
                    "boxes": [[round(float(v), 6) for v in box] for box in r.boxes],
                    "synset": r.synset,
                    "text": r.text,
                    "jpeg_bytes": len(r.jpeg),
                }
                print(json.dumps(line))
                count += 1
                if args.limit and count >= args.limit:
                    return 0
    return 0


def _make_synthetic(args) -> int:
    start = time.perf_counter()
    try:
        make_synthetic(args.out, args.train_shards, args.val_shards, args.per_shard, args.classes, args.seed)
    except OSError as e:
        raise DataError(
            f"cannot write the data set to {args.out} ({e.strerror}); pick a writable --out"
        ) from None
    print(
        f"wrote {args.train_shards * args.per_shard} train and {args.val_shards * args.per_shard} validation "
        f"records to {args.out} in {time.perf_counter() - start:.1f} s"
    )
    return 0


def _row_checkpoints(args) -> int:
    row_build.build_sidecars(args.data_dir, workers=args.workers, cache_dir=args.cache_dir, force=args.force)
    return 0


def _warm_up(args) -> int:
    jobs = args.jobs or available_cores()
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    say(f"warm-up: {len(warm.PARTS)} parts of the loaders' numba kernels, {jobs} at once")
    result = warm.warm_up_parallel(jobs, say=say)
    here = result["compiled_here"]
    how = "every kernel from numba's cache"
    if here:
        names = ", ".join(here[:10]) + (", ..." if len(here) > 10 else "")
        how = f"compiling {len(here)} kernel{'s' * (len(here) != 1)} the parts left: {names}"
    parts_s, here_s = result["parts_s"], result["here_s"]
    print(f"warm-up: the parts in {parts_s:.1f} s, then {here_s:.1f} s in this process ({how})")
    return 0


def _stop_on_sigterm() -> list[int]:
    """SIGTERM (kill, timeout, a scheduler, docker stop) ends a command as Ctrl-C does: a build's pool
    and temporary files are cleaned up and one line said, where the default action left the pool's
    workers orphaned, each printing tracebacks. The list gets the signal's number when one came.
    (The workers put the default action back: fasttrain.data.build_shard.init_worker.)"""
    stopped: list[int] = []

    def stop(signum, frame):
        stopped.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    return stopped


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "make-synthetic" and args.train_shards + args.val_shards == 0:
        parser.error("make-synthetic needs --train-shards or --val-shards above 0")
    if args.command == "make-synthetic" and not args.out.strip():  # Path('') wrote into the current directory
        parser.error("make-synthetic --out is empty; give the directory to write the data set to")
    if args.command in ("verify", "ls", "row-checkpoints") and not Path(args.data_dir).is_dir():
        what = "is not a directory" if Path(args.data_dir).exists() else "does not exist"
        print(f"error: {args.data_dir} {what}; give the directory of the TFRecord shards", file=sys.stderr)
        return 2
    command = {
        "verify": _verify,
        "ls": _ls,
        "make-synthetic": _make_synthetic,
        "row-checkpoints": _row_checkpoints,
        "build": build,
        "warm-up": _warm_up,
    }[args.command]
    stopped = _stop_on_sigterm()
    try:
        status = command(args)
        return 128 + stopped[0] if status == 130 and stopped else status
    except SettingError as e:  # a build flag that cannot work with these inputs (too many shards)
        print(f"error: {flag_text(e)}", file=sys.stderr)
        return 2
    except DataError as e:
        # The trainer's settings as these commands spell them: DIR is an argument here, and the cache
        # directory --cache-dir (build writes its index files beside its shards and has neither).
        spelled = {"data_dir": "DIR", "data_cache_dir": "--cache-dir"}
        print(f"error: {flag_text(e, spelled)}", file=sys.stderr)  # a raw-image directory is named in it
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: one line, not a traceback (what was written stays whole)
        print("interrupted", file=sys.stderr)
        return 128 + (stopped[0] if stopped else signal.SIGINT)
    except BrokenPipeError:  # `ls | head`: the reader went away, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a shard that cannot be read (ls reads whatever is there)
        print(f"error: cannot read {e.filename} ({e.strerror})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
