"""Data mistakes that used to pass silently or end in a traceback: each is one line naming the file or flag.

Shard sets are judged by their names' -of-NNNNN count (a missing number, mixed counts, an empty or
unreadable shard); labels that misfit --num_classes / --label_offset are a configuration error that
--skip_corrupt does not skip; an index file older than its shard is rebuilt, not blamed on the shard;
the demo set survives two first runs building it at once; a record corrupted in the middle of a
training run stops it naming the shard and offset, or with --skip_corrupt is counted in metrics.jsonl.
"""

import io
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from launch_helpers import ENV, command, run_torchrun
from PIL import Image

from fasttrain.config import make_config
from fasttrain.data import DataError, build_loader
from fasttrain.data import imagenet as imagenet_module
from fasttrain.data import tfrecord as tfr
from fasttrain.data.__main__ import main as data_main
from fasttrain.data.imagenet import list_shards
from fasttrain.data.synthetic import converter_example, ensure_synthetic, make_synthetic
from fasttrain.data.tfrecord import build_index
from fasttrain.data.verify import verify_dataset
from fasttrain.errors import SettingError, flag_text

# --- a small data set with chosen labels -----------------------------------------------------------


def _jpeg(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((12, 12, 3), value, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _record(label: int, size: int = 0) -> bytes:
    """An Example as the converter writes it; `size` pads the filename to vary the record length."""
    name = "img.JPEG" + "x" * size
    return converter_example(_jpeg(label * 20 % 256), 12, 12, label, "n0", "t", name, [])


def _write_set(folder: Path, split: str, labels_per_shard: list[list[int]], count: int | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    count = len(labels_per_shard) if count is None else count
    for i, labels in enumerate(labels_per_shard):
        tfr.write_records(folder / f"{split}-{i:05d}-of-{count:05d}", [_record(v) for v in labels])
    return folder


def _data(tmp_path: Path, shards: int = 3, per_shard: int = 8, classes: int = 4) -> Path:
    labels = [[1 + (s * per_shard + r) % classes for r in range(per_shard)] for s in range(shards)]
    folder = _write_set(tmp_path / "data", "train", labels)
    return _write_set(folder, "validation", labels[:1])


def _cfg(data_dir, **overrides):
    values = dict(
        data_dir=str(data_dir),
        data_cache_dir=str(data_dir) + "-cache",
        data_backend="torch",
        batch_size=4,
        image_size=16,
        num_classes=4,
        label_offset=-1,
        num_workers=0,
    )
    return make_config(**{**values, **overrides})


def _one_line_error(argv, capsys) -> str:
    assert data_main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# --- shard sets --------------------------------------------------------------------------------------


def test_a_missing_shard_is_named_in_training_and_by_verify(tmp_path, capsys):
    data = _data(tmp_path)
    (data / "train-00001-of-00003").unlink()
    with pytest.raises(DataError, match=r"1 of 3 train shards missing from .*: train-00001-of-00003;"):
        build_loader(_cfg(data), "train", training=True)
    report = verify_dataset(data, workers=1, label_offset=-1, num_classes=4)
    assert not report.ok and report.records == 8 * 2 + 8
    assert data_main(["verify", str(data), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert "1 of 3 train shards missing" in out and "train-00001-of-00003" in out


def test_many_missing_shards_stay_one_line(tmp_path):
    data = _write_set(tmp_path / "d", "train", [[1] * 4], count=1024)
    with pytest.raises(DataError, match=r"1023 of 1024 train shards missing .*and 1020 more;") as e:
        list_shards(data, "train")
    assert "\n" not in str(e.value)


def test_mixed_shard_counts_are_one_error(tmp_path, capsys):
    data = _data(tmp_path)
    _write_set(data, "train", [[1] * 8] * 2, count=2)  # a second conversion into the same directory
    with pytest.raises(DataError, match=r"train shards in .* mix set sizes \(-of-00002, -of-00003\)"):
        build_loader(_cfg(data), "train", training=True)
    assert data_main(["verify", str(data), "--workers", "1"]) == 1
    assert "mix set sizes" in capsys.readouterr().out


def test_a_shard_numbered_beyond_its_count(tmp_path):
    data = _data(tmp_path)
    (data / "train-00002-of-00003").rename(data / "train-00003-of-00003")
    with pytest.raises(DataError, match="train-00003-of-00003 in .* numbered beyond the set's size 3"):
        list_shards(data, "train")


def test_an_empty_shard_is_an_error_not_a_shorter_epoch(tmp_path, capsys):
    data = _data(tmp_path)
    (data / "train-00001-of-00003").write_bytes(b"")
    empty = r"shard .*train-00001-of-00003 is empty \(0 bytes\): a copy that failed.*; re-copy it"
    with pytest.raises(DataError, match=empty):
        build_loader(_cfg(data), "train", training=True)
    assert data_main(["verify", str(data), "--workers", "1"]) == 1
    assert "empty shard" in capsys.readouterr().out


def test_a_dangling_symlink_shard_is_one_line(tmp_path, capsys):
    data = _data(tmp_path)
    (data / "train-00002-of-00003").unlink()
    os.symlink(tmp_path / "elsewhere" / "train-00002-of-00003", data / "train-00002-of-00003")
    with pytest.raises(DataError, match=r"train-00002-of-00003 is a broken symbolic link \(to .*elsewhere"):
        build_loader(_cfg(data), "train", training=True)
    # verify reads it in a worker: a finding in the report, not a FileNotFoundError traceback.
    assert data_main(["verify", str(data), "--workers", "2"]) == 1
    out = capsys.readouterr().out
    assert "cannot read shard" in out and "broken symbolic link" in out
    _one_line_error(["ls", str(data), "--split", "train"], capsys)


def test_an_unreadable_data_directory_is_one_line(tmp_path, monkeypatch, capsys):
    # Tests run as root, where chmod 000 does not stop reads: the PermissionError os.listdir raises
    # for an unreadable directory is simulated.
    data = _data(tmp_path)

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(imagenet_module.os, "listdir", refuse)
    with pytest.raises(DataError, match=f"cannot list the data directory {data} \\(Permission denied\\)"):
        build_loader(_cfg(data), "train", training=True)
    assert "cannot list" in _one_line_error(["verify", str(data)], capsys)


def test_a_data_directory_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match="is not a directory"):
        build_loader(_cfg(tmp_path / "file"), "train", training=True)
    assert data_main(["verify", str(tmp_path / "file")]) == 2  # a bad argument, as the trainer's --data_dir
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a directory" in err


def test_a_shard_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    # Root reads any file, so the PermissionError an unreadable shard raises is simulated too.
    from fasttrain.data import sharding

    data = _data(tmp_path)

    def refuse(path, cache_dir=None):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(sharding, "load_index", refuse)
    with pytest.raises(DataError, match=r"cannot read shard .*train-00000-of-00003 \(Permission denied\)"):
        build_loader(_cfg(data), "train", training=True)


# --- labels that do not fit the flags ------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, label",
    [(dict(num_classes=3), 4), (dict(label_offset=0), 4), (dict(num_classes=3, skip_corrupt=True), 4)],
)
def test_label_range_is_a_config_error_before_training_even_with_skip_corrupt(tmp_path, flags, label):
    data = _data(tmp_path)  # labels 1..4 in every shard's first records
    with pytest.raises(SettingError) as e:
        build_loader(_cfg(data, **flags), "train", training=True)
    message = flag_text(e.value)  # as the command line prints it
    assert isinstance(e.value, DataError) and "skip_corrupt" not in message
    assert f"label {label} + --label_offset" in message and "--num_classes=" in message
    assert "--label_offset=" in message and "train-0000" in message


def test_the_cli_exits_2_for_a_label_range_error_with_skip_corrupt(tmp_path):
    data = _data(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "fasttrain", f"--data_dir={data}", "--num_classes=3", "--skip_corrupt"]
        + ["--max_steps=2", "--batch_size=4", "--image_size=16", "--num_workers=0", "--eval_at_end=false"]
        + [f"--train_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FASTTRAIN_CACHE": str(tmp_path / "cache")},
    )
    assert out.returncode == 2, out.stderr
    assert (
        out.stderr.count("\n") == 1 and "--num_classes=3" in out.stderr and "skip_corrupt" not in out.stderr
    )


def test_a_bad_label_past_the_first_records_is_not_skipped(tmp_path):
    # The pre-training check reads 8 records per shard; a misfit label further in is found mid-epoch.
    data = _write_set(tmp_path / "data", "train", [[1] * 12 + [5] + [1] * 3])
    loader = build_loader(_cfg(data, skip_corrupt=True, batch_size=16), "train", training=True)
    with pytest.raises(SettingError, match=r"label 5 \+ label_offset -1"):
        list(loader)


# --- index files ---------------------------------------------------------------------------------------


def _sizes_shard(path: Path, sizes: list[int]) -> None:
    tfr.write_records(path, [b"r" * s for s in sizes])


def test_an_index_older_than_its_rewritten_shard_is_rebuilt_not_blamed_on_the_shard(tmp_path):
    shard = tmp_path / "train-00000-of-00001"
    sizes = [100, 200, 300, 400, 500, 600, 700]
    _sizes_shard(shard, sizes)
    index_path = tfr.ensure_index(shard, cache_dir=tmp_path / "cache")
    # Rewritten with records 1 and 2 swapped: same size, and the headers the index check samples
    # (records 0, 3 and 6) are where they were. Only the file times tell the index is stale.
    _sizes_shard(shard, [100, 300, 200, 400, 500, 600, 700])
    os.utime(index_path, ns=(10**18, 10**18))
    os.utime(shard, ns=(10**18 + 10**9, 10**18 + 10**9))
    assert tfr.check_index(shard, tfr.read_index_file(index_path)) is None  # the sampled check passes
    found, entries = tfr.load_index(shard, cache_dir=tmp_path / "cache")
    assert found == index_path and [tuple(e) for e in entries] == tfr.build_index(shard)
    with open(shard, "rb") as f:  # every record reads back: nothing blamed on the good shard
        assert [len(tfr.read_record(f, int(o), int(s), shard)) for o, s in entries] == [
            100,
            300,
            200,
            400,
            500,
            600,
            700,
        ]
    assert not tfr.index_is_older(shard, index_path)  # rewritten: the next run takes it as it is


def test_an_index_newer_than_its_shard_is_used_as_it_is(tmp_path):
    shard = tmp_path / "train-00000-of-00001"
    _sizes_shard(shard, [10, 20])
    index_path = tfr.ensure_index(shard, cache_dir=tmp_path / "cache")
    os.utime(shard, ns=(10**18, 10**18))
    os.utime(index_path, ns=(10**18 + 1, 10**18 + 1))
    tfr.load_index(shard, cache_dir=tmp_path / "cache")
    assert index_path.stat().st_mtime_ns == 10**18 + 1  # not rewritten


def test_a_stale_index_in_a_read_only_directory_is_rebuilt_in_the_cache(tmp_path, monkeypatch):
    shard = tmp_path / "data" / "train-00000-of-00001"
    shard.parent.mkdir()
    _sizes_shard(shard, [100, 200, 300, 400, 500, 600, 700])
    beside = tfr.ensure_index(shard, cache_dir=tmp_path / "cache")
    _sizes_shard(shard, [100, 300, 200, 400, 500, 600, 700])  # passes the sampled header check
    os.utime(beside, ns=(10**18, 10**18))
    os.utime(shard, ns=(10**18 + 10**9, 10**18 + 10**9))
    write = tfr.write_index_file

    def read_only_data_dir(path, entries):
        if path.parent == shard.parent:
            raise PermissionError(13, "Permission denied")
        write(path, entries)

    monkeypatch.setattr(tfr, "write_index_file", read_only_data_dir)
    found, entries = tfr.load_index(shard, cache_dir=tmp_path / "cache")
    assert (tmp_path / "cache") in found.parents and [tuple(e) for e in entries] == tfr.build_index(shard)
    assert tfr.ensure_index(shard, cache_dir=tmp_path / "cache") == found  # the stale one stays skipped


def test_verify_refreshes_an_equal_index_older_than_its_shard(tmp_path):
    data = _data(tmp_path)
    shard = data / "train-00000-of-00003"
    index_path = tfr.ensure_index(shard, cache_dir=tmp_path / "cache")
    os.utime(index_path, ns=(10**18, 10**18))
    os.utime(shard, ns=(10**18 + 10**9, 10**18 + 10**9))
    report = verify_dataset(data, workers=1, label_offset=-1, num_classes=4, splits=["train"])
    assert report.ok and report.shards[0].index == "rebuilt"
    assert not tfr.index_is_older(shard, index_path)


# --- the demo set, built by two first runs at once ----------------------------------------------------

_TINY = dict(train_shards=2, val_shards=1, per_shard=6, classes=3, seed=5)


def _build(args):
    target, barrier = args
    barrier.wait()  # both processes start building at the same moment
    return ensure_synthetic(target, **_TINY)


def test_two_processes_building_the_demo_set_at_once(tmp_path):
    target = tmp_path / "cache" / "demo"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(2)
        with ctx.Pool(2) as pool:
            built = pool.map(_build, [(target, barrier)] * 2)
    assert sorted(built) == [False, True]  # one built it, the other waited and used it
    assert (target / "DONE").exists()
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".idx")) == [
        "DONE",
        "train-00000-of-00002",
        "train-00001-of-00002",
        "validation-00000-of-00001",
    ]
    assert verify_dataset(target, workers=1, label_offset=-1, num_classes=3).ok
    assert [p.name for p in target.parent.iterdir() if p.name != "demo"] == ["demo.lock"]  # no leftovers


