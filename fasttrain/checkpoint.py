"""Crash-safe checkpoints: atomic writes, a checksum per file, keep-last-K, safe loading.

A checkpoint is `<dir>/ckpt-<step>.pt`, a dict loadable with `torch.load(path, weights_only=True)`
(at least `model`, `step`, `optimizer`, `ema`), with its SHA-256 in `ckpt-<step>.pt.sha256`.

Write order, so that a crash at any point leaves the previous checkpoints untouched and never a file
named ckpt-N.pt that is not complete:
  1. torch.save to `.ckpt-<step>.pt.tmp` in the same directory, flush, fsync;
  2. the checksum sidecar, written the same way and renamed into place;
  3. rename the data file to `ckpt-<step>.pt` (atomic on POSIX), fsync the directory;
  4. delete checkpoints beyond the newest K (numeric order, not lexical).
Loading only ever uses weights_only=True: a pickle that would run code is refused, not run.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: printed in one line."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step}.pt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ckpt-<step>.pt in directory, oldest first (numeric order)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), directory / name) for name in os.listdir(directory) if (m := _NAME.match(name))
    ]
    return sorted(found)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable) -> None:
    """Write path whole or not at all: write(f) fills a temporary file, fsynced, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_checkpoint(directory: Path, step: int, state: dict, keep: int = 3) -> Path:
    """Write state as ckpt-<step>.pt atomically (see the module docstring); returns its path.

    On any failure (disk full, a signal, a crash of this process) the checkpoints already in the
    directory stay as they were; the partial temporary file is removed when Python still can.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    tmp = final.with_name(f".{final.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        digest = _sha256(tmp)
        write_atomic(
            final.with_name(final.name + ".sha256"), lambda f: f.write(f"{digest}  {final.name}\n".encode())
        )
        os.replace(tmp, final)
        _fsync_dir(directory)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The oldest beyond `keep`, counting only checkpoints up to this step: newer ones (left by a run
    # this one did not resume from, e.g. a corrupt newest it fell back past) are never deleted.
    for _, old in [(s, p) for s, p in list_checkpoints(directory) if s <= step][:-keep]:
        old.unlink(missing_ok=True)
        old.with_name(old.name + ".sha256").unlink(missing_ok=True)
    return final


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError if the file does not match its recorded checksum."""
    sidecar = path.with_name(path.name + ".sha256")
    if not sidecar.exists():
        return  # A checkpoint copied without its sidecar: loading still checks its structure.
    expected = sidecar.read_text(encoding="utf-8").split()[0]
    if _sha256(path) != expected:
        raise CheckpointError(f"checkpoint {path} does not match its checksum (truncated or corrupt)")


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    """Load a checkpoint safely (weights_only) after checking its checksum; CheckpointError if unusable."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory; name a ckpt-<step>.pt file")
    verify_checkpoint(path)
    try:
        with warnings.catch_warnings():
            # torch warns about a pickle protocol it may not parse; the refusal below says it better.
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every failure mode means the same to the user
        text = str(exc)
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        if "Unsupported global" in text:  # a pickled object naming code (a class or function)
            raise CheckpointError(
                f"refusing to load {path}: it holds Python objects that would run "
                f"code when unpickled (only tensors and plain data are accepted)"
            ) from None
        if "WeightsUnpickler error:" in text:  # torch's own first line is advice about weights_only
            detail = text.split("WeightsUnpickler error:")[1].strip().splitlines()[0]
            raise CheckpointError(
                f"refusing to load {path}: it is not a checkpoint of tensors and plain data, or it is "
                f"corrupt (torch's safe loader stopped at: {detail})"
            ) from None
        raise CheckpointError(f"cannot read checkpoint {path}: {first}") from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"{path} is not a fasttrain checkpoint (no 'model' and 'step' entries)")
    return state


def load_latest(
    directory: Path, log: Callable[[str], None] = print, map_location="cpu"
) -> tuple[dict, Path] | None:
    """The newest usable checkpoint in directory, falling back past corrupt ones (each reported)."""
    for _, path in reversed(list_checkpoints(directory)):
        try:
            return load_checkpoint(path, map_location), path
        except CheckpointError as err:
            log(f"warning: {err}; trying the previous checkpoint")
    return None
