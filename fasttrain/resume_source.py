"""Which checkpoint a run resumes from, decided on rank 0 and the same on every rank (fasttrain.resume
restores the run from it): whether there is one (has_checkpoint); where, and whether it is a fasttrain
or a TensorFlow run (_agreed_source: checkpoint_dir, or train_dir's own checkpoints once a run begun
from checkpoint_dir has saved there, else train_dir); and its newest usable checkpoint, loaded by every
rank from the file rank 0 chose (_load_agreed). Ranks deciding on their own (per-node storage, a cache
that does not show the newest file yet) could take different branches, and one would wait in a
collective the others never make.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fasttrain import checkpoint as ckpt
from fasttrain.config import Config
from fasttrain.dist_info import DistInfo
from fasttrain.distributed import first_rank_error, from_rank0
from fasttrain.lock import read_identity
from fasttrain.tf.checkpoint import is_tf_checkpoint


def _decided_by_rank0(
    decide: Callable[[], object],
    info: DistInfo,
    refused: Callable[[str], str],
    errors: tuple[type[Exception], ...] = (ckpt.CheckpointError,),
):
    """decide() run on rank 0 alone, its (picklable) result on every rank: ranks deciding on their own
    (per-node storage, a cache that does not show the newest file yet) could take different branches,
    and one would wait in a collective the others never make. When decide() raises one of `errors`,
    rank 0 raises it and every other rank a CheckpointError(refused(its message))."""
    value, error = None, None
    if info.is_main:
        try:
            value = decide()
        except errors as exc:
            error = exc
    if not info.distributed:
        if error is not None:
            raise error
        return value
    value, message = from_rank0((value, str(error or "")), info)
    if message:
        if error is not None:
            raise error
        raise ckpt.CheckpointError(refused(message))
    return value


def has_checkpoint(cfg: Config, run_dir: Path, info: DistInfo) -> bool:
    """Whether the run resumes (rank 0's answer on every rank: with per-node storage another rank's
    would differ, and it alone would start from the pretrained weights)."""

    def decide() -> bool:
        source = Path(cfg.checkpoint_dir or run_dir)
        try:
            return bool(ckpt.list_checkpoints(source)) or is_tf_checkpoint(source)
        except (ckpt.CheckpointError, OSError) as exc:
            raise ckpt.CheckpointError(str(exc)) from None

    return _decided_by_rank0(decide, info, lambda _: "stopping with rank 0, which cannot list them")


def _own_checkpoints(run_dir: Path, checkpoint_dir: Path, log: Callable[[str], None]) -> bool:
    """Whether a run begun from checkpoint_dir (a fasttrain or a TF run) goes on from run_dir's own
    checkpoints: it has saved since, and "run the same command again" must not go back to
    checkpoint_dir's (that redid every step since, dropped their metrics rows and overwrote their
    checkpoints). CheckpointError when run_dir's checkpoints are another run's (its run.json says it
    began elsewhere): continuing checkpoint_dir's run into it would mix two runs' files."""
    if _same_dir(run_dir, checkpoint_dir) or not ckpt.list_checkpoints(run_dir):
        return False
    identity = read_identity(run_dir)
    began = None if identity is None else identity.get("started_from")
    if identity is not None and not (isinstance(began, str) and _same_dir(Path(began), checkpoint_dir)):
        raise ckpt.CheckpointError(
            f"train_dir {run_dir} holds checkpoints of another run (its run.json says it began "
            f"{f'from {began}' if began else 'there'}), not of one begun from checkpoint_dir "
            f"{checkpoint_dir}: pass a new train_dir to continue that run, or move those checkpoints "
            "elsewhere",
            settings=("train_dir", "checkpoint_dir"),
        )
    log(f"{run_dir} holds this run's own checkpoints (it began from {checkpoint_dir}): going on from them")
    return True


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _newest_usable(cfg: Config, source: Path, log: Callable[[str], None]) -> tuple[dict, Path] | None:
    """source's newest usable checkpoint (None: start fresh); CheckpointError when some are there but
    none is usable."""
    # Loaded to the CPU: load_state_dict/copy_ put the values into this run's device tensors, and the
    # random-generator states must stay CPU byte tensors (torch.set_rng_state refuses CUDA ones).
    found = ckpt.load_latest(source, log=log, map_location="cpu")
    if found is None:
        if cfg.checkpoint_dir:
            raise ckpt.CheckpointError(
                f"checkpoint_dir {source} holds no usable ckpt-<step>.pt", settings=("checkpoint_dir",)
            )
        if unusable := [path.name for _, path in ckpt.list_checkpoints(source)]:
            # Starting over would spend the compute again and, in time, overwrite those files.
            raise ckpt.CheckpointError(
                f"{source} holds checkpoints but none is usable ({', '.join(unusable)}; reasons above); "
                "move them elsewhere, or pass another train_dir, to start this run over",
                settings=("train_dir",),
            )
    return found


def _source(cfg: Config, run_dir: Path, log: Callable[[str], None]) -> tuple[str, Path]:
    """('fasttrain' or 'tf', the directory to resume from), as rank 0 decides it."""
    source = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else run_dir
    if cfg.checkpoint_dir and _own_checkpoints(run_dir, source, log):
        return "fasttrain", run_dir
    if not ckpt.list_checkpoints(source) and is_tf_checkpoint(source):
        return "tf", source
    if cfg.checkpoint_dir and not source.is_dir():
        raise ckpt.CheckpointError(
            f"checkpoint_dir {source} is not a directory", settings=("checkpoint_dir",)
        )
    return "fasttrain", source


def _agreed_source(
    cfg: Config, run_dir: Path, info: DistInfo, log: Callable[[str], None]
) -> tuple[str, Path]:
    """_source as rank 0 decides it, on every rank."""

    def decide() -> tuple[str, str]:
        kind, source = _source(cfg, run_dir, log)
        return kind, str(source)

    kind, source = _decided_by_rank0(
        decide,
        info,
        lambda message: f"stopping with rank 0, which cannot resume: {message}",
        errors=(ckpt.CheckpointError, OSError),
    )
    return kind, Path(source)


def _load_agreed(
    cfg: Config, source: Path, info: DistInfo, log: Callable[[str], None], *, setting: str
) -> tuple[dict, Path] | None:
    """_newest_usable as rank 0 finds it, loaded by every rank from that same file. Each rank searching
    on its own let ranks resume from different steps, or one resume and another start fresh (per-node
    storage), and the job then hung at the end without an error."""
    found = None  # rank 0's checkpoint, loaded as it chose it

    def decide() -> tuple[str, int] | None:
        nonlocal found
        found = _newest_usable(cfg, source, log)
        return (str(found[1]), int(found[0]["step"])) if found is not None else None

    chosen = _decided_by_rank0(
        decide, info, lambda _: f"stopping with rank 0, which cannot resume from {source}"
    )
    if not info.distributed or chosen is None:
        return found
    path, step = Path(chosen[0]), chosen[1]
    problem = ""
    if not info.is_main:
        try:
            found = ckpt.load_checkpoint(path, map_location="cpu"), path
            if found[0]["step"] != step:
                problem = f"it holds step {found[0]['step']}, rank 0's holds step {step}"
        except ckpt.CheckpointError as exc:
            problem = str(exc)
    if failed := first_rank_error(problem, info):
        raise ckpt.CheckpointError(
            f"rank {failed[0]} cannot read {path} ({failed[1]}), the checkpoint rank 0 resumes from: "
            f"{setting} must be on storage every rank sees",
            settings=(setting,),
        )
    return found
