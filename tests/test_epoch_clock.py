"""A run resumed with another global batch goes on in epochs of data (fasttrain/epoch_clock.py).

Reproduced before the clock: a 1-epoch run whose batch halved after half an epoch read 1.25 epochs,
and its LR decays, set in epochs, fell at other records than asked. The references here are
computed from the records read, independently of the trainer's step arithmetic."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fasttrain.config import make_config
from fasttrain.data.synthetic import make_synthetic
from fasttrain.epoch_clock import EpochClock
from fasttrain.schedule import LRSchedule
from fasttrain.train import train

EPOCH = 48  # training records: 2 shards of 24


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


def _run(data, run_dir, **overrides):
    values = dict(model="resnet18", base_channels=8, image_size=32, num_classes=4, optimizer="momentum")
    values.update(data_backend="torch", data_dir=str(data), device="cpu", num_workers=0, deterministic=True)
    values.update(log_every=1, checkpoint_every=100, eval_at_end=False, train_dir=str(run_dir))
    values.update(lr_schedule="exponential", initial_learning_rate=0.1, learning_rate_decay_factor=0.5)
    values.update(num_epochs_per_decay=0.25, max_steps=0)
    return train(make_config(**{**values, **overrides}))


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "lr" in r]


def test_a_batch_change_keeps_train_epochs_and_the_lr_schedule_in_epochs_of_data(data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _run(data, run_dir, batch_size=4, train_epochs=0.5)["step"] == 6  # 24 records: half an epoch
    capsys.readouterr()
    assert _run(data, run_dir, batch_size=2, train_epochs=1)["step"] == 18  # 12 steps of 2: 24 records
    out = capsys.readouterr().out
    assert "note: the global batch is 2 from step 6 on, after 0.5 epochs" in out and "ends at step 18" in out
    records_before = {}  # the records read before each step's update
    for r in _rows(run_dir):
        step = r["step"]
        records_before[step] = 4 * (step - 1) if step <= 6 else 24 + 2 * (step - 7)
    assert sorted(records_before) == list(range(1, 19))
    assert records_before[18] + 2 == EPOCH  # exactly one epoch read in all
    for r in _rows(run_dir):  # decay every quarter epoch (12 records), from the records read
        expected = 0.1 * 0.5 ** math.floor(records_before[r["step"]] / (EPOCH * 0.25))
        assert r["lr"] == pytest.approx(expected, rel=1e-12), r["step"]
    # The clock travels with the checkpoints: the same command again is finished at step 18, not 24.
    _run(data, run_dir, batch_size=2, train_epochs=1)
    assert "already holds a finished run at step 18" in capsys.readouterr().out


def test_the_zero_clock_changes_nothing_and_the_device_lr_follows_the_host_one():
    cfg = make_config(lr_schedule="piecewise", lr_boundary_epochs=[0.3, 0.7], initial_learning_rate=1.0)
    assert EpochClock().apply(cfg, 5, None, 480, 4)[:2] == (0, cfg.max_steps)  # no shift asked of None
    for kind in ("piecewise", "exponential"):
        cfg = make_config(
            lr_schedule=kind,
            lr_boundary_epochs=[0.3, 0.7],
            num_epochs_per_decay=0.25,
            initial_learning_rate=1.0,
        )
        schedule = LRSchedule(cfg, 480 / 8, 8)
        clock = EpochClock.after_resume(
            {"config": {"batch_size": 4, "grad_accum_steps": 1}, "world_size": 1, "epoch_size": 480},
            30,
            8,
            480,
        )
        assert clock == EpochClock(step=30, epochs=0.25)  # 30 steps of 4 of 480 records
        schedule.shift(clock.lr_offset(480 / 8))
        out = torch.zeros((), dtype=torch.float32)
        for step in range(30, 90):
            epochs = 0.25 + (step - 30) * 8 / 480
            if kind == "exponential":
                expected = 0.5 ** math.floor(epochs / 0.25 + 1e-9)
            else:
                expected = 0.5 ** sum(epochs * 60 > int(60 * e) for e in (0.3, 0.7))
            assert schedule.at(step) == pytest.approx(expected), (kind, step)
            schedule.on_device(torch.tensor(step), out)
            assert out.item() == pytest.approx(schedule.at(step), rel=1e-6), (kind, step)
    same = {"config": {"batch_size": 8, "grad_accum_steps": 1}, "world_size": 1, "epoch_size": 480}
    assert EpochClock.after_resume(same, 30, 8, 480) == EpochClock()  # the same batch: no clock
    kept = {**same, "epoch_clock": {"step": 30, "epochs": 0.25}}
    assert EpochClock.after_resume(kept, 60, 8, 480) == EpochClock(30, 0.25)  # a later resume keeps it
