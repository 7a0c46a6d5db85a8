"""python -m fasttrain.tf.convert: to-tf then from-tf gives back the checkpoint's weights (raw) and its
EMA of weights and BN statistics (--weights ema), bit for bit; to-tf writes every variable the seed's
run holds (weights, BN statistics, both RMSProp slots, EMA shadows, global_step) and the `checkpoint`
file; the classifier width and ResNet width come from the checkpoint; a file that is not a checkpoint
or a checkpoint of another model is one line on stderr, exit 1, no traceback."""

import dataclasses

import pytest
import torch
from test_tf_state import trained

from fasttrain.checkpoint import load_checkpoint, save_checkpoint
from fasttrain.config import make_config
from fasttrain.tf.checkpoint import open_checkpoint
from fasttrain.tf.convert import main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    model, opt, bn_ema = trained("rmsprop")
    cfg = make_config(model="resnet18", base_channels=8, num_classes=5, optimizer="rmsprop", ema_decay=0.9)
    names = [n for n, _ in model.named_parameters()]
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "bn_ema": bn_ema.state_dict(),
        "ema": dict(zip(names, opt.ema_parameters(list(model.parameters())))),
        "step": 42,
        "config": dataclasses.asdict(cfg),
    }
    directory = tmp_path_factory.mktemp("run")
    save_checkpoint(directory, 42, state)
    return directory


