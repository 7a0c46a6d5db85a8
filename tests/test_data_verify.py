"""fasttrain/data/verify.py and `python -m fasttrain.data` (verify, ls, make-synthetic,
row-checkpoints): a clean set verifies and gets its index files, every bad record is reported,
--decode finds a bad JPEG, ls prints each record as JSON, and mistakes are one line."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from record_helpers import _features, _jpeg

from fasttrain.data.__main__ import main
from fasttrain.data.example import encode_example
from fasttrain.data.imagenet import decode_record, list_shards
from fasttrain.data.tfrecord import iter_records, write_records
from fasttrain.data.verify import verify_dataset

# --- verify and ls ---------------------------------------------------------------------------------


def _copy(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        if not p.name.endswith(".idx"):
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_verify_clean_data_writes_indexes(synthetic, tmp_path, capsys):
    data = _copy(synthetic, tmp_path / "data")
    report = verify_dataset(data, decode=True, workers=1, label_offset=-1, num_classes=4)
    assert report.ok and report.records == 200
    assert {s.index for s in report.shards} == {"written"}
    assert report.split_summary("train") == "train: 120 records in 3 shards, labels 1..4"
    assert main(["verify", str(data), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "validation: 80 records in 2 shards, labels 1..4" in out and "index files: 5 ok" in out
    assert "records/s" in out


def test_verify_reports_every_bad_record(synthetic, tmp_path, capsys):
    data = _copy(synthetic, tmp_path / "data")
    shard0, shard1 = list_shards(data, "train")[:2]
    offsets = [o for o, _ in iter_records(shard0)]
    raw = bytearray(shard0.read_bytes())
    raw[offsets[3] + 40] ^= 1  # data CRC: the scan goes on
    raw[offsets[7] + 40] ^= 1
    shard0.write_bytes(bytes(raw))
    cut = [o for o, _ in iter_records(shard1)][5] + 20
    shard1.write_bytes(shard1.read_bytes()[:cut])
    bad_label = tmp_path / "data" / "validation-00000-of-00002"
    write_records(bad_label, [encode_example(_features(**{"image/class/label": 9}))])
    empty = tmp_path / "data" / "validation-00001-of-00002"
    empty.write_bytes(b"")

    assert main(["verify", str(data), "--workers", "2", "--label-offset", "-1", "--num-classes", "4"]) == 1
    out = capsys.readouterr().out
    assert f"{shard0}: 2 bad record(s)" in out
    for offset in (offsets[3], offsets[7]):
        assert f"corrupted record at offset {offset} in {shard0} (data CRC mismatch)" in out
    assert f"truncated record at offset {cut - 20} in {shard1}" in out
    assert f"record at offset 0 in {bad_label}: label 9 + --label_offset -1 is outside [0, 4)" in out
    assert f"empty shard {empty}" in out
    assert "train: 85 records in 3 shards" in out  # 40 (2 with bad CRCs) + 5 before the cut + 40
    report = verify_dataset(data, workers=1, label_offset=-1, num_classes=4, splits=["train"])
    assert {s.index for s in report.shards} == {"ok", "not written (broken framing)"}


def test_verify_decode_finds_a_bad_jpeg(tmp_path):
    (tmp_path / "d").mkdir()
    bad = _jpeg()[:-200]
    write_records(
        tmp_path / "d" / "train-00000-of-00001", [encode_example(_features(**{"image/encoded": bad}))]
    )
    assert verify_dataset(tmp_path / "d", workers=1).ok  # without --decode the JPEG is not looked at
    report = verify_dataset(tmp_path / "d", decode=True, workers=1)
    assert len(report.bad) == 1 and "undecodable JPEG in record at offset 0" in report.bad[0].bad[0]


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 2  # a bad argument, as the trainer's --data_dir
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    assert main(["ls", str(tmp_path)]) == 0  # no shards of either split: nothing to list
    assert main(["ls", str(tmp_path), "--split", "train"]) == 1
    with pytest.raises(SystemExit) as e:
        main(["verify", str(tmp_path), "--workers", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["make-synthetic", "--out", str(tmp_path), "--train-shards", "0", "--val-shards", "0"])
    assert e.value.code == 2
    capsys.readouterr()
    (tmp_path / "a-file").write_text("")
    assert main(["make-synthetic", "--out", str(tmp_path / "a-file" / "d"), "--per-shard", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the data set to" in err and "Not a directory" in err


@pytest.mark.parametrize(
    "argv, words",
    [
        # Each ran before: -3 and 0 workers as one process, --per-shard 0 wrote empty shards (which
        # verify then called "re-copy it"), an empty --out wrote into the current directory.
        (["row-checkpoints", ".", "--workers", "-3"], "--workers: must be at least 1, got -3"),
        (["row-checkpoints", ".", "--workers", "0"], "--workers: must be at least 1, got 0"),
        (["make-synthetic", "--out", "x", "--per-shard", "0"], "--per-shard: must be at least 1, got 0"),
        (["make-synthetic", "--out", ""], "make-synthetic --out is empty"),
    ],
)
def test_data_tool_arguments_out_of_range_are_refused(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_errors_name_the_data_tools_own_flags(tmp_path, capsys, monkeypatch):
    # An index that cannot be written said "set --data_cache_dir", a trainer flag these commands lack.
    # The index goes to a directory no one may create (under /proc, even as root), as verify would
    # try a read-only data directory.
    import fasttrain.data.__main__ as data_main
    from fasttrain.data.tfrecord import save_index

    unwritable = Path("/proc/fasttrain-no-such-dir/train-00000-of-00001.idx")
    monkeypatch.setattr(
        data_main, "_verify", lambda args: save_index(tmp_path / "s", [(0, 16)], [unwritable])
    )
    assert main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "set --cache-dir to a writable directory" in err and "data_cache_dir" not in err, err


def test_a_bad_record_names_the_trainers_flag(tmp_path):
    write_records(tmp_path / "train-00000-of-00001", [b"\xff\xff\xff"])
    [shard] = verify_dataset(tmp_path, workers=1, write_index=False).bad
    assert shard.bad[0].endswith("re-create the shard or use --skip_corrupt"), shard.bad


def test_make_synthetic_refuses_a_directory_that_holds_shards(tmp_path, capsys):
    out = str(tmp_path / "set")
    assert (
        main(["make-synthetic", "--out", out, "--train-shards", "2", "--val-shards", "0", "--per-shard", "1"])
        == 0
    )
    before = sorted(p.name for p in (tmp_path / "set").iterdir())
    capsys.readouterr()
    # a second set of another size would have left train-*-of-00002 beside train-*-of-00003
    assert (
        main(["make-synthetic", "--out", out, "--train-shards", "3", "--val-shards", "0", "--per-shard", "1"])
        == 1
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds 2 shard(s)" in err
    assert sorted(p.name for p in (tmp_path / "set").iterdir()) == before


def test_ls_prints_one_json_object_per_record(synthetic, capsys):
    assert main(["ls", str(synthetic), "--split", "validation", "--limit", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3
    shard = list_shards(synthetic, "validation")[0]
    expected = [decode_record(p, shard, o, 0, 1001) for o, p in list(iter_records(shard))[:3]]
    for line, r in zip(lines, expected):
        assert {"file", "offset", "label", "filename", "height", "width", "boxes"} <= set(line)
        assert (line["file"], line["offset"], line["label"]) == (str(shard), r.offset, r.stored_label)
        assert (line["filename"], line["height"], line["width"]) == (r.filename, r.height, r.width)
        np.testing.assert_allclose(np.array(line["boxes"]).reshape(-1, 4), r.boxes, atol=1e-6)


def test_a_directory_of_raw_images_names_the_converter(tmp_path, capsys):
    (tmp_path / "n01440764").mkdir()  # raw ImageNet: class folders of JPEGs, not shards
    (tmp_path / "n01440764" / "n01440764_10026.JPEG").write_bytes(b"")
    assert main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "build_imagenet_data.py" in err


def test_the_trainers_loader_names_the_converter_for_raw_images_too(tmp_path):
    # The trainer reaches the shards through list_shards, not through verify: the same hint, once.
    from fasttrain.data import DataError

    (tmp_path / "n01440764").mkdir()
    with pytest.raises(DataError) as raised:
        list_shards(tmp_path, "train")
    message = str(raised.value)
    assert message.count("build_imagenet_data.py") == 1 and "class or split folders" in message


# What `python -m fasttrain.data` runs: its subcommands, and the data modules with a command of their own
# (`python -m fasttrain.data.<module>`), each under the subcommand that runs it too.
DATA_COMMANDS = {"verify", "ls", "make-synthetic", "build", "row-checkpoints", "warm-up"}
MODULE_COMMANDS = {"jpeg_rows": "row-checkpoints"}


def test_help_lists_every_data_command(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    listed = set(re.search(r"\{([\w,-]+)\}", capsys.readouterr().out).group(1).split(","))
    assert listed == DATA_COMMANDS
    package = Path(main.__code__.co_filename).parent
    entry = 'if __name__ == "__main__"'
    modules = {p.stem for p in package.rglob("*.py") if entry in p.read_text() and p.stem != "__main__"}
    assert modules == set(MODULE_COMMANDS) and set(MODULE_COMMANDS.values()) <= listed


def test_row_checkpoints_builds_the_sidecars(synthetic, tmp_path, capsys):
    data = _copy(synthetic, tmp_path / "data")
    assert main(["row-checkpoints", str(data)]) == 0
    assert "rows: 0 of 5 shards up to date, 5 to build" in capsys.readouterr().out
    assert len(list(data.glob("*.rows"))) == 5
    assert (
        main(["row-checkpoints", str(data)]) == 0
        and "rows: 5 of 5 shards up to date" in capsys.readouterr().out
    )


def test_ctrl_c_during_a_verify_with_workers_is_one_line(tmp_path):
    # Ctrl-C goes to the terminal's whole process group: the main process and both workers printed
    # a traceback each, and the pool one more. A FIFO under a shard's name holds a worker in its open.
    import os
    import signal
    import subprocess
    import sys
    import time

    write_records(tmp_path / "train-00000-of-00002", [encode_example(_features())])
    os.mkfifo(tmp_path / "train-00001-of-00002")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fasttrain.data", "verify", str(tmp_path), "--workers", "2", "--no-index"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    writer, deadline = None, time.monotonic() + 120
    try:
        while writer is None:  # a worker has the FIFO open for reading once a writer may open it
            try:
                writer = os.open(tmp_path / "train-00001-of-00002", os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader yet
                assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
                time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # the worker waits in its read: the data never comes
        _, err = proc.communicate(timeout=60)
    finally:
        if writer is not None:
            os.close(writer)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and err.strip() == "interrupted", err
