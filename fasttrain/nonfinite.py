"""The run's stop on non-finite losses: TrainingStopped, and check_finite, which the training loop
(fasttrain/train.py) calls at each log row with the device-side counts it has just read."""

from __future__ import annotations

from pathlib import Path

from fasttrain import checkpoint as ckpt
from fasttrain.config import Config
from fasttrain.errors import FasttrainError
from fasttrain.precision import Precision


class TrainingStopped(FasttrainError, RuntimeError):
    """The run cannot continue (non-finite loss): printed in one line, exit code 1."""


def check_finite(
    streak: int,
    skipped: int,
    first: int,
    step: int,
    cfg: Config,
    precision: Precision,
    last_saved: int,
    run_dir: Path,
) -> None:
    """Stop on non-finite losses. Without loss scaling: at the first log row after any skipped step
    (`skipped` of steps first..step; the seed asserts at every step); a streak counted only at the row's
    own step let a single non-finite step between rows pass. With it: after a streak of skips."""
    if precision.loss_scaling:
        if streak < cfg.max_nonfinite_steps:
            return
        when = f"for the last {streak} step(s) at step {step}"
    else:
        if skipped == 0:
            return
        when = f"at {skipped} of steps {first}-{step}" if first < step else f"at step {step}"
    kept = f"; the last good checkpoint is {ckpt.checkpoint_path(run_dir, last_saved)}" if last_saved else ""
    # fp32 is the advice only where the run is not fp32 already (it said so to fp32 runs too).
    fp32 = " or use precision=fp32" if precision.name != "fp32" else ""
    raise TrainingStopped(
        f"the loss was not finite {when} "
        f"(updates were skipped, weights are unchanged){kept}; lower initial_learning_rate{fp32}",
        settings=("initial_learning_rate", "precision"),
    )
