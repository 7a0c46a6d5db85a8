"""python -m fasttrain.data build against the shards TensorFlow itself wrote (tests/data/tf-build/,
made by tests/data/make_tf_build.py: build_imagenet_data.py's steps in tf.compat.v1, listing sorted).

TensorFlow writes an Example's feature map in an order that varies from process to process, so the
comparison is per record and per feature: the same keys, and each feature's serialized bytes equal.
"""

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

from fasttrain.data import build as build_module
from fasttrain.data.__main__ import main
from fasttrain.data.build_image import BadImage, check_jpeg, stored_image
from fasttrain.data.errors import DataError
from fasttrain.data.example import parse_example
from fasttrain.data.imagenet import list_shards
from fasttrain.data.jpeg.row_index import RowIndex
from fasttrain.data.tfrecord import check_index, iter_records, read_index_file

FIXTURE = Path(__file__).parent / "data" / "tf-build"
TF_OUTPUT = FIXTURE / "tf-output"
SHARDS = sorted(p.name for p in TF_OUTPUT.iterdir() if "-of-" in p.name)


def build_args(inputs: Path, out: Path, *extra: str) -> list[str]:
    return [
        "build",
        f"--train_directory={inputs / 'train'}",
        f"--validation_directory={inputs / 'validation'}",
        f"--output_directory={out}",
        f"--labels_file={inputs / 'synsets.txt'}",
        f"--imagenet_metadata_file={inputs / 'metadata.txt'}",
        f"--bounding_box_file={inputs / 'boxes.csv'}",
        "--train_shards=4",
        "--validation_shards=4",
        "--num_threads=2",
        "--workers=1",
        *extra,
    ]


def features(shard: Path) -> list[dict[str, bytes]]:
    """Each record's features as {key: the Feature's serialized bytes}."""
    records = []
    for _, payload in iter_records(shard):
        feature = parse_example(payload).features.feature
        records.append({key: feature[key].SerializeToString() for key in feature})
    return records


def allow_empty_shards(monkeypatch) -> None:
    """The fixture's layout is TensorFlow's own: its 3 validation images in 4 shards over 2 threads
    leave validation-00000 empty (the split arithmetic's corner), which the script writes as a 0-byte
    file. fasttrain's build refuses such a layout by default, since the trainer refuses 0-byte shards
    (test_more_shards_than_images_is_refused_before_anything_is_written); the tests that compare
    with TensorFlow's shards, or use its layout for other things, lift that refusal."""
    monkeypatch.setattr(build_module, "refuse_empty_shards", lambda plan: None)


@pytest.fixture(autouse=True)
def tensorflows_layout(request, monkeypatch):
    if "refusing_empty_shards" not in request.keywords:
        allow_empty_shards(monkeypatch)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as monkeypatch:  # module scope: before the autouse fixture
        allow_empty_shards(monkeypatch)
        assert main(build_args(FIXTURE / "input", out, "--workers=2")) == 0
    return out


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the fixture's input tree that a test may change."""
    return Path(shutil.copytree(FIXTURE / "input", tmp_path / "input"))


def test_every_feature_equals_what_tensorflow_wrote(built):
    compared = 0
    assert sorted(p.name for p in built.iterdir() if not p.name.startswith(".")) == SHARDS
    for name in SHARDS:
        ours, theirs = features(built / name), features(TF_OUTPUT / name)
        assert len(ours) == len(theirs), name  # validation-00000 is empty in both: the split arithmetic
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert a.keys() == b.keys(), (name, i)
            for key in b:
                assert a[key] == b[key], (name, i, key)
                compared += 1
    assert compared == 15 * 15  # 15 images (12 train, 3 validation), 15 features each


