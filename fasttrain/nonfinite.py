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
    is_main: bool = True,
) -> None:
    """Stop on non-finite losses. Without loss scaling: at the first log row after any skipped step
    (`skipped` of steps first..step; the seed asserts at every step); a streak counted only at the row's
    own step let a single non-finite step between rows pass. With it: after a streak of skips."""
    fp32 = " or use precision=fp32" if precision.name != "fp32" else ""  # not to fp32 runs (it was)
    if precision.loss_scaling:
        if streak < cfg.max_nonfinite_steps:
            return
        when = f"for the last {streak} step(s) at step {step}"
        # The skips left the weights as they were before the streak: every checkpoint holds good ones.
        kept = (
            f"; the last good checkpoint is {ckpt.checkpoint_path(run_dir, last_saved)}" if last_saved else ""
        )
        raise TrainingStopped(
            f"the loss was not finite {when} (updates were skipped, weights are unchanged){kept}; lower "
            f"initial_learning_rate{fp32}",
            settings=("initial_learning_rate", "precision"),
        )
    if skipped == 0:
        return
    when = f"at {skipped} of steps {first}-{step}" if first < step else f"at step {step}"
    # Which of steps first..step were not finite is not known here, nor what the finite ones among them
    # did (one step with a huge learning rate can blow the weights up and leave its loss finite): a
    # checkpoint written in them is set aside, and the same command resumes from the one before them,
    # where the last log row found every loss finite (it had called ckpt-4 good, weights of 3.5e19).
    saved = ckpt.list_checkpoints(run_dir) if is_main else []
    aside = _set_aside([path for s, path in saved if s >= first])
    before = [s for s, _ in saved if s < first]
    moved = f"; set aside, as *.nonfinite: {', '.join(aside)}" if aside else ""
    if not is_main:
        again = "rank 0's message says where the same command resumes"
    elif before:
        again = (
            f"the same command resumes from {ckpt.checkpoint_path(run_dir, max(before))}, written before them"
        )
    else:
        again = "no checkpoint was written before them: the same command starts again from step 0"
    raise TrainingStopped(
        f"the loss was not finite {when} (those updates were skipped){moved}; lower initial_learning_rate"
        f"{fp32}: {again}",
        settings=("initial_learning_rate", "precision"),
    )


def _set_aside(paths: list[Path]) -> list[str]:
    """Rename the checkpoints (and their .sha256) to *.nonfinite: kept, not resumed; their names."""
    for path in paths:
        for file in (path, path.with_name(path.name + ".sha256")):
            if file.exists():
                file.rename(file.with_name(file.name + ".nonfinite"))
    return [path.name for path in paths]
