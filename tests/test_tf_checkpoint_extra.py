"""fasttrain.tf.checkpoint on the edge cases of checkpoints TensorFlow 2.21 wrote
(tests/data/make_tf_checkpoints_extra.py): a sharded V1 save named by its train directory (whose
`checkpoint` file names the pattern "model.ckpt-7-?????-of-00002"), a shard of it missing, string
variables beside the numeric ones (V1 and V2), and a V1 uint16 (in TensorProto.int_val). Also the
`checkpoint` file the writer makes for a name with quotes, a backslash or non-ASCII bytes: C-escaped
as protobuf's CEscape writes it (TF 2.21's get_checkpoint_state read the quoted one back by hand)."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fasttrain.checkpoint import CheckpointError
from fasttrain.tf.checkpoint import checkpoint_prefix, is_tf_checkpoint, open_checkpoint

FIXTURES = Path(__file__).parent / "data" / "tf-checkpoints" / "extra"


def expected() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "expected.npz") as saved:
        return {k.replace("|", "/"): saved[k] for k in saved.files}


def _numeric() -> dict[str, np.ndarray]:
    return {k: v for k, v in expected().items() if k != "uint16/value"}


def _check_values(ckpt, want: dict[str, np.ndarray]) -> None:
    shapes = ckpt.shapes()
    for name, value in want.items():
        got = ckpt.get(name)
        assert shapes[name] == (value.shape, value.dtype), name
        assert got.dtype == value.dtype and np.array_equal(got, value), name


def test_v1_sharded_named_by_its_directory():
    d = FIXTURES / "v1-sharded"
    assert '"model.ckpt-7-?????-of-00002"' in (d / "checkpoint").read_text()  # as TF's Saver names it
    ckpt = open_checkpoint(d)
    assert ckpt.version == "V1" and ckpt.prefix == d / "model.ckpt-7"
    assert ckpt.files == [d / "model.ckpt-7-00000-of-00002", d / "model.ckpt-7-00001-of-00002"]
    assert sorted(ckpt.shapes()) == sorted(_numeric())
    _check_values(ckpt, _numeric())


@pytest.mark.parametrize(
    "given", ["model.ckpt-7", "model.ckpt-7-00001-of-00002", "model.ckpt-7-?????-of-00002"]
)
def test_v1_sharded_prefix_forms(given):
    d = FIXTURES / "v1-sharded"
    assert checkpoint_prefix(d / given) == d / "model.ckpt-7"
    assert is_tf_checkpoint(d / given)
    assert sorted(open_checkpoint(d / given).shapes()) == sorted(_numeric())


def test_v1_sharded_moved_directory_with_tfs_absolute_pattern(tmp_path):
    d = tmp_path / "moved"
    shutil.copytree(FIXTURES / "v1-sharded", d)
    (d / "checkpoint").write_text('model_checkpoint_path: "/gone/run/model.ckpt-7-?????-of-00002"\n')
    assert open_checkpoint(d).prefix == d / "model.ckpt-7"


@pytest.mark.parametrize("missing", [0, 1])
def test_v1_missing_shard_is_named(tmp_path, missing):
    d = tmp_path / "v1"
    shutil.copytree(FIXTURES / "v1-sharded", d)
    gone = d / f"model.ckpt-7-{missing:05d}-of-00002"
    gone.unlink()
    with pytest.raises(CheckpointError, match=rf"^{gone} is missing \(shard {missing + 1} of the 2 "):
        open_checkpoint(d)


def test_v1_shards_of_two_saves_are_refused(tmp_path):
    d = tmp_path / "v1"
    shutil.copytree(FIXTURES / "v1-sharded", d)
    shutil.copy(d / "model.ckpt-7-00000-of-00002", d / "model.ckpt-7-00000-of-00003")
    with pytest.raises(CheckpointError, match=r"shard files of 2 different counts \(-of-00002, -of-00003\)"):
        open_checkpoint(d)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_string_variables_are_listed_and_leave_the_rest_readable(version):
    ckpt = open_checkpoint(FIXTURES / f"{version}-string")
    shapes = ckpt.shapes()
    assert shapes["run_note"] == ((), None) and shapes["tags"] == ((3,), None)  # TF's DT_STRING: not read
    _check_values(ckpt, _numeric())
    with pytest.raises(
        CheckpointError, match=r"variable tags has TF dtype 7 \(string or other\), not supported"
    ):
        ckpt.get("tags")


def test_a_string_variable_does_not_stop_an_import(tmp_path):
    """The ResNet fixture with TF's string variable run_note added to its index imports the same weights."""
    from fasttrain.models import create_model
    from fasttrain.tf.proto import _MSG
    from fasttrain.tf.state import model_state, network_widths, read_global_step
    from fasttrain.tf.table import build_table, read_table

    source = Path(__file__).parent / "data" / "tf-resnet-v2" / "resnet18_v2_w4"
    d = tmp_path / "with-note"
    shutil.copytree(source, d)
    index = d / "model.ckpt-0.index"
    items = [(k, bytes(v)) for k, v, _ in read_table(index.read_bytes(), index)]
    note = _MSG["BundleEntryProto"](dtype=7, offset=0, size=0)  # DT_STRING, as strvar.py's TF run wrote
    index.write_bytes(build_table(sorted(items + [(b"run_note", note.SerializeToString())])))
    with_note, plain = open_checkpoint(d), open_checkpoint(source)
    assert with_note.shapes()["run_note"] == ((), None)
    assert network_widths(with_note, "resnet18_v2") == network_widths(plain, "resnet18_v2") == (1001, 4)
    model = create_model("resnet18_v2", 1001, base_channels=4)
    got, want = model_state(with_note, "resnet18_v2", model), model_state(plain, "resnet18_v2", model)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert read_global_step(with_note) == read_global_step(plain)


def test_v1_uint16_is_read_from_int_val():
    ckpt = open_checkpoint(FIXTURES / "v1-uint16")
    want = expected()["uint16/value"]  # [0, 1, 40000, 65535], as TF was given it
    assert ckpt.shapes()["uint16/value"] == ((4,), np.dtype(np.uint16))
    got = ckpt.get("uint16/value")
    assert got.dtype == np.uint16 and np.array_equal(got, want)
    _check_values(
        ckpt, {k: v for k, v in _numeric().items() if k != "float16/value"} | {"uint16/value": want}
    )


@pytest.mark.parametrize(
    "name, written",
    [
        ('say "hi"\\model.ckpt-3', r"say \"hi\"\\model.ckpt-3"),
        ("mod\u00e8le\tckpt-3", r"mod\303\250le\tckpt-3"),  # protobuf CEscape's octal, as TF writes
    ],
)
def test_state_file_is_c_escaped(tmp_path, name, written):
    from fasttrain.tf.checkpoint import write_checkpoint

    prefix = write_checkpoint(tmp_path / name, {"w": np.arange(3, dtype=np.float32)})
    assert (tmp_path / "checkpoint").read_text().splitlines() == [
        f'model_checkpoint_path: "{written}"',
        f'all_model_checkpoint_paths: "{written}"',
    ]
    assert open_checkpoint(tmp_path).prefix == prefix
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
