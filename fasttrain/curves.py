"""TensorBoard event files in the run directory, written by rank 0 through torch.utils.tensorboard.

Scalars are written where the trainer already holds host values (its log steps and evaluations), so
the writer adds no host sync; histograms (off by default) copy every parameter and gradient to the
host and are written only at log steps. Steps are optimizer steps.

A resumed run restarts at its checkpoint's step S while the run it resumes may have logged past S
before it died: the new writer records purge_step S + 1, and TensorBoard's readers then drop every
point at or after S + 1 from the older event files, so each curve holds every step once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fasttrain.errors import SettingError


class Curves:
    """A SummaryWriter on run_dir, or nothing at all (disabled, or not rank 0)."""

    def __init__(self, run_dir: Path, enabled: bool, start_step: int | None = 0):
        """start_step: the optimizer step the writer's first point follows (a trainer's start or resume
        step), whose later points in older files are dropped; None drops nothing (the evaluator)."""
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise SettingError(
                "tensorboard needs TensorBoard's package: pip install tensorboard, or pass tensorboard=false",
                settings=("tensorboard",),
            ) from None
        # purge_step also for a fresh start (S = 0): event files of a run killed before its first
        # checkpoint hold points this run writes again.
        self.writer = SummaryWriter(str(run_dir), purge_step=None if start_step is None else start_step + 1)

    def scalars(self, step: int, values: dict) -> None:
        """values: {tag: float}; None values are left out."""
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def histograms(self, step: int, model: torch.nn.Module, grad_scale: float) -> None:
        """Every parameter and its gradient (times grad_scale, which undoes the loss scale and the sum
        over ranks). note: a host copy of the whole model, every --histogram_every steps only."""
        if self.writer is None:
            return
        for name, p in model.named_parameters():
            self.writer.add_histogram(f"weights/{name}", p.detach().float().cpu(), step)
            if p.grad is not None:
                self.writer.add_histogram(f"gradients/{name}", p.grad.float().cpu() * grad_scale, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