def test_a_half_built_demo_set_is_replaced(tmp_path):
    target = tmp_path / "demo"
    target.mkdir()
    (target / "train-00000-of-00002").write_bytes(b"partial")
    killed = tmp_path / ".demo.k3x9q.tmp"  # a build killed with -9 in its own directory: it stayed for good
    killed.mkdir()
    (killed / "train-00000-of-00002").write_bytes(b"partial")
    assert ensure_synthetic(target, **_TINY) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo", "demo.lock"]
    assert (target / "DONE").exists() and len(list_shards(target, "train")) == 2
    assert ensure_synthetic(target, **_TINY) is False


# --- a corrupt record in the middle of a training run -----------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


def _corrupt_copy(data: Path, tmp_path: Path) -> tuple[Path, Path, int]:
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in data.iterdir():
        if "-of-" in p.name:
            (bad / p.name).write_bytes(p.read_bytes())
    shard = list_shards(bad, "train")[1]
    offset, size = build_index(shard)[5]
    raw = bytearray(shard.read_bytes())
    raw[offset + size // 2] ^= 0x55  # inside the Example payload: its CRC no longer matches
    shard.write_bytes(bytes(raw))
    return bad, shard, offset


def test_corrupt_shard_mid_run_names_file_and_offset(data, tmp_path):
    bad, shard, offset = _corrupt_copy(data, tmp_path)
    out = subprocess.run(
        command(bad, tmp_path / "run", "--max_steps=14"), env=ENV, capture_output=True, text=True
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert str(shard) in out.stderr and f"offset {offset}" in out.stderr


def test_skip_corrupt_counts_every_ranks_skipped_records(data, tmp_path):
    # skipped_records was rank 0's count alone: 2 ranks skipped 4 bad records and the log said fewer.
    bad, _, _ = _corrupt_copy(data, tmp_path)
    for shard in list_shards(bad, "train"):  # two more in each shard: 5 in all, on both ranks' slices
        raw = bytearray(shard.read_bytes())
        for offset, size in build_index(shard)[10:12] if shard.name.startswith("train-00000") else []:
            raw[offset + size // 2] ^= 0x55
        for offset, size in build_index(shard)[15:17] if shard.name.startswith("train-00001") else []:
            raw[offset + size // 2] ^= 0x55
        shard.write_bytes(bytes(raw))
    run_dir = tmp_path / "run"
    target = ["-m", "fasttrain", *command(bad, run_dir, "--max_steps=6", "--skip_corrupt")[3:]]
    (out,) = run_torchrun(target, nproc=2, env=ENV)  # 6 steps of 2 x 4: the 48 records, once
    assert out.returncode == 0, out.stdout[-2000:]  # stderr is in stdout here
    assert out.stdout.count("skipping: ") == 5, out.stdout[-2000:]
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 6 and last["skipped_records"] == 5


def test_skip_corrupt_counts_skipped_records(data, tmp_path):
    bad, _, _ = _corrupt_copy(data, tmp_path)
    run_dir = tmp_path / "run"
    out = subprocess.run(
        command(bad, run_dir, "--max_steps=14", "--skip_corrupt"), env=ENV, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["skipped_records"] >= 1
