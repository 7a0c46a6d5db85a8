"""A build's shard jobs run, for `python -m fasttrain.data build` (fasttrain/data/build.py plans them):
in a pool of `--workers` processes (in one process, a thread of its own writes the progress lines),
each job given its images' entries as the pool asks for it; a progress line every PROGRESS_SECONDS;
the temporary files of unfinished shards removed after a failure or an interrupt; and the record of
the images `--on_bad skip` left out (SKIPPED_RECORD), folded from the workers' per-shard records, with
a note for those a finished shard still lacks.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from dataclasses import replace
from pathlib import Path

from fasttrain.checkpoint import write_atomic
from fasttrain.data.build_lists import Annotations
from fasttrain.data.build_progress import Ticker, progress_line
from fasttrain.data.build_shard import ShardFailed, ShardJob, init_worker, run_job, set_counter, skipped_path
from fasttrain.data.errors import DataError

PROGRESS_SECONDS = 10.0
SKIPPED_RECORD = ".fasttrain-build-skipped.json"  # shard name -> the images --on_bad skip left out of it


def _with_entries(jobs: list[ShardJob], annotations: Annotations):
    """Each job with its entries, made as the pool asks for the next job."""
    labels = {s: i + 1 for i, s in enumerate(annotations.synsets)}
    for job in jobs:
        if job.plan is None:
            yield job
            continue
        entries = []
        for relative in job.plan.files[job.first : job.first + job.images]:
            synset, name = relative.split("/", 1)
            entries.append(
                (relative, labels[synset], synset, annotations.texts[synset], annotations.boxes_of(name))
            )
        yield replace(job, entries=entries, plan=None)


def _left_out(output: Path) -> dict[str, list[str]]:
    """Shard name -> the images `--on_bad skip` left out of it (one line each), as recorded."""
    try:
        held = json.loads((output / SKIPPED_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return held if isinstance(held, dict) else {}


def _note_left_out(output: Path, out, written: set[str] = frozenset()) -> None:
    """A rerun keeps a finished shard, so an image left out of it, fixed since, stays out: say so.
    Not for the shards this run writes (`written`): it names their images as it leaves them out."""
    held = {
        name: lines
        for name, lines in _left_out(output).items()
        if (output / name).exists() and lines and name not in written
    }
    if held:
        lines = [line for name in sorted(held) for line in held[name]]
        out(
            f"note: {len(lines)} images an earlier --on_bad skip left out are still not in their shards "
            f"(first: {lines[0]}); to add them once fixed, delete those shards ({', '.join(sorted(held))}) "
            f"and run the build again ({output / SKIPPED_RECORD} lists them)"
        )


def _fold_shard_records(output: Path) -> None:
    """Fold the workers' per-shard records of left-out images (build_shard.skipped_path) into the build's
    record: one a killed build left beside a finished shard is the only record of those images; one
    beside no shard belongs to a shard that was never finished (it is written again), and goes."""
    found = {path: output / path.name[1 : -len(".skipped")] for path in output.glob(".*.skipped")}
    if not found:
        return
    left_out = _left_out(output)
    for path, shard in found.items():
        if shard.exists():
            try:
                lines = json.loads(path.read_text())
            except (OSError, ValueError):
                lines = [f"(the record {path} of images left out of {shard.name} does not read)"]
            left_out[shard.name] = [str(line) for line in lines] if isinstance(lines, list) else []
    _write_json(output / SKIPPED_RECORD, left_out)
    for path in found:
        path.unlink(missing_ok=True)


def _run(jobs: list[ShardJob], annotations: Annotations, kept: int, args, out) -> int:
    output = Path(args.output_directory)
    _fold_shard_records(output)
    try:
        return _run_jobs(jobs, annotations, kept, args, out, output)
    finally:
        _note_left_out(output, out, {job.path.name for job in jobs if job.write})


def _run_jobs(jobs: list[ShardJob], annotations: Annotations, kept: int, args, out, output: Path) -> int:
    if not jobs:
        out(f"nothing to do: all {kept} shards are written already")
        return 0
    left_out = _left_out(output)
    # The progress counts images written and, in finished shards given row checkpoints, records read.
    total = sum(j.images for j in jobs)
    writes = sum(1 for j in jobs if j.write)
    to_write = sum(j.images for j in jobs if j.write)
    workers = max(1, min(args.workers or len(os.sched_getaffinity(0)), len(jobs)))
    rows_only = f", {len(jobs) - writes} finished ones to give row checkpoints" if len(jobs) > writes else ""
    out(
        f"{writes} shards to write ({to_write} images){rows_only}, {kept} already written, "
        f"{workers} processes"
    )
    counter = multiprocessing.Value("q", 0)
    start = time.perf_counter()
    last = [start]  # when the last progress line was written (the ticker's and this loop's)
    images, skipped, cpu = 0, 0, 0.0
    pool = multiprocessing.Pool(workers, init_worker, (counter,)) if workers > 1 else None
    set_counter(counter)
    feed = _with_entries(jobs, annotations)
    results = pool.imap_unordered(run_job, feed) if pool else map(run_job, feed)
    # In one process the jobs run in this thread, a whole shard per next(): a thread of its own writes
    # the progress lines then (a one-shard build wrote none, and looked hung).
    line = lambda: progress_line(out, counter.value, total, start)  # noqa: E731
    ticker = None if pool else Ticker(line, last, PROGRESS_SECONDS)
    try:
        for done in range(1, len(jobs) + 1):
            while True:
                try:
                    result = results.next(timeout=PROGRESS_SECONDS) if pool else next(results)
                    break
                except multiprocessing.TimeoutError:
                    last[0] = progress_line(out, counter.value, total, start)
            images, cpu = images + result.images, cpu + result.cpu_seconds
            for line in result.skipped:
                out(f"skipped {line}")
            skipped += len(result.skipped)
            written = result.images > 0 or result.skipped  # a rows-only job leaves the shard as it was
            if written and (result.skipped or result.name in left_out):  # the record: as the shard is now
                left_out.pop(result.name, None)
                if result.skipped:
                    left_out[result.name] = result.skipped
                _write_json(output / SKIPPED_RECORD, left_out)
            skipped_path(output / result.name).unlink(missing_ok=True)  # in the build's record now
            if time.perf_counter() - last[0] >= PROGRESS_SECONDS and done < len(jobs):
                last[0] = progress_line(out, counter.value, total, start)
    except ShardFailed as e:
        raise DataError(str(e)) from None
    except KeyboardInterrupt:
        out("interrupted: the finished shards are kept; run the same command again to go on")
        return 130
    finally:
        if ticker:
            ticker.stop()
        if pool:
            pool.terminate()  # after a failure: the other shards stop half-written ...
            pool.join()
        _remove_temporaries(jobs)  # ... and their temporary files go (a killed worker leaves its own)
    seconds = time.perf_counter() - start
    rows = len(jobs) - writes
    read = total - to_write  # the records of finished shards given row checkpoints
    per_image = 1e3 * cpu / max(images + skipped + read, 1)
    out(
        f"wrote {images} images in {writes} shards"
        + (f" and row checkpoints for {rows} finished shards ({read} records)" if rows else "")
        + f" to {args.output_directory} in {seconds:.2f} s "
        f"({(images + read) / max(seconds, 1e-9):.0f} images/s, {per_image:.2f} CPU ms per image)"
        + (f"; left out {skipped} bad images (named above)" if skipped else "")
    )
    return 0


def _write_json(path: Path, value) -> None:
    """`value` as JSON in `path`, replaced whole (fasttrain.checkpoint.write_atomic)."""
    text = (json.dumps(value) + "\n").encode()
    write_atomic(path, lambda f: f.write(text))


def _remove_temporaries(jobs: list[ShardJob]) -> None:
    """Delete the `.<shard>.<pid>.tmp` files of the jobs' shards (one listing of the directory)."""
    names = {job.path.name for job in jobs}
    for directory in {job.path.parent for job in jobs}:
        for entry in os.scandir(directory):
            if entry.name.endswith(".tmp") and entry.name[1:].rsplit(".", 2)[0] in names:
                Path(entry.path).unlink(missing_ok=True)