def test_to_tf_then_from_tf_is_the_identity(run_dir, tmp_path, capsys):
    prefix = tmp_path / "tf" / "model.ckpt-42"
    assert main(["to-tf", str(run_dir), "--out", str(prefix)]) == 0
    assert (prefix.parent / "checkpoint").read_text().startswith('model_checkpoint_path: "model.ckpt-42"')
    names = open_checkpoint(prefix.parent).shapes()
    # ResNet-18: 62 parameters (20 convs, 20 BNs x 2, fc x 2) and 40 BN statistics; each parameter has
    # ms, momentum and a shadow, each statistic a shadow; and global_step.
    assert len(names) == 62 + 40 + 62 * 3 + 40 + 1
    assert names["global_step"][0] == ()
    assert "resnet_model/batch_normalization_19/moving_variance/ExponentialMovingAverage" in names
    assert "resnet_model/dense/bias/RMSProp_1" in names

    saved = load_checkpoint(run_dir / "ckpt-42.pt")
    for weights, want in (
        ("raw", saved["model"]),
        ("ema", {**saved["model"], **saved["ema"], **saved["bn_ema"]}),
    ):
        out = tmp_path / f"{weights}.pt"
        assert (
            main(
                [
                    "from-tf",
                    str(prefix.parent),
                    "--model",
                    "resnet18",
                    "--weights",
                    weights,
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        back = load_checkpoint(out)
        assert back["step"] == 42 and back["config"] == {
            "model": "resnet18",
            "num_classes": 5,
            "base_channels": 8,
        }
        for key, value in want.items():
            if value.is_floating_point():
                assert torch.equal(back["model"][key], value), (weights, key)
    assert "5 classes, step 42" in capsys.readouterr().out


def test_global_step_dtype_is_the_seeds(run_dir, tmp_path):
    prefix = tmp_path / "tf" / "model.ckpt-42"
    main(["to-tf", str(run_dir / "ckpt-42.pt"), "--out", str(prefix)])
    step = open_checkpoint(prefix).get("global_step")
    assert step.dtype.name == "int64" and step == 42  # the ResNet seeds' (the Inception seed's is float32)


def test_errors_are_one_line(run_dir, tmp_path, capsys):
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint" * 10)
    assert main(["from-tf", str(junk), "--model", "resnet18", "--out", str(tmp_path / "x.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{junk} is not a TensorFlow checkpoint file" in err

    prefix = tmp_path / "tf" / "model.ckpt-42"
    main(["to-tf", str(run_dir), "--out", str(prefix)])
    capsys.readouterr()
    assert main(["from-tf", str(prefix), "--model", "resnet34", "--out", str(tmp_path / "y.pt")]) == 1
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "does not fit model resnet34: variable resnet_model/conv2d_5/kernel" in err
    )

    assert main(["to-tf", str(tmp_path / "nothing.pt"), "--out", str(tmp_path / "z")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err


def test_a_from_tf_file_goes_back_to_tf(run_dir, tmp_path):
    """A weights-only file (from-tf's) has a config of three fields and no optimizer: to-tf writes its
    weights, BN statistics and global_step, and from-tf reads the same weights again."""
    first, again = tmp_path / "a" / "model.ckpt-42", tmp_path / "b" / "model.ckpt-42"
    main(["to-tf", str(run_dir), "--out", str(first)])
    main(["from-tf", str(first), "--model", "resnet18", "--out", str(tmp_path / "a.pt")])
    assert main(["to-tf", str(tmp_path / "a.pt"), "--out", str(again)]) == 0
    assert len(open_checkpoint(again).shapes()) == 62 + 40 + 1
    main(["from-tf", str(again), "--model", "resnet18", "--out", str(tmp_path / "b.pt")])
    a, b = load_checkpoint(tmp_path / "a.pt"), load_checkpoint(tmp_path / "b.pt")
    assert b["step"] == 42
    for key, value in a["model"].items():
        assert torch.equal(b["model"][key], value), key


def test_out_is_checked_before_the_work_and_never_replaced_unasked(run_dir, tmp_path, capsys):
    """Each of these ended in a traceback (FileExistsError, IsADirectoryError), or, a run's own
    ckpt-<step>.pt given as --out, replaced it without a word: its old .sha256 stayed beside it and
    the run could no longer resume."""
    prefix = tmp_path / "tf" / "model.ckpt-42"
    assert main(["to-tf", str(run_dir), "--out", str(prefix)]) == 0
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    ckpt = run_dir / "ckpt-42.pt"
    before = ckpt.read_bytes()
    from_tf = ["from-tf", str(prefix), "--model", "resnet18", "--out"]
    capsys.readouterr()
    for argv, words in (
        (from_tf + [str(ckpt)], f"--out {ckpt} exists; pick another --out, or pass --overwrite"),
        (from_tf + [str(a_file / "x.pt")], f"{a_file} is a file, not a directory"),
        (["to-tf", str(run_dir), "--out", str(prefix)], f"--out {prefix}.index exists"),
        (["to-tf", str(run_dir), "--out", str(a_file / "model.ckpt-1")], f"{a_file} is a file"),
    ):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "Traceback" not in err, (argv, err)
    assert ckpt.read_bytes() == before
    assert main(from_tf + [str(ckpt), "--overwrite"]) == 0  # asked for: replaced
    assert load_checkpoint(ckpt)["config"]["model"] == "resnet18" and "optimizer" not in load_checkpoint(ckpt)
    assert main(["to-tf", str(run_dir), "--out", str(prefix), "--overwrite"]) == 0


def test_an_out_that_names_a_directory_is_a_bad_flag(run_dir, tmp_path, capsys):
    """to-tf --out DIR (or DIR/) wrote DIR.index and DIR.data-* beside DIR, and made the parent's
    `checkpoint` file name them; from-tf --out NEW/ wrote a file named NEW."""
    prefix = tmp_path / "tf" / "model.ckpt-42"
    assert main(["to-tf", str(run_dir), "--out", str(prefix)]) == 0
    work = tmp_path / "work"
    existing = work / "existing"
    existing.mkdir(parents=True)
    (work / "checkpoint").write_text('model_checkpoint_path: "other.ckpt-1"\n')
    pt_file = "the path of the .pt file to write, such as"
    tf_prefix = "a TensorFlow checkpoint prefix in it, such as"
    capsys.readouterr()
    for argv, words in (
        (["to-tf", str(run_dir), "--out", str(existing)], f"{tf_prefix} {existing / 'model.ckpt-N'}"),
        (["to-tf", str(run_dir), "--out", f"{existing}/"], f"{tf_prefix} {existing / 'model.ckpt-N'}"),
        (["to-tf", str(run_dir), "--out", f"{work}/new/"], f"{tf_prefix} {work / 'new' / 'model.ckpt-N'}"),
        (["from-tf", str(prefix), "--model", "resnet18", "--out", str(existing)], pt_file),
        (["from-tf", str(prefix), "--model", "resnet18", "--out", f"{work}/new/"], pt_file),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {argv[-1]} is a directory; give " in err, (argv, err)
        assert words in err, (argv, err)
    assert sorted(p.name for p in work.iterdir()) == ["checkpoint", "existing"]
    assert not any(existing.iterdir())
    assert (work / "checkpoint").read_text() == 'model_checkpoint_path: "other.ckpt-1"\n'


def test_to_tf_keeps_the_checkpoints_a_checkpoint_file_lists(run_dir, tmp_path, capsys):
    """A second export into a directory (or one into a TF train directory) rewrote its `checkpoint`
    file to name the export alone: the checkpoints it listed were dropped. A `checkpoint` that is not
    TF's file was replaced without --overwrite."""
    state = tmp_path / "checkpoint"
    state.write_text('model_checkpoint_path: "model.ckpt-2"\nall_model_checkpoint_paths: "model.ckpt-1"\n')
    assert main(["to-tf", str(run_dir), "--out", str(tmp_path / "model.ckpt-42")]) == 0
    listed = ["model.ckpt-1", "model.ckpt-2", "model.ckpt-42"]  # oldest first, as TF's Saver lists them
    assert state.read_text().splitlines() == [
        'model_checkpoint_path: "model.ckpt-42"',
        *(f'all_model_checkpoint_paths: "{name}"' for name in listed),
    ]
    assert main(["to-tf", str(run_dir), "--out", str(tmp_path / "model.ckpt-42"), "--overwrite"]) == 0
    assert state.read_text().count("model.ckpt-42") == 2  # listed once, and named the newest

    other = tmp_path / "other"
    other.mkdir()
    (other / "checkpoint").write_text("my notes\n")
    capsys.readouterr()
    assert main(["to-tf", str(run_dir), "--out", str(other / "model.ckpt-42")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{other / 'checkpoint'} is not a TensorFlow `checkpoint` file" in err
    assert (other / "checkpoint").read_text() == "my notes\n" and list(other.iterdir()) == [
        other / "checkpoint"
    ]
    assert main(["to-tf", str(run_dir), "--out", str(other / "model.ckpt-42"), "--overwrite"]) == 0
    assert (other / "checkpoint").read_text().startswith('model_checkpoint_path: "model.ckpt-42"\n')
