"""fasttrain.resume: which setting changes a resume reports (the CLI tests cover refusal and note),
and a change of the number of ranks, which no flag records; end to end, a run SIGKILLed and restarted
is bit-exact with an uninterrupted one (every logged loss, every checkpointed buffer), a run directory
whose only checkpoint is unusable stops the run instead of starting over, and a refused resume keeps
the run's config.json."""

import dataclasses
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from launch_helpers import ENV, command, reached_step, run_torchrun, trainer, trainer_args, trainer_env

from fasttrain.config import make_config
from fasttrain.data.synthetic import make_synthetic
from fasttrain.resume import changed_settings


def test_changed_settings_names_what_changes_the_numbers_only():
    saved = dataclasses.asdict(make_config(batch_size=8, seed=1, max_steps=100, log_every=10))
    now = make_config(batch_size=4, seed=1, max_steps=300, log_every=5, train_dir="elsewhere")
    assert changed_settings(saved, now) == ["batch_size 8 -> 4"]
    assert changed_settings(saved, make_config(batch_size=8, seed=2, max_steps=100)) == ["seed 1 -> 2"]
    assert changed_settings(None, now) == []  # a checkpoint without its config: nothing to compare
    assert changed_settings({"batch_size": 8}, now) == ["batch_size 8 -> 4"]  # keys it lacks are skipped


def test_a_resume_on_fewer_ranks_says_the_global_batch_changed(tmp_path):
    # A 2-rank checkpoint resumed by one process: the global batch halves (8 -> 4), the steps per
    # epoch and each rank's data change; that continued without the note other such changes get.
    data, run_dir = tmp_path / "data", tmp_path / "run"
    make_synthetic(data, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    flags = ("--num_workers=0", "--checkpoint_every=2")
    (two,) = run_torchrun(["-m", "fasttrain", *trainer_args(data, run_dir, *flags, "--max_steps=2")])
    assert two.returncode == 0, two.stdout[-3000:]
    one = subprocess.run(
        trainer(data, run_dir, *flags, "--max_steps=3"), env=trainer_env(), capture_output=True, text=True
    )
    assert one.returncode == 0, one.stderr[-3000:]
    note = "note: settings changed since that checkpoint: world size 2 -> 1 (global batch 8 -> 4)"
    assert note in one.stdout, one.stdout


# --- end to end through the CLI (tests/launch_helpers.py's `command`) ---------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


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
