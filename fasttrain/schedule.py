"""The seeds' learning-rate schedules, on the host and on the device.

exponential (Inception seed, tf.train.exponential_decay with staircase=True):
    lr = lr0 * factor ** floor(step / decay_steps)
    decay_steps = int(batches_per_epoch * num_epochs_per_decay)
piecewise (ResNet seed, tf.train.piecewise_constant):
    lr = lr0 * factor ** (number of boundaries B with step > B),  B = int(batches_per_epoch * e)
         for e in lr_boundary_epochs
batches_per_epoch = epoch size / global batch, a float, as both seeds compute it (the ResNet seed's
imagenet_main.py: _NUM_IMAGES['train'] / (train_batch_size * num_workers), e.g. 1,281,167 / 128 =
10009.1171875, boundaries 300273, 600547, 800729, 900820; inception_train.py: num_examples_per_epoch()
/ batch_size). lr0 is --initial_learning_rate, times global_batch / 256 with --lr_batch_scaling (the
v1.5 recipes; the ResNet seed does not scale). `step` is the number of completed updates, TF's
global_step before apply_gradients increments it.

`on_device` computes the same value from a device step counter with tensor ops only, so a captured
CUDA graph sees the current LR on every replay without a host write.
"""

from __future__ import annotations

import math

import torch

from fasttrain.config import Config


class LRSchedule:
    def __init__(
        self, cfg: Config, steps_per_epoch: float, global_batch: int, device: torch.device | str = "cpu"
    ):
        """steps_per_epoch: batches_per_epoch above, epoch size / global batch, unrounded."""
        self.lr0 = cfg.initial_learning_rate * (global_batch / 256 if cfg.lr_batch_scaling else 1.0)
        self.factor = cfg.learning_rate_decay_factor
        self.kind = cfg.lr_schedule
        self.decay_steps = max(1, int(steps_per_epoch * cfg.num_epochs_per_decay))
        self.boundaries = [int(steps_per_epoch * e) for e in cfg.lr_boundary_epochs]
        # Made once here: creating tensors from host values is not allowed during graph capture.
        self._bounds = torch.tensor(self.boundaries or [2**62], dtype=torch.int64, device=device)
        self._factor = torch.tensor(self.factor, dtype=torch.float64, device=device)
        self.offset = 0.0  # added to the step (fasttrain/epoch_clock.py: a resume with another batch)

    def shift(self, offset: float) -> None:
        """From now on the schedule is read at step + offset (before the step's graph is captured)."""
        self.offset = float(offset)
        self._bounds_f64 = self._bounds.to(torch.float64)

    def at(self, step: int) -> float:
        """The LR for the update that follows `step` completed steps."""
        step = step + self.offset if self.offset else step
        if self.kind == "exponential":
            return self.lr0 * self.factor ** math.floor(step / self.decay_steps)
        return self.lr0 * self.factor ** sum(step > b for b in self.boundaries)

    def on_device(self, step: torch.Tensor, out: torch.Tensor) -> None:
        """Write the LR for device step counter `step` (0-d int64) into `out` (0-d float32), no sync."""
        if self.offset:  # in float64, as `at` computes it (a step count is exact there up to 2**53)
            shifted = step.to(torch.float64) + self.offset
            if self.kind == "exponential":
                exponent = torch.floor(shifted / self.decay_steps)
            else:
                exponent = (shifted > self._bounds_f64).sum().to(torch.float64)
        elif self.kind == "exponential":
            exponent = torch.div(step, self.decay_steps, rounding_mode="floor")
        else:
            exponent = (step > self._bounds).sum()
        out.copy_(self.lr0 * torch.pow(self._factor, exponent.to(torch.float64)))
