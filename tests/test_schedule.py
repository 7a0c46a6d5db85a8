"""The LR schedules against TensorFlow's formulas, on the host and from the device step counter."""

import math

import pytest
import torch

from fasttrain.config import make_config
from fasttrain.schedule import LRSchedule


def tf_exponential_decay(lr0, step, decay_steps, rate):
    # tf.compat.v1.train.exponential_decay(..., staircase=True)
    return lr0 * rate ** math.floor(step / decay_steps)


def tf_piecewise_constant(step, boundaries, values):
    # tf.compat.v1.train.piecewise_constant: values[0] for step <= boundaries[0], values[i] for
    # boundaries[i-1] < step <= boundaries[i], values[-1] after the last (the ResNet seed's boundaries
    # are step counts: epochs x steps per epoch)
    for b, v in zip(boundaries, values):
        if step <= b:
            return v
    return values[-1]


@pytest.mark.parametrize("step", [0, 1, 2999, 3000, 3001, 8999, 9000, 30000])
def test_inception_exponential(step):
    cfg = make_config(recipe="inception_v3")
    sched = LRSchedule(cfg, steps_per_epoch=100, global_batch=256)
    assert sched.at(step) == pytest.approx(tf_exponential_decay(0.1, step, 3000, 0.16), rel=1e-12)


@pytest.mark.parametrize("step", [0, 2999, 3000, 3001, 5999, 6000, 6001, 8000, 8999, 9000, 9001, 12000])
def test_resnet_v15_piecewise_with_batch_scaling(step):
    # The ResNet seed's own schedule (no scaling, its float batches per epoch) is in
    # tests/test_resnet_seed_recipe.py.
    cfg = make_config(recipe="resnet101_v1.5")
    sched = LRSchedule(cfg, steps_per_epoch=100, global_batch=128)
    lr0 = 0.1 * 128 / 256
    values = [lr0, lr0 * 0.1, lr0 * 0.01, lr0 * 1e-3, lr0 * 1e-4]
    assert sched.at(step) == pytest.approx(tf_piecewise_constant(step, [3000, 6000, 8000, 9000], values))


@pytest.mark.parametrize("recipe", ["inception_v3", "resnet50", "resnet50_v1.5", "demo"])
def test_device_schedule_equals_host(recipe):
    sched = LRSchedule(make_config(recipe=recipe), steps_per_epoch=37, global_batch=96)
    step = torch.zeros((), dtype=torch.int64)
    out = torch.zeros(())
    for k in [0, 1, 36, 37, 1109, 1110, 2220, 3330, 5000]:
        step.fill_(k)
        sched.on_device(step, out)
        # out is float32: equal to the float64 host value up to fp32 rounding
        assert out.item() == pytest.approx(sched.at(k), rel=6e-8)
