"""python -m fasttrain.data build, what it guards beyond one run's shards (tests/test_data_build.py has
the shards themselves): the labels of splits built in separate runs, images --on_bad skip left out,
the synsets and folders its notes must name, and the output it must have.

Each case was reproduced before its guard existed: the second split's labels from a reordered labels
file gave one synset two labels (exit 0, and verify passed); a fixed image never came back; a
byte-order mark left class 1 out with only a count saying so; an empty --output_directory wrote the
shards into the current directory; every split skipped was exit 0 with nothing written.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
from test_data_build import (
    FIXTURE,
    SHARDS,
    TF_OUTPUT,
    allow_empty_shards,
    build_args,
    features,
    tensorflows_layout,  # noqa: F401 (autouse: TensorFlow's layout, one shard empty)
)

from fasttrain.data.__main__ import main


@pytest.fixture
def tree(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE / "input", tmp_path / "input"))


def _one_split(args: list[str], split: str) -> list[str]:
    other = "train" if split == "validation" else "validation"
    return [a for a in args if not a.startswith(f"--{other}_directory=")]


def test_a_split_built_later_from_another_labels_file_is_refused(tree, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_one_split(build_args(tree, out), "validation")) == 0
    swapped = tree / "swapped.txt"
    lines = (tree / "synsets.txt").read_text().splitlines()
    swapped.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    capsys.readouterr()
    later = [
        a if not a.startswith("--labels_file=") else f"--labels_file={swapped}" for a in build_args(tree, out)
    ]
    assert main(_one_split(later, "train")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "labelled from another labels file" in err, err
    assert f"label 1 is {lines[0]} there, {lines[1]} in {swapped}" in err
    assert not list(out.glob("train-*"))
    assert main(_one_split(build_args(tree, out), "train")) == 0  # the same labels file: built
    for name in SHARDS:
        assert features(out / name) == features(TF_OUTPUT / name), name


def test_an_image_skip_left_out_is_named_until_its_shard_is_written_again(tree, tmp_path, capsys):
    image = tree / "train/n01440764/n01440764_7.JPEG"
    good = image.read_bytes()
    image.write_bytes(b"")
    out = tmp_path / "out"
    assert main(build_args(tree, out, "--on_bad=skip")) == 0
    first = capsys.readouterr().out  # the run that leaves it out names it, and no "earlier" run
    assert f"skipped {image}" in first and "earlier" not in first, first
    holder = next(
        n for n in SHARDS if n.startswith("train") and b"n01440764_7.JPEG" in (TF_OUTPUT / n).read_bytes()
    )
    image.write_bytes(good)  # fixed
    capsys.readouterr()
    assert main(build_args(tree, out)) == 0  # every shard exists: nothing to write, but a note
    printed = capsys.readouterr().out
    assert "nothing to do" in printed and "note: 1 images an earlier --on_bad skip left out" in printed
    assert f"first: {image}: " in printed and f"delete those shards ({holder})" in printed
    (out / holder).unlink()
    assert main(build_args(tree, out)) == 0
    assert "--on_bad skip left out" not in capsys.readouterr().out
    for name in SHARDS:
        assert features(out / name) == features(TF_OUTPUT / name), name
    assert json.loads((out / ".fasttrain-build-skipped.json").read_text()) == {}


def test_images_left_out_stay_recorded_when_the_build_dies_after_their_shard_is_named(
    tree, tmp_path, capsys, monkeypatch
):
    # The main process recorded a shard's left-out images only once the worker's result reached it,
    # after the shard had its name: a build killed in between (SIGKILL, the OOM killer) kept the
    # shard as finished and lost the record, and every rerun said "nothing to do" without the note.
    from fasttrain.data import build_run

    image = tree / "train/n01440764/n01440764_7.JPEG"
    image.write_bytes(b"")
    out = tmp_path / "out"

    class Killed(BaseException):
        pass

    def killed(path, value):
        if path.name == build_run.SKIPPED_RECORD:
            raise Killed  # the process dies here
        return real(path, value)

    real = build_run._write_json
    monkeypatch.setattr(build_run, "_write_json", killed)
    with pytest.raises(Killed):
        main(build_args(tree, out, "--on_bad=skip"))
    monkeypatch.undo()
    allow_empty_shards(monkeypatch)  # undone with the rest
    holder = next(
        n for n in SHARDS if n.startswith("train") and b"n01440764_7.JPEG" in (TF_OUTPUT / n).read_bytes()
    )
    assert (out / holder).exists()  # named: a rerun keeps it as finished
    capsys.readouterr()
    assert main(build_args(tree, out, "--on_bad=skip")) == 0
    printed = capsys.readouterr().out
    assert "note: 1 images an earlier --on_bad skip left out" in printed, printed
    assert f"delete those shards ({holder})" in printed and not list(out.glob(".*.skipped"))


def test_notes_name_the_synsets_and_folders_left_out_and_a_byte_order_mark_is_read(tree, tmp_path, capsys):
    synsets = tree / "synsets.txt"
    synsets.write_bytes(b"\xef\xbb\xbf" + synsets.read_bytes())  # an editor's "UTF-8 with BOM"
    (tree / "train/n04000000").mkdir()  # a synset folder with no images
    out = tmp_path / "out"
    assert main(build_args(tree, out)) == 0
    printed = capsys.readouterr().out
    assert (
        f"1 of 6 synsets of {synsets} have no images in {tree / 'train'} (an empty folder: n04000000)"
        in printed
    )
    assert (
        f"3 of 6 synsets of {synsets} have no images in {tree / 'validation'} (no folder: n02077923, "
        in printed
    )
    assert f"1 folders in {tree / 'train'} are not synsets of {synsets}: n09999999, left out" in printed
    # The fixture's n03000134_7.jpeg (lower case, as the script leaves it out) is named, not only counted.
    lower = tree / "train/n03000134/n03000134_7.jpeg"
    assert f"(the suffix is case-sensitive there; e.g. {lower})" in printed
    for name in SHARDS:  # class 1 (the first line, after the mark) is there: the same shards as TF's
        assert features(out / name) == features(TF_OUTPUT / name), name


def test_an_empty_output_directory_and_nothing_to_build_are_errors(tree, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [
        a if not a.startswith("--output_directory=") else "--output_directory="
        for a in build_args(tree, tmp_path)
    ]
    assert main(args) == 1
    assert "--output_directory is empty" in capsys.readouterr().err
    assert not list(tmp_path.glob("*-of-*"))
    nothing = tree / "nothing.txt"
    nothing.write_text("n99999999\n")  # a synset with no folder in either split: both are skipped
    args = [
        a if not a.startswith("--labels_file=") else f"--labels_file={nothing}"
        for a in build_args(tree, tmp_path / "o")
    ]
    assert main([*args, "--on_bad=skip"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no split has images to build" in err


def test_each_shard_is_on_the_disk_before_it_takes_its_name(tree, tmp_path, monkeypatch):
    # A rerun keeps every shard that exists as finished: one renamed before its data reached the disk
    # could, after a power loss, be kept with data missing (found only by verify).
    import os

    events, fsync, replace = [], os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        return fsync(fd)

    def recording_replace(src, dst):
        events.append(("replace", Path(src).name))
        return replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    assert main(build_args(tree, tmp_path / "out")) == 0  # --workers=1: the jobs run in this process
    renamed = [
        name for kind, name in events if kind == "replace" and name.endswith(".tmp") and "-of-" in name
    ]
    assert len(renamed) == len(SHARDS)
    for name in renamed:
        assert events.index(("fsync", name)) < events.index(("replace", name)), name


def test_sigterm_stops_a_build_as_ctrl_c_does(tree, tmp_path):
    # Before: the parent died of the signal (exit -15, no line), its pool's workers went on, each
    # finishing its shard and then printing BrokenPipeError tracebacks (74 lines of stderr).
    import os
    import signal
    import subprocess
    import sys
    import time

    photo = (tree / "train/n01440764/n01440764_10026.JPEG").read_bytes()
    for synset in ("n01440764", "n01739381"):  # enough images that the build is still running below
        for i in range(3000):
            (tree / "train" / synset / f"{synset}_9{i:05d}.JPEG").write_bytes(photo)
    out = tmp_path / "out"
    args = _one_split(build_args(tree, out, "--workers=2", "--train_shards=16"), "train")
    build = subprocess.Popen(
        [sys.executable, "-m", "fasttrain.data", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not list(out.glob(".train-*.tmp")) and build.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert build.poll() is None, "the build ended before it could be stopped"
    build.send_signal(signal.SIGTERM)  # to the build alone, as kill does, not to its process group
    stdout, stderr = build.communicate(timeout=60)
    assert build.returncode == 128 + signal.SIGTERM, stderr
    assert stderr == "", stderr
    assert stdout.splitlines()[-1].startswith("interrupted: the finished shards are kept"), stdout
    assert not list(out.glob(".*.tmp"))
    time.sleep(0.5)
    try:  # no worker of its pool is left running
        os.killpg(build.pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, "a worker of the stopped build is still running"
    again = subprocess.run(  # the same command again finishes the rest
        [sys.executable, "-m", "fasttrain.data", *args], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr
    assert len(list(out.glob("train-*-of-00016"))) == 16


@pytest.mark.parametrize("copied", ["validation", "train"])
def test_shards_copied_in_without_the_builds_record_are_checked_by_their_records(
    tree, tmp_path, capsys, copied
):
    # TensorFlow's own shards of one split, copied in (no .fasttrain-build-labels.json): the other split
    # built from a labels file in another order gave two synsets swapped labels, exit 0, verify passed.
    out = tmp_path / "out"
    out.mkdir()
    for name in SHARDS:
        if name.startswith(copied):
            shutil.copy(TF_OUTPUT / name, out / name)
    lines = (tree / "synsets.txt").read_text().splitlines()
    swapped = tree / "swapped.txt"
    swapped.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    other = "train" if copied == "validation" else "validation"
    with_swapped = [
        a if not a.startswith("--labels_file=") else f"--labels_file={swapped}" for a in build_args(tree, out)
    ]
    assert main(_one_split(with_swapped, other)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "labelled from another labels file than" in err, err
    swap = rf"gives synset ({lines[0]} label 1|{lines[1]} label 2), the labels file [12]\b"
    assert re.search(swap, err), err
    assert not list(out.glob(f"{other}-*")) and not (out / ".fasttrain-build-labels.json").exists()
    assert main(_one_split(build_args(tree, out), other)) == 0  # the labels file they were made with
    assert "reading the labels of the" in capsys.readouterr().out
    for name in SHARDS:
        assert features(out / name) == features(TF_OUTPUT / name), name
    assert json.loads((out / ".fasttrain-build-labels.json").read_text())["synsets"] == lines


def test_verify_finds_splits_labelled_from_two_labels_files(tree, tmp_path, capsys):
    # The same pair as above put together by hand (each split built alone, then copied into one
    # directory): verify checked every record on its own and passed, exit 0.
    lines = (tree / "synsets.txt").read_text().splitlines()
    swapped = tree / "swapped.txt"
    swapped.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    with_swapped = [
        a if not a.startswith("--labels_file=") else f"--labels_file={swapped}"
        for a in build_args(tree, tmp_path / "b")
    ]
    assert main(_one_split(with_swapped, "train")) == 0
    data = tmp_path / "data"
    data.mkdir()
    for shard in [*TF_OUTPUT.glob("validation-*"), *(tmp_path / "b").glob("train-*")]:
        shutil.copy(shard, data / shard.name)
    (data / "validation-00000-of-00004").unlink()  # TensorFlow's empty one, which verify refuses
    (data / "validation-00000-of-00004").write_bytes((TF_OUTPUT / "validation-00001-of-00004").read_bytes())
    capsys.readouterr()
    assert main(["verify", str(data), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert "the shards were labelled from different labels files: " in out, out
    pair = rf"synset {lines[0]} has label (1 in validation-\S+, 2 in train-|2 in train-\S+, 1 in validation-)"
    assert re.search(pair, out), out
    for shard in data.glob("train-*"):  # one split alone is consistent: verify passes it
        shard.unlink()
    assert main(["verify", str(data), "--workers", "1"]) == 0
