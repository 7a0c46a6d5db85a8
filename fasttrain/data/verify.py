"""Offline check of a TFRecord data directory: every CRC, every Example, optionally every JPEG.

Per shard (shards run in parallel worker processes): scan all records checking both masked CRC32Cs;
parse each Example and check the required keys, their types, the label range ([0, num_classes) after
label_offset) and the box lists; with decode=True decode each JPEG and compare its size with
image/height and image/width. A bad data CRC is reported and the scan goes on (the framing is intact);
a bad length field or a truncation ends that shard's scan. The index file (DALI's tfrecord2idx format)
is compared with the scan and written or rewritten when missing or different (unless write_index is
False); a shard whose framing is broken gets no index. A shard's JPEG row checkpoints (<shard>.rows,
fasttrain.data.jpeg.row_index) are reported current, stale (and why: every entry's record CRC is compared
with the shard's) or none; a stale sidecar is not an error (the loader ignores it), only reported.

Throughput: CRC32C in C and the upb protobuf parser keep a core at several hundred MB/s, so on the real
140 GB set verify is I/O bound with a handful of workers; decode=True costs a JPEG decode per record.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fasttrain.data.errors import DataError
from fasttrain.data.imagenet import (
    SPLITS,
    decode_record,
    find_shards,
    list_shards,
    raw_images_hint,
    shard_set_problems,
)
from fasttrain.data.jpeg.decode import decode_jpeg
from fasttrain.data.jpeg.row_index import OTHER_RECORDS, RowIndex
from fasttrain.data.tfrecord import (
    index_candidates,
    index_is_older,
    read_index_file,
    save_index,
    scan_records_tolerant,
)
from fasttrain.errors import flag_text  # settings as the flags a user types: --skip_corrupt
from fasttrain.stop_signals import ignore_sigint


@dataclass
class ShardReport:
    file: str
    split: str
    records: int = 0
    bytes: int = 0
    label_min: int | None = None  # stored labels (before label_offset)
    label_max: int | None = None
    bad: list[str] = field(default_factory=list)  # one message (naming file and offset) per bad record
    index: str = "skipped"  # ok, written, rebuilt, not written (broken framing), skipped
    rows: str = "none"  # the row-checkpoint sidecar: current, stale, none, unchecked (broken framing)
    rows_problem: str = ""  # why it is stale
    synsets: dict[str, int] = field(default_factory=dict)  # image/class/synset -> stored label, as first seen
    synsets_name_classes: bool = True  # False: a synset with two labels here (a converter's placeholder)


@dataclass
class VerifyReport:
    shards: list[ShardReport]
    seconds: float
    problems: list[str] = field(default_factory=list)  # shard sets: missing numbers, mixed set sizes

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def bad(self) -> list[ShardReport]:
        return [s for s in self.shards if s.bad]

    @property
    def ok(self) -> bool:
        return not self.bad and not self.problems

    def records_per_second(self) -> float:
        return self.records / max(self.seconds, 1e-9)

    def split_summary(self, split: str) -> str:
        shards = [s for s in self.shards if s.split == split]
        if not shards:
            return f"{split}: no shards"
        labels = [v for s in shards for v in (s.label_min, s.label_max) if v is not None]
        label_range = f"labels {min(labels)}..{max(labels)}" if labels else "no labels"
        return f"{split}: {sum(s.records for s in shards)} records in {len(shards)} shards, {label_range}"


def _check_jpeg(record) -> str | None:
    try:  # the decoder the training pipeline uses
        height, width = decode_jpeg(record.jpeg, record.file, record.offset).shape[:2]
    except DataError as e:
        return flag_text(e)
    if record.height and record.width and (record.height, record.width) != (height, width):
        return (
            f"record at offset {record.offset} in {record.file}: image/height x image/width say "
            f"{record.height}x{record.width}, the JPEG is {height}x{width}"
        )
    return None


def _update_index(path: Path, entries: np.ndarray, cache_dir) -> str:
    candidates = index_candidates(path, cache_dir)
    existing = [c for c in candidates if c.is_file()]
    for candidate in existing:
        try:
            # An equal but older index is rewritten: training would take it for stale and rebuild it.
            if np.array_equal(read_index_file(candidate), entries) and not index_is_older(path, candidate):
                return "ok"
        except DataError:
            pass
    where = existing[:1] + [c for c in candidates if c not in existing[:1]]
    save_index(path, entries, where)
    return "rebuilt" if existing else "written"


def verify_shard(
    path,
    split: str,
    decode: bool,
    label_offset: int,
    num_classes: int,
    cache_dir=None,
    write_index: bool = True,
) -> ShardReport:
    """Check one shard; never raises for bad data (it is listed in the report)."""
    report = ShardReport(file=str(path), split=split)
    try:
        report.bytes = os.path.getsize(path)
        return _scan_shard(report, Path(path), decode, label_offset, num_classes, cache_dir, write_index)
    except OSError as e:  # a broken link, an unreadable file: a finding, not a traceback from a worker
        broken = (
            " (a broken symbolic link)"
            if isinstance(e, FileNotFoundError) and Path(path).is_symlink()
            else ""
        )
        report.bad.append(f"cannot read shard {path}{broken} ({e.strerror})")
        report.index = "not written (unreadable)"
        return report


def _scan_shard(
    report: ShardReport, path: Path, decode: bool, label_offset: int, num_classes: int, cache_dir, write_index
) -> ShardReport:
    entries, framing_ok = [], True
    for offset, size, payload, error in scan_records_tolerant(path, verify=True):
        if size == 0:  # truncation or a bad length field: the rest of the file cannot be framed
            report.bad.append(flag_text(error))
            framing_ok = False
            break
        entries.append((offset, size))
        report.records += 1
        if error is not None:
            report.bad.append(flag_text(error))
            continue
        try:
            record = decode_record(payload, path, offset, label_offset, num_classes)
        except DataError as e:
            report.bad.append(flag_text(e))
            continue
        label = record.stored_label
        if record.synset and report.synsets.setdefault(record.synset, label) != label:
            report.synsets_name_classes = False
        report.label_min = label if report.label_min is None else min(report.label_min, label)
        report.label_max = label if report.label_max is None else max(report.label_max, label)
        if decode and (problem := _check_jpeg(record)) is not None:
            report.bad.append(problem)
    if report.bytes == 0:
        report.bad.append(
            f"empty shard {path} (0 records): a copy that failed, or a build with more shards than "
            "images; re-copy it, or build again with fewer shards"
        )
    if not framing_ok:
        report.index = "not written (broken framing)"
        report.rows = "unchecked"
        return report
    if write_index:
        report.index = _update_index(path, np.array(entries, dtype=np.int64).reshape(-1, 2), cache_dir)
    report.rows, report.rows_problem = _sidecar_state(path, cache_dir)
    return report


def _sidecar_state(shard_path, cache_dir=None) -> tuple[str, str]:
    """('current', ''), ('stale', why) or ('none', '') of the shard's sidecar, as `verify` reports it:
    a sidecar that opens has every entry's data CRC checked against the shard (4 bytes read a record)."""
    index, problem = RowIndex.find(shard_path, cache_dir)
    if index is None:
        return ("none", "") if problem is None else ("stale", problem)
    offset = index.first_mismatch(shard_path)
    if offset is not None:
        return "stale", f"{OTHER_RECORDS}, from the record at offset {offset} on"
    return "current", ""