def test_the_fixture_exercises_what_it_claims(built):
    records = [parse_example(p).features.feature for s in SHARDS for _, p in iter_records(TF_OUTPUT / s)]
    names = {r["image/filename"].bytes_list.value[0].decode(): r for r in records}
    assert {"n02105855_2933.JPEG", "n01739381_1309.JPEG", "n02077923_14822.JPEG", "n03000134_5.JPEG"} <= set(
        names
    )
    assert "n03000134_7.jpeg" not in names and "n09999999_1.JPEG" not in names  # not *.JPEG / not a label
    boxes = {n: len(r["image/object/bbox/xmin"].float_list.value) for n, r in names.items()}
    assert boxes["n01440764_10026.JPEG"] == 3 and boxes["ILSVRC2012_val_00000002.JPEG"] == 2
    assert sum(1 for n in boxes.values() if n == 0) >= 5
    # The unlisted CMYK JPEG is stored as it is (TF decodes CMYK with channels=3): the input's bytes.
    cmyk = (FIXTURE / "input/train/n03000134/n03000134_5.JPEG").read_bytes()
    assert names["n03000134_5.JPEG"]["image/encoded"].bytes_list.value[0] == cmyk
    assert simplejpeg.decode_jpeg_header(cmyk)[2] == "CMYK"
    assert (
        names["n03000134_6.JPEG"]["image/class/text"].bytes_list.value[0]
        == "chainlink fence, café fence".encode()
    )


@pytest.mark.parametrize(
    "name",
    ["n02105855/n02105855_2933.JPEG", "n01739381/n01739381_1309.JPEG", "n02077923/n02077923_14822.JPEG"],
)
def test_reencoded_images_decode_to_tensorflows_pixels(name):
    # TF's digest of its own decode_jpeg(channels=3) of the JPEG it re-encoded; decoded here as TF
    # decodes (libjpeg-turbo, fast IDCT, fancy upsampling: simplejpeg with those switches).
    expected = json.loads((TF_OUTPUT / "reencoded.json").read_text())[name.split("/")[1]]["decoded"]
    jpeg, height, width = stored_image(str(FIXTURE / "input/train" / name), name)
    pixels = simplejpeg.decode_jpeg(jpeg, fastdct=True, fastupsample=False)
    assert [height, width, 3] == list(pixels.shape) == expected["shape"]
    assert hashlib.sha256(pixels.tobytes()).hexdigest() == expected["sha256"]


def test_damaged_jpegs_get_tensorflows_verdict():
    verdicts = json.loads((FIXTURE / "damaged/verdicts.json").read_text())
    assert sorted(verdicts.values()).count(False) >= 8 and sorted(verdicts.values()).count(True) >= 6
    for name, decodes_in_tf in verdicts.items():
        data = (FIXTURE / "damaged" / name).read_bytes()
        if name == "png_content.jpg":  # TF 2's decode_jpeg decodes PNG; no JPEG decoder would read it
            assert decodes_in_tf
            with pytest.raises(BadImage, match="is a PNG image, not a JPEG"):
                check_jpeg(data)
            continue
        try:
            check_jpeg(data)
            ours = True
        except BadImage:
            ours = False
        assert ours == decodes_in_tf, name


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        value |= (data[pos] & 0x7F) << shift
        shift += 7
        pos += 1
        if data[pos - 1] < 0x80:
            return value, pos


def wire_keys(payload: bytes) -> list[str]:
    """The feature keys in the order the serialized Example holds its map entries."""
    assert payload[0] == 0x0A  # Example.features
    length, pos = _varint(payload, 1)
    keys, end = [], pos + length
    while pos < end:
        assert payload[pos] == 0x0A  # one map entry
        entry_length, pos = _varint(payload, pos + 1)
        assert payload[pos] == 0x0A  # its key
        key_length, key_start = _varint(payload, pos + 1)
        keys.append(payload[key_start : key_start + key_length].decode())
        pos += entry_length
    return keys


def test_shards_are_the_same_bytes_in_every_process(built, tmp_path):
    # Deterministic serialization (map entries sorted by key), where TensorFlow's feature order varies
    # from process to process: a second build writes the same files byte for byte.
    assert main(build_args(FIXTURE / "input", tmp_path)) == 0
    for name in SHARDS:
        assert (tmp_path / name).read_bytes() == (built / name).read_bytes(), name
        for _, payload in iter_records(built / name):
            keys = wire_keys(payload)
            assert keys == sorted(keys) and len(keys) == 15


