"""Training top-1 (the ResNet seed's train_accuracy): computed inside the step on the device, of the
batch the step trained on, before its update; averaged by the trainer over the steps of a log line."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fasttrain.config import make_config
from fasttrain.data.normalize import normalize_images
from fasttrain.optim import FusedMomentum
from fasttrain.precision import Precision
from fasttrain.schedule import LRSchedule
from fasttrain.step import TrainStep, classification_loss
from fasttrain.train import train

CPU = torch.device("cpu")


class TwoHeads(torch.nn.Module):
    """Inception's output shape, (logits, aux logits), with heads that disagree."""

    def __init__(self, classes: int):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1))
        self.logits, self.aux = torch.nn.Linear(8, classes), torch.nn.Linear(8, classes)

    def forward(self, x):
        h = self.features(x).flatten(1)
        return self.logits(h), self.aux(h)


def _batch(seed: int, n: int = 64, classes: int = 10):
    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 16, 16, 3), dtype=torch.uint8, generator=gen)
    return images, torch.randint(0, classes, (n,), generator=gen)


def _top1(model, images, labels) -> float:
    """Independent reference: the main head's argmax against the labels, weights before the update."""
    with torch.no_grad():
        logits = model(normalize_images(images, "resnet", torch.float32, False))[0]
    return (logits.argmax(dim=1) == labels).double().mean().item()


@pytest.mark.parametrize("accum", [1, 2])
def test_last_top1_is_the_trained_batches_top1_before_the_update(accum):
    torch.manual_seed(0)
    model = TwoHeads(10)
    opt = FusedMomentum(model.parameters(), lr=0.5, momentum=0.9, impl="torch")
    schedule = LRSchedule(make_config(initial_learning_rate=0.5), 100, 64, CPU)
    loss_fn = lambda out, y: classification_loss(out, y, aux_weight=0.4)
    step = TrainStep(
        model,
        optimizer=opt,
        precision=Precision("fp32", False, False),
        device=CPU,
        schedule=schedule,
        loss_fn=loss_fn,
        preprocess="resnet",
    )
    seen = set()
    for i in range(6):
        batches = [_batch(10 * i + k) for k in range(accum)]
        before = copy.deepcopy(model)
        expected = sum(_top1(before, *b) for b in batches) / accum
        step(batches)
        assert step.last_top1.item() == pytest.approx(expected, abs=1e-6)
        seen.add(round(expected, 4))
    assert len(seen) > 1, "the batches should not all have the same top-1"


def test_train_top1_in_metrics_log_line_and_tensorboard(tmp_path, capsys):
    run_dir = tmp_path / "run"
    values = dict(model="resnet18", base_channels=8, image_size=32, batch_size=8, num_classes=4)
    values.update(data_backend="synthetic", device="cpu", max_steps=4, log_every=2, eval_at_end=False)
    cfg = make_config(**values, train_dir=str(run_dir), num_workers=0, deterministic=True)
    train(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    top1 = [r["train_top1"] for r in records]
    assert len(top1) == 2 and all(0.0 <= t <= 1.0 for t in top1)
    # the mean of two batches of 8: a multiple of 1/16
    assert all(abs(t * 16 - round(t * 16)) < 1e-5 for t in top1), top1
    out = capsys.readouterr().out
    assert f"train top-1 {top1[0]:.3f}" in out and f"train top-1 {top1[1]:.3f}" in out
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(run_dir))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("train/train_top1")]
    assert got == [(2, pytest.approx(top1[0])), (4, pytest.approx(top1[1]))]
