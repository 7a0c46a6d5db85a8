"""`python -m fasttrain.data row-checkpoints` (and its older spelling, `python -m
fasttrain.data.jpeg_rows`): the sidecars of fasttrain.data.jpeg.row_index built for every shard of a
data directory, several processes at once, with progress lines."""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

from fasttrain.cli_parser import Parser
from fasttrain.data.build import at_least_one
from fasttrain.data.errors import DataError
from fasttrain.data.imagenet import SPLITS, find_shards
from fasttrain.data.jpeg.row_index import RowIndex, build_row_index
from fasttrain.data.tfrecord import load_index
from fasttrain.stop_signals import ignore_sigint


def _build_job(args) -> tuple[str, int, float, Path]:
    shard, cache_dir = args
    start = time.process_time()
    written = build_row_index(shard, cache_dir)
    return str(shard), len(load_index(shard, cache_dir)[1]), time.process_time() - start, written.parent


COMMAND_HELP = (
    "Build the JPEG checkpoint sidecars (<shard>.rows) of every train-* and validation-* shard in "
    "DATA_DIR, so the loader skips the entropy decoding outside crop windows. A sidecar holds for its "
    "shard's size, mtime and records (each entry keeps its record's data CRC): stale ones (shards "
    "rewritten, copied without their mtimes or replaced; sidecars of an older fasttrain) are rebuilt. "
    "--force rebuilds all, e.g. after `python -m fasttrain.data verify` found a sidecar stale whose "
    "first, middle and last records still match."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The build's arguments, for `python -m fasttrain.data row-checkpoints` and the old spelling alike."""
    parser.add_argument("data_dir", metavar="DATA_DIR")
    parser.add_argument("--workers", type=at_least_one, default=1, help="processes (default 1)")
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
    elsewhere: dict[Path, int] = {}  # sidecars not beside their shard (a read-only DATA_DIR): where
    pool = multiprocessing.Pool(workers, ignore_sigint) if workers > 1 else None  # Ctrl-C: this process's
    try:
        for shard, records, seconds, folder in (
            pool.imap_unordered(_build_job, jobs) if pool else map(_build_job, jobs)
        ):
            done, images, cpu = done + 1, images + records, cpu + seconds
            if folder != Path(shard).parent:
                elsewhere[folder] = elsewhere.get(folder, 0) + 1
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
    for folder, count in elsewhere.items():  # the trainer looks there too (--data_cache_dir, as given here)
        given = f" (give the trainer --data_cache_dir={cache_dir})" if cache_dir is not None else ""
        print(f"rows: {data_dir} is not writable: the sidecars of {count} shards are in {folder}{given}")


def main(argv=None) -> int:
    """The build as `python -m fasttrain.data.jpeg_rows DATA_DIR ...` (the spelling before
    `python -m fasttrain.data row-checkpoints`) has always run it: one line and exit status 2 for a
    DATA_DIR without shards, as before (the data tools' subcommand says 1 for that, 2 for a DATA_DIR
    that is not a directory, as their other subcommands do)."""
    parser = Parser(prog="python -m fasttrain.data.jpeg_rows", description=COMMAND_HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        build_sidecars(args.data_dir, workers=args.workers, cache_dir=args.cache_dir, force=args.force)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
