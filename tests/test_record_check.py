"""fasttrain/data/record_check.py without DALI (tests/test_dali_crc.py checks it under DALI's loader):
the thread that checks an epoch's records ahead of the batches holds a bounded number of shards open."""

import os
import time
from pathlib import Path

from fasttrain.data.record_check import AHEAD, MAX_OPEN_SHARDS, RecordCheck
from fasttrain.data.sharding import load_split
from fasttrain.data.tfrecord import write_records


def _open_shards(folder: Path) -> int:
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed since it was listed
            pass
    return sum(p.startswith(str(folder)) for p in paths)


def test_the_check_keeps_few_shards_open(tmp_path):
    # A shard per batch: the thread runs AHEAD batches past the one asked for, then waits. It held every
    # shard it had reached (all 1,024 of ImageNet's: "Too many open files" under a limit of 1,024).
    shards = AHEAD + 40
    for s in range(shards):
        write_records(tmp_path / f"train-{s:05d}-of-{shards:05d}", [b"record %d" % s])
    table = load_split(tmp_path, "train", tmp_path / "cache")
    assert len(table.files) == shards
    check = RecordCheck(table, [[p] for p in range(shards)], "advice")
    try:
        check.check(0)  # the thread checks batches 0..AHEAD on its own, then waits for the loader
        deadline = time.monotonic() + 60
        while check._checked < AHEAD + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert check._checked == AHEAD + 1
        opened = _open_shards(tmp_path)
        assert 1 <= opened <= MAX_OPEN_SHARDS, opened
        for b in range(shards):  # and every record still checks good
            check.check(b)
    finally:
        check.close()
    assert _open_shards(tmp_path) == 0
