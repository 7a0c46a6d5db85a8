"""What a run's checkpoint holds, and how a run restores from it (fasttrain.checkpoint writes the files).

    run = build_run(...)                                       # fasttrain.run
    step = restore_run(cfg, run, run_dir=run_dir, log=log)     # 0 for a fresh run
    save_run(run_dir, step, run, cfg=cfg)                      # every rank calls it

A checkpoint is rank 0's model, optimizer (flat buffers by parameter), BN-statistics EMA, weight EMA
by name, the step's device state (step counter, loss scaler), every rank's data position and RNG
states, and the resolved config. A resume compares that config with this run's: settings that
change the model or optimizer make the load fail with the settings named; others (batch size, seed,
schedule, the number of ranks) are allowed and listed, since the run then no longer reproduces an
uninterrupted one. Which checkpoint a run resumes from, the same on every rank, is
fasttrain/resume_source.py's to decide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fasttrain import checkpoint as ckpt
from fasttrain.config import Config
from fasttrain.distributed import first_rank_error, rank0_error
from fasttrain.epoch_clock import EpochClock
from fasttrain.lock import read_run_id
from fasttrain.resume_source import _agreed_source, _load_agreed
from fasttrain.run_config import upgrade_saved_config

if TYPE_CHECKING:
    from fasttrain.run import Run

# Settings that only say where and how long to run, or how often to report: changing them between a
# run and its resume changes nothing in the numbers.
_BOOKKEEPING = {
    "train_dir", "checkpoint_dir", "data_dir", "data_cache_dir", "max_steps", "train_epochs", "log_every",
    "checkpoint_every", "keep_checkpoints", "eval_at_end", "max_eval_batches", "max_nonfinite_steps",
    "num_workers", "profile_comm", "num_gpus", "device", "pretrained_model_checkpoint_path", "fine_tune",
    "tensorboard", "histogram_every", "eval_every_epochs", "row_checkpoints", "fused_decode", "loader",
}  # fmt: skip
# Settings that decide the shapes and names of what a checkpoint holds: a change makes the load fail.
_STATE_SHAPING = {
    "model", "resnet_size", "base_channels", "num_classes", "optimizer", "ema_decay", "no_decay_bn_bias",
    "no_decay_bn", "sync_bn", "inception_bn_gamma",
}  # fmt: skip


def shaping_changes(changes: list[str]) -> list[str]:
    """Those of changed_settings' lines whose setting shapes the checkpoint (why a load failed)."""
    return [c for c in changes if c.split()[0] in _STATE_SHAPING]


def _load_error_text(exc: BaseException) -> str:
    """A state that does not load, in one line: torch's lines (which keys are missing, unexpected or of
    another size) joined, at most 300 characters."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def save_config(cfg: Config, run_dir: Path) -> None:
    """Write run_dir/config.json whole or not at all."""
    ckpt.write_atomic(run_dir / "config.json", lambda f: f.write((cfg.to_json() + "\n").encode()))


def changed_settings(saved: dict | None, cfg: Config) -> list[str]:
    """'name saved -> now' for each setting of `cfg` that differs from the checkpoint's config."""
    if not saved:
        return []
    saved, now = upgrade_saved_config(saved), dataclasses.asdict(cfg)
    return [
        f"{k} {saved[k]!r} -> {now[k]!r}"
        for k in sorted(now)
        if k not in _BOOKKEEPING and k in saved and saved[k] != now[k]
    ]