def test_a_rerun_keeps_finished_shards_and_writes_the_missing_one(tree, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(build_args(tree, out)) == 0
    before = {n: os.stat(out / n).st_mtime_ns for n in SHARDS}
    (out / "train-00002-of-00004").unlink()
    for name in ("train-00002-of-00004", "train-00001-of-00004"):  # a killed build's leftovers
        (out / f".{name}.999.tmp").write_bytes(b"half a shard")
    capsys.readouterr()
    assert main(build_args(tree, out)) == 0
    assert "1 shards to write (3 images), 7 already written" in capsys.readouterr().out
    for name in SHARDS:
        if name != "train-00002-of-00004":
            assert os.stat(out / name).st_mtime_ns == before[name], name
    assert features(out / "train-00002-of-00004") == features(TF_OUTPUT / "train-00002-of-00004")
    assert not list(out.glob(".*.tmp"))


def test_shards_of_another_file_list_are_refused(tree, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(build_args(tree, out)) == 0
    shutil.copy(tree / "train/n01440764/n01440764_39.JPEG", tree / "train/n01440764/n01440764_40.JPEG")
    capsys.readouterr()
    assert main(build_args(tree, out)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds 4 train shards" in err and str(out) in err


@pytest.mark.parametrize("workers", [1, 2])
def test_a_corrupt_image_stops_the_build_with_one_line_and_no_partial_shard(tree, tmp_path, capsys, workers):
    bad = tree / "train/n01440764/n01440764_7.JPEG"
    bad.write_bytes(bad.read_bytes()[:1000])  # truncated: TensorFlow's decode fails on it
    out = tmp_path / "out"
    assert main(build_args(tree, out, f"--workers={workers}")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"bad image {bad}: it is truncated" in err and "--on_bad skip" in err
    holder = next(
        n for n in SHARDS if n.startswith("train") and b"n01440764_7.JPEG" in (TF_OUTPUT / n).read_bytes()
    )
    assert not (out / holder).exists() and not list(out.glob(".*.tmp"))
    for shard in out.glob("*-of-*"):  # whatever was finished is complete and right
        assert features(shard) == features(TF_OUTPUT / shard.name)


def test_a_failure_removes_the_other_workers_half_written_shards(tree, tmp_path, capsys):
    # A FIFO under a validation name blocks its worker inside a shard (validation shards go first), with
    # the shard's temporary file open, until the other worker's failure on a train image ends the pool.
    os.mkfifo(tree / "validation/n01440764/ILSVRC2012_val_00000009.JPEG")
    bad = tree / "train/n01440764/n01440764_7.JPEG"
    bad.write_bytes(b"")
    out = tmp_path / "out"
    assert main(build_args(tree, out, "--workers=2")) == 1
    assert f"bad image {bad}: it is empty" in capsys.readouterr().err
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_on_bad_skip_leaves_the_image_out_and_names_it(tree, tmp_path, capsys):
    bad = tree / "train/n01440764/n01440764_7.JPEG"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    out = tmp_path / "out"
    assert main(build_args(tree, out, "--on_bad=skip")) == 0
    assert f"skipped {bad}: is a PNG image, not a JPEG" in capsys.readouterr().out
    for name in SHARDS:
        theirs = [r for r in features(TF_OUTPUT / name) if b"n01440764_7.JPEG" not in r["image/filename"]]
        assert features(out / name) == theirs, name


def test_a_flat_validation_folder_is_named_or_skipped(tree, tmp_path, capsys):
    flat = tree / "validation"
    for image in list(flat.glob("*/*.JPEG")):
        image.rename(flat / image.name)
    assert main(build_args(tree, tmp_path / "a")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flat} holds 3 JPEG files but no synset folders" in err
    assert "preprocess_imagenet_validation_data.py" in err
    assert main(build_args(tree, tmp_path / "b", "--on_bad=skip")) == 0
    assert "skipping the validation split" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "b").glob("*-of-*")) == [
        n for n in SHARDS if n.startswith("train")
    ]


def test_index_files_and_row_checkpoints_in_the_same_pass(tmp_path, capsys):
    assert main(build_args(FIXTURE / "input", tmp_path, "--write_index", "--row_checkpoints")) == 0
    for name in SHARDS:
        shard = tmp_path / name
        assert check_index(shard, read_index_file(shard.with_name(name + ".idx"))) is None
        if shard.stat().st_size:
            assert RowIndex.open(shard) is not None, name
    # A rerun makes the row checkpoints a finished shard lacks, and nothing else.
    (tmp_path / "train-00001-of-00004.rows").unlink()
    capsys.readouterr()
    assert main(build_args(FIXTURE / "input", tmp_path, "--row_checkpoints")) == 0
    out = capsys.readouterr().out
    assert "0 shards to write (0 images), 1 finished ones to give row checkpoints, 8 already written" in out
    assert RowIndex.open(tmp_path / "train-00001-of-00004") is not None
    # Its summary counts the records it read for them (it said "wrote 0 images in 0 shards", and its
    # progress lines "0/0 images").
    records = len(read_index_file(tmp_path / "train-00001-of-00004.idx"))
    said = f"wrote 0 images in 0 shards and row checkpoints for 1 finished shards ({records} records) to "
    assert said in out, out


def test_a_build_in_one_process_says_how_far_it_is_while_a_shard_runs(tmp_path, capsys, monkeypatch):
    # With one process (--workers 1, one shard left, one core) the jobs ran in the main thread and the
    # progress was looked at between shards only: a one-shard split printed no line however long it took.
    from fasttrain.data import build_run, build_shard

    real = build_shard.stored_image

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(build_shard, "stored_image", slow)
    monkeypatch.setattr(build_run, "PROGRESS_SECONDS", 0.1)
    one_each = ("--train_shards=1", "--validation_shards=1", "--num_threads=1")
    assert main(build_args(FIXTURE / "input", tmp_path, *one_each)) == 0  # 2 jobs, about 0.75 s
    lines = [line for line in capsys.readouterr().out.splitlines() if "ETA" in line]
    assert len(lines) >= 3, lines  # at most 1 (between the two shards) before
    line = r"\d+/15 images, \d+ images/s, ETA (\d+\.\d min|not yet known)"
    assert all(re.fullmatch(line, text) for text in lines), lines


def test_progress_lines_give_the_rate_and_eta(tmp_path, capsys, monkeypatch):
    from fasttrain.data import build_run

    monkeypatch.setattr(build_run, "PROGRESS_SECONDS", 0.0)  # a line after every shard
    assert main(build_args(FIXTURE / "input", tmp_path)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "ETA" in line]
    assert len(lines) == 7 and lines[0] == "0/15 images, 0 images/s, ETA not yet known"  # an empty shard
    assert all(re.fullmatch(r"\d+/15 images, \d+ images/s, ETA \d+\.\d min", line) for line in lines[1:])


@pytest.mark.parametrize(
    "change, message",
    [
        (("synsets.txt", "n01440764\n\nn01739381\n"), "line 2 of the labels file"),
        (("synsets.txt", "n01440764\nn01739381\nn01440764\n"), "lists n01440764 twice (lines 1 and 3)"),
        (("boxes.csv", "n01440764_39.JPEG,0.1,0.2,0.3\n"), "line 1 of the bounding-box file"),
        # process_bounding_boxes.py orders and clips every box; these were stored, the torch loader
        # clipped them, and DALI's crop stopped training at the image, naming another shard.
        (("boxes.csv", "n01440764_39.JPEG,1.5,-0.2,2.1,0.8\n"), "line 1 of the bounding-box file"),
        (("boxes.csv", "x.JPEG,0.1,0.2,0.3,0.4\nn01440764_39.JPEG,0.5,0.2,0.3,0.8\n"), "line 2 of the"),
        (("boxes.csv", "n01440764_39.JPEG,0.1,nan,0.3,0.8\n"), "is not a box inside the image"),
        (("metadata.txt", "n01440764\ttench\n"), "synset n01739381 has images"),
        (("metadata.txt", "n01440764 tench\n"), "line 1 of the metadata file"),
    ],
)
def test_text_file_errors_are_one_line_naming_the_file(tree, tmp_path, capsys, change, message):
    name, text = change
    (tree / name).write_text(text)
    assert main(build_args(tree, tmp_path / "out")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and str(tree / name) in err


def test_shard_counts_must_split_evenly_over_threads(tmp_path, capsys):
    assert main(build_args(FIXTURE / "input", tmp_path, "--train_shards=5")) == 2  # a flag: exit 2
    assert "--train_shards 5 must be a positive multiple of --num_threads 2" in capsys.readouterr().err
    # --num_threads 0 was named as if the shard count were wrong ("--validation_shards 4 must be ...").
    assert main(build_args(FIXTURE / "input", tmp_path, "--num_threads=0")) == 2
    assert capsys.readouterr().err == "error: --num_threads 0 must be at least 1\n"


@pytest.mark.refusing_empty_shards
@pytest.mark.parametrize(
    "flags, words",
    [
        # The fixture's 3 validation images in TensorFlow's 4 shards (its layout leaves one empty).
        (
            [],
            "--validation_shards 4 is more than the 3 images of the validation split can fill: 1 shard "
            "would be empty (0 bytes), which the trainer refuses; give --validation_shards 2 or fewer",
        ),
        (
            ["--validation_shards=2", "--train_shards=64"],
            "--train_shards 64 is more than the 12 images of "
            "the train split can fill: 52 shards would be empty",
        ),
        (
            ["--validation_shards=4", "--num_threads=4"],
            "give --num_threads 3 or fewer and --validation_shards at most 3",
        ),
    ],
)
def test_more_shards_than_images_is_refused_before_anything_is_written(tmp_path, capsys, flags, words):
    # Before: "wrote 18 images in 66 shards", exit 0, 53 of them 0-byte files, which the trainer and
    # verify then refused ("empty ... re-copy it"): a build that ended well left data nothing could use.
    out = tmp_path / "out"
    assert main(build_args(FIXTURE / "input", out, *flags)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert not out.exists() or not list(out.iterdir())
    assert main(build_args(FIXTURE / "input", out, "--validation_shards=2")) == 0  # as it advised


def test_the_trainers_error_for_a_jpeg_folder_names_the_command(tree):
    with pytest.raises(DataError, match=r"python -m fasttrain\.data build"):
        list_shards(tree / "train", "train")


def test_numbers_in_boxes_are_the_scripts_float32(built):
    # process_bounding_boxes.py prints 4 decimals; stored as float32 like TF's FloatList stores them.
    line = (FIXTURE / "input/boxes.csv").read_text().splitlines()[0].split(",")
    record = next(
        r
        for s in SHARDS
        for r in (parse_example(p).features.feature for _, p in iter_records(built / s))
        if r["image/filename"].bytes_list.value[0].decode() == line[0]
    )
    assert record["image/object/bbox/xmin"].float_list.value[0] == np.float32(float(line[1]))


def test_without_a_box_file_every_box_list_is_empty(tmp_path, capsys):
    args = [a for a in build_args(FIXTURE / "input", tmp_path) if not a.startswith("--bounding_box_file")]
    assert main([*args, "--bounding_box_file=nowhere.csv"]) == 1
    assert "--bounding_box_file '' for records without boxes" in capsys.readouterr().err
    assert main([*args, "--bounding_box_file="]) == 0
    box_keys = {f"image/object/bbox/{k}" for k in ("xmin", "ymin", "xmax", "ymax", "label")}
    # TensorFlow's empty box lists: a record of the fixture's without boxes (set, and empty)
    no_boxes = next(
        r for s in SHARDS for r in features(TF_OUTPUT / s) if r["image/object/bbox/xmin"] == b"\x12\x00"
    )
    for name in SHARDS:
        for ours, theirs in zip(features(tmp_path / name), features(TF_OUTPUT / name), strict=True):
            assert {k: v for k, v in ours.items() if k not in box_keys} == {
                k: v for k, v in theirs.items() if k not in box_keys
            }
            assert all(ours[k] == no_boxes[k] for k in box_keys)


def test_an_unreadable_file_is_named(tree, tmp_path, capsys):
    (tree / "train/n01440764/n01440764_8.JPEG").symlink_to(tree / "missing.JPEG")
    assert main(build_args(tree, tmp_path / "out", "--on_bad=skip")) == 0
    out = capsys.readouterr().out
    assert f"skipped {tree / 'train/n01440764/n01440764_8.JPEG'}: cannot be read (No such file" in out


def test_one_build_at_a_time_per_output_directory(tmp_path, capsys):
    import fcntl

    with open(tmp_path / ".fasttrain-build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert main(build_args(FIXTURE / "input", tmp_path)) == 1
    assert f"another build is writing to {tmp_path}" in capsys.readouterr().err
    assert not list(tmp_path.glob("*-of-*"))