def _verify_shard_args(args) -> ShardReport:
    return verify_shard(*args)


def verify_dataset(
    data_dir,
    decode: bool = False,
    splits=None,
    label_offset: int = 0,
    num_classes: int = 1001,
    cache_dir=None,
    workers: int | None = None,
    write_index: bool = True,
    progress=None,
    progress_every: float = 10.0,
) -> VerifyReport:
    """Verify the shards of `splits` (default: both, skipping a split that has no shards).

    progress(text) is called every progress_every seconds with a one-line status.
    """
    if splits is None:
        found = {split: names for split in SPLITS if (names := find_shards(data_dir, split))}
        if not found:
            raise DataError(
                f"no train-* or validation-* shards in {data_dir}; point it at the converter's output"
                + raw_images_hint(data_dir)
            )
    else:
        found = {split: list_shards(data_dir, split, check=False) for split in splits}
    # Each shard's own problems (empty, unreadable) are found by reading it; the set's here.
    problems = [p for split in found for p in shard_set_problems(found[split])]
    jobs = [
        (p, split, decode, label_offset, num_classes, cache_dir, write_index)
        for split in found
        for p in found[split]
    ]
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    start = last = time.perf_counter()
    reports: list[ShardReport] = []
    # Ctrl-C reaches every process of the terminal's group: the workers leave it to this one (each
    # printed a traceback, and the pool one more).
    pool = multiprocessing.Pool(workers, ignore_sigint) if workers > 1 else None
    try:
        results = pool.imap_unordered(_verify_shard_args, jobs) if pool else map(_verify_shard_args, jobs)
        for report in results:
            reports.append(report)
            now = time.perf_counter()
            if progress and now - last >= progress_every:
                last = now
                records, mb = sum(r.records for r in reports), sum(r.bytes for r in reports) / 1e6
                progress(
                    f"verify: {len(reports)}/{len(jobs)} shards, {records} records, "
                    f"{records / (now - start):.0f} records/s, {mb / (now - start):.0f} MB/s"
                )
    finally:
        if pool:
            pool.terminate()
    order = {str(job[0]): i for i, job in enumerate(jobs)}
    reports.sort(key=lambda r: order[r.file])
    problems += label_problems(reports)
    return VerifyReport(reports, time.perf_counter() - start, problems)