def restore_run(
    cfg: Config, run: Run, *, run_dir: Path, log: Callable[[str], None], epoch_size: int = 0
) -> int:
    """Resume `run` from the newest usable checkpoint (run_dir's, or checkpoint_dir's); the step it
    continues from (0 when there is none). A checkpoint_dir of a TF run (its `checkpoint` file, or a
    prefix) continues that run (fasttrain.tf.state.load_run), until run_dir holds checkpoints of its own;
    so does a run_dir that holds a TF run and no fasttrain checkpoint (the ResNet seed's command run
    again on its --output_dir: its Estimator restores the newest checkpoint there)."""
    kind, source = _agreed_source(cfg, run_dir, run.info, log)
    if kind == "tf":
        return _load_tf_run(cfg, run, source, run_dir, log)
    found = _load_agreed(
        cfg, source, run.info, log, setting="train_dir" if source == run_dir else "checkpoint_dir"
    )
    if found is None:
        return 0
    state, path = found
    world_size = run.info.world_size
    changes = changed_settings(state.get("config"), cfg)
    if (saved_world := state.get("world_size", world_size)) != world_size:
        # Not a flag, so not in the config: the global batch, the steps per epoch and what each rank
        # reads all change with it.
        saved = {**dataclasses.asdict(cfg), **(state.get("config") or {})}
        was = saved["batch_size"] * saved["grad_accum_steps"] * saved_world
        now = cfg.batch_size * cfg.grad_accum_steps * world_size
        changes.append(f"world size {saved_world} -> {world_size} (global batch {was} -> {now})")
    if (saved_size := state.get("epoch_size")) and epoch_size and saved_size != epoch_size:
        # Other data (--data_dir is bookkeeping when the records are the same): the epoch position and
        # every schedule counted in epochs now follow the new set, which a resume said nothing about.
        changes.append(f"training records per epoch {saved_size} -> {epoch_size} (other data)")
    try:
        run.load_state_dict(state)
    except (KeyError, RuntimeError, ValueError) as exc:
        # A changed setting that shapes the state is the likely cause; another (a learning rate, a seed)
        # cannot be, and naming it sent users to revert the wrong flag: then the load's own words.
        reason = "; ".join(shaping_changes(changes)) or _load_error_text(exc)
        if source != run_dir:
            # Another directory's run, continued into train_dir: a new train_dir would not help.
            config = source / "config.json"
            raise ckpt.CheckpointError(
                f"{path} does not fit this run's model/optimizer ({reason}): continue it with the settings "
                f"it was written with{f' ({config})' if config.is_file() else ''}, or start from its weights "
                "alone with pretrained_model_checkpoint_path instead of checkpoint_dir",
                settings=("checkpoint_dir", "pretrained_model_checkpoint_path"),
            ) from None
        raise ckpt.CheckpointError(
            f"{path} does not fit this run's model/optimizer ({reason}): run with the settings it was "
            "written with, or pass a new train_dir",
            settings=("train_dir",),
        ) from None
    global_batch = cfg.batch_size * cfg.grad_accum_steps * world_size
    run.epoch_clock = EpochClock.after_resume(state, int(state["step"]), global_batch, epoch_size)
    try:
        data, moved = _data_position(state, cfg, world_size, run.loader)
        run.load_rank_state(data, state.get("rng", []))
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        # A checkpoint fasttrain's trainer did not write (its weights are usable, its position is not).
        what = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        raise ckpt.CheckpointError(
            f"{path} holds no usable data position to resume from ('data': {what}); start from its "
            "weights alone with pretrained_model_checkpoint_path, in a new train_dir",
            settings=("pretrained_model_checkpoint_path", "train_dir"),
        ) from None
    log(f"resuming from step {state['step']} ({path})")
    if (written_by := state.get("run_id")) and written_by != (own := read_run_id(run_dir)) and own:
        # A checkpoint copied in from another run (its run.json differs): continued, but said.
        log(
            f"note: {path.name} was written by run {written_by[:8]}, not by the run in {run_dir} "
            f"(run.json: {own[:8]}); continuing it as {run_dir}'s run"
        )
    if changes:
        log(f"note: settings changed since that checkpoint: {', '.join(changes)}")
    if moved:
        log(moved)
    return int(state["step"])


