"""fasttrain.resume: which setting changes a resume reports (the CLI tests cover refusal and note),
and a change of the number of ranks, which no flag records."""

import dataclasses
import subprocess

from launch_helpers import run_torchrun, trainer, trainer_args, trainer_env

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