def label_problems(reports: list[ShardReport], shown: int = 3) -> list[str]:
    """The splits labelled from two labels files: each split one-to-one between synsets and labels,
    the two splits not the same (the validation split built by one run, the train split by another
    from a reordered file), so training uses one numbering and evaluation scores on the other, and no
    record alone is wrong. Data whose synset field names no class (two labels for one synset within a
    split: another converter's placeholder) is not judged by it."""
    maps: dict[str, tuple[dict[str, int], dict[int, str], dict[str, str]]] = {}
    usable = {report.split: True for report in reports}
    for report in reports:
        label_of, synset_of, where = maps.setdefault(report.split, ({}, {}, {}))
        usable[report.split] &= report.synsets_name_classes
        for synset, label in report.synsets.items():
            if label_of.setdefault(synset, label) != label or synset_of.setdefault(label, synset) != synset:
                usable[report.split] = False
            where.setdefault(synset, Path(report.file).name)
    splits = [split for split in maps if usable[split]]
    if len(splits) < 2:
        return []
    (a_label, a_synset, a_where), (b_label, _, b_where) = maps[splits[0]], maps[splits[1]]
    problems = [
        f"synset {synset} has label {a_label[synset]} in {a_where[synset]}, {label} in {b_where[synset]}"
        for synset, label in b_label.items()
        if synset in a_label and a_label[synset] != label
    ]
    problems += [
        f"label {label} is synset {a_synset[label]} in {a_where[a_synset[label]]}, {synset} in "
        f"{b_where[synset]}"
        for synset, label in b_label.items()
        if label in a_synset and a_synset[label] != synset and synset not in a_label
    ]
    if not problems:
        return []
    more = f" and {len(problems) - shown} more" if len(problems) > shown else ""
    return [
        "the shards were labelled from different labels files: "
        + "; ".join(problems[:shown])
        + more
        + "; rebuild one split with the other's labels file (python -m fasttrain.data build)"
    ]