def _data_position(state: dict, cfg: Config, world_size: int, loader) -> tuple[list[dict], str]:
    """The checkpoint's per-rank data positions as this run's loaders count them, and a note when they
    had to be moved. A position counts a rank's batches: with another world size or batch size, rank 0's
    count unchanged resumed at another number of records (2 ranks of 4 for 6 steps, then 4 ranks: epoch
    0 ended after 48 of its 100). This run goes on after as many records as the checkpoint had read,
    rounded down to its global batch (those up to one global batch are read again), or at the next
    epoch when fewer than one global batch is left."""
    data, saved_world = state["data"], state.get("world_size", world_size)
    saved_batch = (state.get("config") or {}).get("batch_size", cfg.batch_size)
    if saved_world == world_size and saved_batch == cfg.batch_size:
        return data, ""
    batches = len(loader)  # this run's batches per epoch and rank
    epoch, batch = int(data[0]["epoch"]), int(data[0]["batch"])
    consumed = batch * saved_batch * saved_world  # records of epoch `epoch`, all ranks together
    step_records = cfg.batch_size * world_size * cfg.grad_accum_steps
    steps = min(consumed // step_records, batches // cfg.grad_accum_steps)
    position = {"epoch": epoch, "batch": steps * cfg.grad_accum_steps, "skipped": 0}
    skipped = sum(int(d.get("skipped", 0)) for d in data)  # the run's count: rank 0 carries it on
    again = consumed - steps * step_records
    if position["batch"] + cfg.grad_accum_steps > batches:  # not one more step of this epoch
        position, again = {**position, "epoch": epoch + 1, "batch": 0}, 0
    again_text = f" (its last {again} are read again)" if again else ""
    where = (
        f"epoch {epoch + 1} from its start (fewer than one global batch of epoch {epoch} was left)"
        if position["epoch"] > epoch
        else f"epoch {epoch} at record {consumed - again}{again_text}"
    )
    # rank_slices: each rank reads its own slice of the epoch, and the slices change with the world size.
    slices = (
        ", by count (input_order rank_slices: not the same records)"
        if cfg.input_order == "rank_slices"
        else ""
    )
    return [{**position, "skipped": skipped}] + [position] * (world_size - 1), (
        f"note: data position: the checkpoint had read {consumed} records of epoch {epoch} ({batch} batches "
        f"of {saved_batch} on each of {saved_world} ranks); this run goes on in {where}{slices}"
    )


def _load_tf_run(cfg: Config, run: Run, source: Path, run_dir: Path, log: Callable[[str], None]) -> int:
    """Continue the TF run in `source` (fasttrain.tf.state.load_run) on every rank; all stop together
    when any cannot read it."""
    from fasttrain.tf.checkpoint import open_checkpoint
    from fasttrain.tf.state import load_run

    if source == run_dir:  # the same command again on a TF run's directory: its Estimator restores it
        log(f"train_dir {run_dir} holds a TensorFlow run (its checkpoint file), no fasttrain checkpoint")
    step, error = 0, None
    try:
        step = load_run(open_checkpoint(source), cfg, run, log)
    except ckpt.CheckpointError as exc:
        error = exc
    if failed := first_rank_error(str(error or ""), run.info):
        if error is not None:
            raise error
        raise ckpt.CheckpointError(f"stopping with rank {failed[0]}, which cannot read {source}: {failed[1]}")
    return step


def save_run(
    run_dir: Path, step: int, run: Run, *, cfg: Config, total_steps: int = 0, epoch_size: int = 0
) -> None:
    """Write run_dir/ckpt-<step>.pt: every rank contributes its data position and RNG state, rank 0
    writes the file (and keeps cfg.keep_checkpoints of them). total_steps: the step the run ends at
    (what `fasttrain.evaluate --watch` waits for, also where --train_epochs sets it)."""
    info = run.info
    per_rank = run.rank_state()
    gathered = [per_rank] * info.world_size
    if info.world_size > 1:
        torch.distributed.all_gather_object(gathered, per_rank)
    error = ""
    if info.is_main:
        state = {
            **run.state_dict(),
            "step": step,
            "data": [g["data"] for g in gathered],
            "rng": [g["rng"] for g in gathered],
            "config": dataclasses.asdict(cfg),
            "world_size": info.world_size,
            "total_steps": total_steps,
            "epoch_size": epoch_size,  # the training records an epoch holds (a resume compares them)
            "run_id": read_run_id(run_dir),  # the run.json identity (fasttrain/lock.py), or None
        }
        try:
            ckpt.save_checkpoint(run_dir, step, state, keep=cfg.keep_checkpoints)
        except ckpt.CheckpointError as exc:  # disk full, EIO, read-only: the message names what is left
            error = str(exc)
    if error := rank0_error(error, info):
        raise ckpt.CheckpointError(error if info.is_main else "stopping with rank 0, which could not save")
