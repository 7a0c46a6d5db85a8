"""`python -m fasttrain` as a user runs it: a short demo run, resume, and one-line errors (among them
a pickled checkpoint that would run code, a checkpoint of another shape, an empty data directory)."""

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_helpers import ENV, command

from fasttrain.data.synthetic import make_synthetic


def run_cli(*args, cache: Path, timeout=600):
    env = {**os.environ, "FASTTRAIN_CACHE": str(cache), "OMP_NUM_THREADS": "2"}
    return subprocess.run(
        [sys.executable, "-m", "fasttrain", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=cache,
    )


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=40, classes=4, seed=0)
    return root


SHORT = [
    "--num_classes=4",
    "--batch_size=8",
    "--num_workers=0",
    "--log_every=2",
    "--max_eval_batches=2",
    "--image_size=32",
]


def test_short_run_trains_checkpoints_and_resumes(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli(
        "--data_dir",
        str(tiny_data),
        "--train_dir",
        str(run_dir),
        "--max_steps=4",
        "--checkpoint_every=2",
        *SHORT,
        cache=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    assert "step 2, loss = " in first.stdout and "examples/sec; " in first.stdout
    assert "validation top-1" in first.stdout.strip().splitlines()[-1]
    assert {p.name for p in run_dir.glob("ckpt-*.pt")} == {"ckpt-2.pt", "ckpt-4.pt"}
    state = torch.load(run_dir / "ckpt-4.pt", weights_only=True)
    assert state["step"] == 4 and "model" in state and "optimizer" in state and "ema" in state
    config = json.loads((run_dir / "config.json").read_text())
    assert config["max_steps"] == 4 and config["data_dir"] == str(tiny_data)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4]
    assert any(r.get("split") == "validation" for r in records)

    second = run_cli(
        "--data_dir",
        str(tiny_data),
        "--train_dir",
        str(run_dir),
        "--max_steps=6",
        "--checkpoint_every=2",
        *SHORT,
        cache=tmp_path,
    )
    assert second.returncode == 0, second.stderr
    assert "resuming from step 4" in second.stdout
    assert "step 6, loss = " in second.stdout and "step 2, loss" not in second.stdout
    assert torch.load(run_dir / "ckpt-6.pt", weights_only=True)["step"] == 6

    again = run_cli(
        "--data_dir", str(tiny_data), "--train_dir", str(run_dir), "--max_steps=6", *SHORT, cache=tmp_path
    )
    assert again.returncode == 0, again.stderr
    assert "already holds a finished run at step 6" in again.stdout
    assert "resuming from step" not in again.stdout  # nothing resumes: it only evaluates

    # A resume under other settings: the model's are named in the refusal, the rest in a note.
    common = ["--data_dir", str(tiny_data), "--train_dir", str(run_dir), "--max_steps=7", *SHORT]
    wider = run_cli(*common, "--base_channels=8", "--seed=3", cache=tmp_path)
    assert wider.returncode == 1 and "Traceback" not in wider.stderr, wider.stderr[-2000:]
    assert "ckpt-6.pt does not fit this run's model/optimizer (base_channels 16 -> 8)" in wider.stderr
    smaller = run_cli(*common, "--batch_size=4", cache=tmp_path)
    assert smaller.returncode == 0, smaller.stderr[-2000:]
    assert "note: settings changed since that checkpoint: batch_size 8 -> 4" in smaller.stdout


def test_default_demo_builds_its_data_once_in_the_cache(tmp_path):
    out = run_cli(
        "--max_steps=2",
        "--log_every=1",
        "--max_eval_batches=1",
        "--train_dir",
        str(tmp_path / "r"),
        cache=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "building the demo data set" in out.stdout
    assert (
        sorted(p.name for p in (tmp_path / "demo-imagenet-v1").iterdir() if p.name.startswith("train-"))[0]
        == "train-00000-of-00004"
    )
    again = run_cli(
        "--max_steps=3",
        "--log_every=1",
        "--max_eval_batches=1",
        "--train_dir",
        str(tmp_path / "r"),
        cache=tmp_path,
    )
    assert again.returncode == 0, again.stderr
    assert "building the demo data set" not in again.stdout and "resuming from step 2" in again.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--no_such_flag=1"], "unknown flag --no_such_flag"),
        (["--recipe", "resnet9000"], "unknown recipe 'resnet9000'"),
        (["--data_dir", "/nonexistent/imagenet"], "--data_dir /nonexistent/imagenet does not exist"),
        (["--recipe", "inception_v3"], "--data_dir is required"),
        # raised by fasttrain.precision with the setting's plain name; the CLI writes it as the flag
        (["--precision=fp16", "--device=cpu"], "error: --precision=fp16 is for CUDA devices"),
    ],
)
def test_user_errors_are_one_line_with_exit_code_2(args, words, tmp_path):
    out = run_cli(*args, cache=tmp_path, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and words in out.stderr


def test_synthetic_backend_needs_no_data_dir_and_builds_no_data(tmp_path):
    # A pure compute run of a real recipe: random device batches, no TFRecords read or written.
    args = ["--recipe=resnet50", "--model=resnet18", "--base_channels=8", "--image_size=32"]
    args += ["--data_backend=synthetic", "--max_steps=2", "--log_every=1", "--max_eval_batches=1"]
    out = run_cli(*args, "--train_dir", str(tmp_path / "r"), cache=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| data synthetic |" in out.stdout and "building the demo data set" not in out.stdout
    assert not (tmp_path / "demo-imagenet-v1").exists()


def test_unwritable_train_dir_is_one_line(tiny_data, tmp_path):
    (tmp_path / "a-file").write_text("")
    out = run_cli(
        "--data_dir", str(tiny_data), *SHORT, "--train_dir", str(tmp_path / "a-file" / "r"), cache=tmp_path
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"--train_dir {tmp_path / 'a-file' / 'r'} cannot be written (Not a directory)" in out.stderr


@pytest.mark.gpu
def test_demo_on_cuda_captures_the_step_learns_and_resumes(tmp_path):
    # The whole trainer on a GPU as a user runs it: the policy's precision (bf16 on sm_80+),
    # channels_last, the step captured in a CUDA graph while two loader workers and the pin-memory
    # thread keep running; then a resumed run that captures again.
    run_dir = tmp_path / "r"
    out = run_cli("--train_dir", str(run_dir), cache=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    # --compile is the default on CUDA: the model's blocks compiled inside the captured step.
    assert "1 x cuda" in out.stdout and "channels_last cuda-graph compiled stem4" in out.stdout, out.stdout[
        :2000
    ]
    top1 = float(re.search(r"validation top-1 ([0-9.]+)", out.stdout).group(1))
    assert top1 > 0.5, out.stdout[-2000:]  # chance is 0.1 (10 classes); the CPU run reaches 1.0
    again = run_cli("--train_dir", str(run_dir), "--max_steps=330", cache=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from step 300" in again.stdout and "done: step 330" in again.stdout, again.stdout[-2000:]


def test_help_into_a_closed_pipe_is_quiet(tmp_path):
    # `python -m fasttrain --help | head -3`: the reader is gone before the text is written.
    proc = subprocess.Popen(
        [sys.executable, "-m", "fasttrain", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env={**os.environ, "FASTTRAIN_CACHE": str(tmp_path)},
    )
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, stderr
    assert stderr == ""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


@pytest.mark.parametrize(
    "setup, words",
    [
        ("empty", "no train-NNNNN-of-NNNNN shards"),
        ("pickle", "refusing to load"),
        ("shape", "does not fit model"),
        ("ckdir", "--checkpoint_dir"),
    ],
)
def test_bad_inputs_give_one_line(data, tmp_path, setup, words):
    extra = []
    data_dir = data
    if setup == "empty":
        data_dir = tmp_path / "empty"
        data_dir.mkdir()
    elif setup == "pickle":
        with open(tmp_path / "evil.pt", "wb") as f:
            pickle.dump({"model": _Evil(), "step": 1}, f)
        extra = [f"--pretrained_model_checkpoint_path={tmp_path / 'evil.pt'}"]
    elif setup == "shape":
        torch.save({"model": {"fc.weight": torch.zeros(3, 3)}, "step": 1}, tmp_path / "other.pt")
        extra = [f"--pretrained_model_checkpoint_path={tmp_path / 'other.pt'}"]
    else:
        extra = [f"--checkpoint_dir={tmp_path / 'nowhere'}"]
    out = subprocess.run(
        command(data_dir, tmp_path / "run", "--max_steps=2", *extra), env=ENV, capture_output=True, text=True
    )
    assert out.returncode in (1, 2) and "Traceback" not in out.stderr, out.stderr
    assert words in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
    assert not (tmp_path / "pwned").exists()


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))
