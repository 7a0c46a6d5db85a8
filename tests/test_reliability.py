"""Reliability end to end: SIGKILL + restart is bit-exact, SIGTERM stops cleanly, non-finite losses
stop the run with the last good checkpoint intact, bad data and bad checkpoints give one-line errors."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch_helpers import reached_step

from fasttrain.data.imagenet import list_shards
from fasttrain.data.synthetic import make_synthetic
from fasttrain.data.tfrecord import build_index

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # PYTHONPATH: conftest.py


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


def command(data_dir, run_dir, *extra):
    return [
        sys.executable,
        "-m",
        "fasttrain",
        f"--data_dir={data_dir}",
        f"--train_dir={run_dir}",
        "--num_classes=4",
        "--batch_size=4",
        "--image_size=32",
        "--num_workers=0",
        "--log_every=1",
        "--checkpoint_every=2",
        "--deterministic",
        "--no-eval_at_end",
        "--optimizer=rmsprop",
        "--ema_decay=0.9",
        "--optimizer_impl=torch",
        *extra,
    ]


def losses(run_dir: Path) -> dict[int, float]:
    """Per-step losses; after a restart the re-run steps overwrite the killed run's entries."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def assert_same_tensors(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tensors(x, y, f"{where}[{i}]")


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    out = subprocess.run(command(data, run_dir, "--max_steps=14"), env=ENV, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return run_dir


@pytest.mark.parametrize("kill_at", [3, 8, 13])
def test_sigkill_and_restart_is_bit_exact(data, reference, tmp_path, kill_at):
    # 14 steps over 2 x 24 records at batch 4 crosses an epoch boundary (12 steps per epoch).
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        command(data, run_dir, "--max_steps=14"), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + 120
    while reached_step(run_dir) < kill_at and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert reached_step(run_dir) < 14, "the run finished before it could be killed"
    again = subprocess.run(command(data, run_dir, "--max_steps=14"), env=ENV, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert losses(run_dir) == losses(reference)
    ours = torch.load(run_dir / "ckpt-14.pt", weights_only=True)
    theirs = torch.load(reference / "ckpt-14.pt", weights_only=True)
    for key in ("model", "optimizer", "ema", "bn_ema", "train_step", "data"):
        assert_same_tensors(ours[key], theirs[key], key)


def test_sigterm_saves_once_and_exits_0_then_resumes(data, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        command(data, run_dir, "--max_steps=100000", "--checkpoint_every=1000"),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while reached_step(run_dir) < 3 and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    line = [ln for ln in stdout.splitlines() if ln.startswith("stopped by SIGTERM at step")]
    assert line, stdout
    step = int(line[0].split("at step ")[1].split(";")[0])
    assert [p.name for p in run_dir.glob("ckpt-*.pt")] == [f"ckpt-{step}.pt"]
    resumed = subprocess.run(
        command(data, run_dir, f"--max_steps={step + 1}"), env=ENV, capture_output=True, text=True
    )
    assert resumed.returncode == 0 and f"resuming from step {step}" in resumed.stdout


def test_nonfinite_loss_stops_with_last_good_checkpoint(data, tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        command(
            data,
            run_dir,
            "--max_steps=50",
            "--optimizer=momentum",
            "--initial_learning_rate=1e30",
            "--checkpoint_every=1",
        ),
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "the loss was not finite" in out.stderr
    assert out.stderr.strip().count("\n") == 0
    saved = sorted(int(p.name[5:-3]) for p in run_dir.glob("ckpt-*.pt"))
    assert saved, "no checkpoint before the loss went bad"
    state = torch.load(run_dir / f"ckpt-{saved[-1]}.pt", weights_only=True)
    assert f"ckpt-{saved[-1]}.pt" in out.stderr
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


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


def test_skip_corrupt_counts_skipped_records(data, tmp_path):
    bad, _, _ = _corrupt_copy(data, tmp_path)
    run_dir = tmp_path / "run"
    out = subprocess.run(
        command(bad, run_dir, "--max_steps=14", "--skip_corrupt"), env=ENV, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["skipped_records"] >= 1


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


def test_no_usable_checkpoint_stops_instead_of_starting_over(data, tmp_path):
    # The run directory holds only a checkpoint that cannot be loaded (here: not a checkpoint at all).
    # Starting from step 0 would spend the compute again and later overwrite it: stop, name it, and
    # leave the directory as it was.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ckpt-6.pt").write_bytes(b"not a checkpoint")
    (run_dir / "config.json").write_text('{"note": "the earlier run"}\n')
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    out = subprocess.run(command(data, run_dir, "--max_steps=2"), env=ENV, capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "none is usable (ckpt-6.pt" in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
    assert "refusing to load" in out.stdout and "ckpt-6.pt" in out.stdout  # the reason, as a warning
    # run.lock: the record of the run directory's lock (fasttrain/lock.py), not a run's file
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.name != "run.lock"} == before


def test_refused_resume_keeps_the_runs_config(data, tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.run(command(data, run_dir, "--max_steps=2"), env=ENV, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    config = (run_dir / "config.json").read_text()
    refused = subprocess.run(
        command(data, run_dir, "--max_steps=4", "--optimizer=momentum"),
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1 and "(optimizer 'rmsprop' -> 'momentum')" in refused.stderr, refused.stderr
    assert (run_dir / "config.json").read_text() == config


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))
