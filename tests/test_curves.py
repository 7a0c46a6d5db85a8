"""TensorBoard event files, read back with TensorBoard's own reader (EventAccumulator)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fasttrain.config import ConfigError, make_config
from fasttrain.train import train

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _cfg(tmp_path, **overrides):
    """A ResNet-18 8 channels wide at 32 px, batch 4, random device batches: hundredths of a second a step."""
    values = dict(model="resnet18", base_channels=8, image_size=32, batch_size=4, num_classes=4)
    values.update(data_backend="synthetic", device="cpu", max_steps=6, log_every=1, eval_at_end=False)
    values.update(train_dir=str(tmp_path / "run"), num_workers=0, checkpoint_every=3, deterministic=True)
    return make_config(**{**values, **overrides})


def _curves(run_dir, histograms=0):
    acc = event_accumulator.EventAccumulator(
        str(run_dir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: histograms}
    )
    acc.Reload()
    return acc


def _scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_every_log_step_and_evaluation_is_a_point(tmp_path):
    run_dir = tmp_path / "run"
    train(_cfg(tmp_path, eval_at_end=True, max_eval_batches=1, ema_decay=0.9))
    acc = _curves(run_dir)
    records = [r for r in _metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "loss_avg", "lr", "examples_per_sec", "loss_scale", "skipped_steps"):
        # float32 in the event file: compare at its precision
        got = _scalars(acc, f"train/{key}")
        assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6], key
        assert [v for _, v in got] == pytest.approx([r[key] for r in records], rel=1e-6), key
    # log_every 1: the mean since the last log line is that one step's loss
    assert [r["loss_avg"] for r in records] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    final = next(r for r in _metrics(run_dir) if r.get("split") == "validation")
    for key in ("top1", "top5", "ema_top1", "ema_top5"):
        assert _scalars(acc, f"eval/{key}") == [(6, pytest.approx(final[key]))], key
    assert not acc.Tags()["histograms"], "histograms are off by default"


def test_loss_avg_is_the_mean_over_the_log_window(tmp_path):
    every_step = tmp_path / "a"
    train(_cfg(every_step, max_steps=4))
    every_second = tmp_path / "b"
    train(_cfg(every_second, max_steps=4, log_every=2))
    # The step's cross-entropy is averaged on the device; the L2 term, of the log step's weights, is
    # added at the log step (README: train/*).
    losses = {r["step"]: r["cross_entropy"] for r in _metrics(every_step / "run")}
    windows = {r["step"]: r["loss_avg"] - r["l2_loss"] for r in _metrics(every_second / "run")}
    assert windows == pytest.approx({2: (losses[1] + losses[2]) / 2, 4: (losses[3] + losses[4]) / 2})


def test_loss_ema_is_the_seeds_exponential_moving_average(tmp_path):
    """The Inception seed's smoothed loss: ExponentialMovingAverage(0.9) of each step's total loss, shadow
    from 0 (no zero-debiasing), shadow -= 0.1 * (shadow - loss); recomputed here from the raw per-step
    losses (log_every 1), then read at log_every 2 from a second run of the same steps."""
    every_step = tmp_path / "a"
    train(_cfg(every_step, max_steps=6))
    records = [r for r in _metrics(every_step / "run") if "loss" in r]
    # The seed's: an average of each step's total loss (cross-entropy + L2), in float64 here.
    seed, total = {}, 0.0
    for r in records:
        total -= (total - r["loss"]) * 0.1
        seed[r["step"]] = total
    # fasttrain's: its device-side float32 average of the cross-entropy, plus the log step's L2 term's
    # share, l2 * (1 - 0.9^n) (README: train/*). The two differ by how much the L2 term moved over
    # the steps averaged: bounded by its largest move in this run.
    drift = max(r["l2_loss"] for r in records) - min(r["l2_loss"] for r in records)
    for r in records:
        assert r["loss_ema"] == pytest.approx(seed[r["step"]], abs=drift + 1e-6), r["step"]
    shadow, device = np.float32(0), {}
    for r in records:
        shadow = np.float32(shadow - (shadow - np.float32(r["cross_entropy"])) * np.float32(0.1))
        device[r["step"]] = float(shadow)
    share = {r["step"]: r["l2_loss"] * (1 - 0.9 ** r["step"]) for r in records}
    ours = {r["step"]: r["loss_ema"] - share[r["step"]] for r in records}
    assert ours == pytest.approx(device, rel=1e-12)  # the device's float32 average, exactly
    assert _scalars(_curves(every_step / "run"), "train/loss_ema") == [
        (step, pytest.approx(value + share[step], rel=1e-6)) for step, value in device.items()
    ]
    every_second = tmp_path / "b"
    train(_cfg(every_second, max_steps=6, log_every=2))
    read = {r["step"]: r["loss_ema"] for r in _metrics(every_second / "run") if "loss" in r}
    assert read == pytest.approx({step: device[step] + share[step] for step in (2, 4, 6)}, rel=1e-12)


def test_a_resumed_run_continues_the_curves_without_duplicates(tmp_path):
    run_dir = tmp_path / "run"
    train(_cfg(tmp_path))
    first = _scalars(_curves(run_dir), "train/loss")
    first_ema = _scalars(_curves(run_dir), "train/loss_ema")
    # As if the first run had died after logging step 6 but before its checkpoint: resume from step 3.
    (run_dir / "ckpt-6.pt").unlink()
    (run_dir / "ckpt-6.pt.sha256").unlink()
    assert train(_cfg(tmp_path)) == {"step": 6}
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2
    again = _scalars(_curves(run_dir), "train/loss")
    assert [s for s, _ in again] == [1, 2, 3, 4, 5, 6]
    # --deterministic on the CPU: the re-run steps 4-6 are the same numbers
    assert again == first
    # ...and the points 4-6 come from the second run's file (the first run's are purged)
    lr = _scalars(_curves(run_dir), "train/lr")
    assert [s for s, _ in lr] == [1, 2, 3, 4, 5, 6]
    # The seed's moving average of the loss resumes from the checkpoint, not from 0.
    assert _scalars(_curves(run_dir), "train/loss_ema") == first_ema


def test_histograms_only_when_asked_and_only_at_their_steps(tmp_path):
    run_dir = tmp_path / "run"
    train(_cfg(tmp_path, max_steps=4, log_every=2, histogram_every=4))
    acc = _curves(run_dir, histograms=0)
    tags = acc.Tags()["histograms"]
    assert "weights/conv1.weight" in tags and "gradients/fc.weight" in tags, tags
    assert [e.step for e in acc.Histograms("gradients/fc.weight")] == [4]


def test_no_tensorboard_writes_no_event_file(tmp_path):
    train(_cfg(tmp_path, max_steps=2, tensorboard=False))
    assert not list((tmp_path / "run").glob("events.out.tfevents.*"))


def test_histogram_every_must_be_a_multiple_of_log_every(tmp_path):
    with pytest.raises(ConfigError, match="multiple of --log_every"):
        _cfg(tmp_path, log_every=2, histogram_every=3)
