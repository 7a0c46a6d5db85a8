"""Epochs of data across a change of the global batch, for what is set in epochs.

`--train_epochs`, the LR schedule (`--num_epochs_per_decay`, `--lr_boundary_epochs`) and
`--eval_every_epochs` become step counts at the start of a run: epochs x steps per epoch, steps per
epoch = epoch size / global batch, as the seeds compute them. A run resumed with another global batch
(other ranks after a preemption, another --batch_size or --grad_accum_steps) kept the step counter and
recomputed the steps per epoch, so every epoch-set quantity moved: a 1-epoch run whose batch halved
at step 31 read 1.19 epochs, and its LR decays fell at other records than asked. The data position
is carried over in records (fasttrain/resume.py `_data_position`); this carries the epochs.

The clock holds the step from which the current global batch has been used and the epochs of data
read by then. A run that never changed its batch has the zero clock, and everything is computed
exactly as before. After a change, each quantity is counted in steps of the new batch as if it had
been used from the start: a step `s` stands for the virtual step `s + offset`, where `offset` makes
the virtual step at the change equal to the epochs read times the new steps per epoch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EpochClock:
    step: int = 0  # from this step on the run's global batch is the current one
    epochs: float = 0.0  # epochs of data read by that step

    def epochs_at(self, step: int, global_batch: int, epoch_size: int) -> float:
        return self.epochs + (step - self.step) * global_batch / epoch_size

    def lr_offset(self, steps_per_epoch: float) -> float:
        """Added to the step the LR schedule sees (its steps per epoch: unrounded, as the seeds')."""
        return self.epochs * steps_per_epoch - self.step

    def step_offset(self, steps_per_epoch: int) -> int:
        """Added to the step for --train_epochs and --eval_every_epochs (whole steps per epoch)."""
        return round(self.epochs * steps_per_epoch) - self.step

    def apply(self, cfg, step: int, schedule, epoch_size: int, global_batch: int) -> tuple[int, int, str]:
        """For a run at `step`: (the step offset for --eval_every_epochs, max_steps, a note when this
        resume changed the batch); the LR schedule shifted. The zero clock changes nothing."""
        steps_per_epoch = max(1, epoch_size // global_batch)  # as the trainer computes them
        max_steps = cfg.max_steps or math.ceil(cfg.train_epochs * steps_per_epoch)
        if not self.step:
            return 0, max_steps, ""
        offset = self.step_offset(steps_per_epoch)
        max_steps = cfg.max_steps or max_steps - offset
        schedule.shift(self.lr_offset(epoch_size / global_batch))
        note = ""
        if self.step == step:  # changed by this resume (a later one keeps the clock, and says nothing)
            note = (
                f"note: the global batch is {global_batch} from step {step} on, after {self.epochs:.4g} "
                "epochs: what is set in epochs (train_epochs, the LR schedule, eval_every_epochs) goes on "
                f"in epochs of data; this run ends at step {max_steps}"
            )
        return offset, max_steps, note

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def after_resume(cls, state: dict, step: int, global_batch: int, epoch_size: int) -> EpochClock:
        """The clock for a run resumed at `step` from a checkpoint's `state` with `global_batch`."""
        saved = cls(**state.get("epoch_clock", {}))
        config, world = state.get("config") or {}, state.get("world_size", 1)
        saved_batch = config.get("batch_size", 0) * config.get("grad_accum_steps", 1) * world
        if not saved_batch or saved_batch == global_batch:
            return saved
        saved_size = state.get("epoch_size") or epoch_size  # the epochs read so far, of their data
        if not saved_size:
            return saved
        return cls(step=step, epochs=saved.epochs_at(step, saved_batch, saved_size))
