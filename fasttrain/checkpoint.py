"""Crash-safe checkpoints: atomic writes, a checksum per file, keep-last-K, safe loading.

A checkpoint is `<dir>/ckpt-<step>.pt`, a dict loadable with `torch.load(path, weights_only=True)`
(at least `model`, `step`, `optimizer`, `ema`), with its SHA-256 in `ckpt-<step>.pt.sha256`.

Write order, so that a crash at any point leaves the previous checkpoints untouched and never a file
named ckpt-N.pt that is not complete:
  1. torch.save to `.ckpt-<step>.pt.tmp` in the same directory, flush, fsync;
  2. the checksum sidecar, written the same way and renamed into place;
  3. rename the data file to `ckpt-<step>.pt` (atomic on POSIX), fsync the directory;
  4. delete checkpoints beyond the newest K (numeric order, not lexical).
A write that fails (disk full ENOSPC, a file size limit EFBIG, EIO, a read-only file system EROFS)
removes what it started and raises CheckpointError in one line naming the newest checkpoint left; a
temporary file that cannot be removed (read-only) is never picked by a resume and is removed by the
next run (`remove_temporaries`).
Loading only ever uses weights_only=True: a pickle that would run code is refused, not run, and no
message repeats torch's advice to retry with weights_only=False.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from fasttrain.errors import FasttrainError

_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_TEMPORARY = re.compile(r"^\.ckpt-\d+\.pt(\.sha256)?\.tmp$")


class CheckpointError(FasttrainError, RuntimeError):
    """A checkpoint that cannot be used or written: printed in one line."""


class CheckpointUnreadable(CheckpointError):
    """A checkpoint the file system will not read (permissions, I/O error): maybe a good file, so a
    resume stops instead of falling back to an older one and redoing the steps in between."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step}.pt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ckpt-<step>.pt in directory, oldest first (numeric order)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise CheckpointError(f"cannot list the checkpoints in {directory} ({exc.strerror})") from None
    return sorted((int(m.group(1)), directory / name) for name in names if (m := _NAME.match(name)))


def remove_temporaries(directory: Path) -> list[str]:
    """Delete the temporary files of saves that never finished; returns their names.

    Call only while holding the run directory's lock (fasttrain.lock): another trainer's save in
    progress would otherwise lose its file.
    """
    removed = []
    for name in os.listdir(directory) if Path(directory).is_dir() else []:
        if _TEMPORARY.match(name):
            with contextlib.suppress(FileNotFoundError):
                (Path(directory) / name).unlink()
                removed.append(name)
    return removed


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
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        named = getattr(exc, "filename", None)
        if isinstance(exc, OSError) and named is not None and os.fspath(named) == os.fspath(tmp):
            exc.filename = str(path)  # the file a user knows, not the temporary one, gone by now
        raise


def torch_save_to(f, obj) -> None:
    """torch.save(obj) into the open binary file f; a failed write raises its own OSError (a full
    disk: ENOSPC, EFBIG), where torch's zip writer would say "unexpected pos 704 vs 598"."""
    sink = _Sink(f)
    try:
        torch.save(obj, sink)
    except RuntimeError:
        if sink.error is None:
            raise
        raise sink.error from None


class _Sink:
    """The file torch.save writes to, keeping the first OSError: torch's zip writer replaces it with
    "unexpected pos 704 vs 598" (a disk-full save said nothing about the disk)."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(directory: Path, step: int, state: dict, keep: int = 3) -> Path:
    """Write state as ckpt-<step>.pt atomically (see the module docstring); returns its path.

    On any failure (disk full, a signal, a crash of this process) the checkpoints already in the
    directory stay as they were and the partial files are removed when the file system allows; an
    OSError becomes a CheckpointError naming the newest checkpoint left.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    tmp = final.with_name(f".{final.name}.tmp")
    sidecar = final.with_name(final.name + ".sha256")
    placed = []  # files put in place by this save, taken back if it fails before the data file lands
    renamed = False  # the data file is in place: only the directory's fsync is left
    try:
        with open(tmp, "wb") as f:
            torch_save_to(f, state)
            f.flush()
            os.fsync(f.fileno())
        digest = _sha256(tmp)
        write_atomic(sidecar, lambda f: f.write(f"{digest}  {final.name}\n".encode()))
        placed.append(sidecar)
        os.replace(tmp, final)
        renamed = True
        placed.clear()
        _fsync_dir(directory)
    except BaseException as exc:
        left = [p for p in (tmp, *placed) if not remove_file(p)]
        if isinstance(exc, OSError):
            # From the rename itself, not from what is on disk now: an earlier ckpt-<step>.pt (a resume
            # fell back past it) is there whether this save landed or not.
            raise CheckpointError(_write_failure(final, step, exc, left, renamed)) from None
        raise
    # The oldest beyond `keep`, counting only checkpoints up to this step: newer ones (left by a run
    # this one did not resume from, e.g. a corrupt newest it fell back past) are never deleted.
    for _, old in [(s, p) for s, p in list_checkpoints(directory) if s <= step][:-keep]:
        old.unlink(missing_ok=True)
        old.with_name(old.name + ".sha256").unlink(missing_ok=True)
    return final


def remove_file(path: Path) -> bool:
    """Delete path if it exists; False if it is still there (a read-only file system, EIO)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        return False
    return True


def os_error_text(exc: OSError) -> str:
    """'ENOSPC: No space left on device': the errno's name (what a user searches for) and its text."""
    code = f"{errno.errorcode[exc.errno]}: " if exc.errno in errno.errorcode else ""
    return f"{code}{exc.strerror or exc}"


def _write_failure(final: Path, step: int, exc: OSError, left: list[Path], landed: bool) -> str:
    """One line: what failed and why, which checkpoint a rerun resumes from, what is left over."""
    why = os_error_text(exc)
    if landed:
        return (
            f"checkpoint {final} was written but its directory could not be synced to disk ({why}); "
            "a crash now may lose it: check the file system"
        )
    try:
        # Before this step only: a file of this step or a newer one is one this run fell back past
        # (damaged), not a resume point (a run never saves the step it resumed from again).
        kept = [p for s, p in list_checkpoints(final.parent) if s < step]
    except CheckpointError:
        kept = []
    if kept:
        where = f"the newest checkpoint is {kept[-1]}, which a rerun of the same command resumes from"
    else:
        where = "no earlier checkpoint is there, so a rerun starts from step 0"
    stale = (
        f"; {', '.join(p.name for p in left)} could not be removed (a resume ignores it, the next run "
        "deletes it)"
        if left
        else ""
    )
    return f"cannot write checkpoint {final} ({why}); {where}{stale}; free space or fix the file system first"


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError if the file does not match its recorded checksum."""
    sidecar = path.with_name(path.name + ".sha256")
    try:
        if not sidecar.exists():
            return  # A checkpoint copied without its sidecar: loading still checks its structure.
        recorded = sidecar.read_text(encoding="utf-8", errors="replace").split()
        actual = _sha256(path)
    except OSError as exc:
        raise CheckpointUnreadable(_unreadable(path, exc)) from None
    if not recorded or not re.fullmatch(r"[0-9a-f]{64}", recorded[0]):
        raise CheckpointError(f"checksum file {sidecar} is empty or malformed, so {path} cannot be verified")
    if actual != recorded[0]:
        raise CheckpointError(f"checkpoint {path} does not match its checksum (truncated or corrupt)")


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    """Load a checkpoint safely (weights_only) after checking its checksum; CheckpointError if unusable."""
    state = load_tensors(path, map_location)
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"{path} is not a fasttrain checkpoint (no 'model' and 'step' entries)")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(
            f"{path} is not a fasttrain checkpoint: its 'step' is {step!r}, not a step number"
        )
    if not is_state_dict(state["model"]):
        raise CheckpointError(f"{path} holds no state_dict under 'model' (parameter names to tensors)")
    # The bookkeeping a resume reads before the tensors: of another kind, each ended in a traceback there.
    for key, kind, what in _BOOKKEEPING:
        value = state.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise CheckpointError(f"{path} is not a fasttrain checkpoint: its {key!r} is not {what}")
    config = state.get("config")
    if config is not None and not all(isinstance(k, str) for k in config):
        raise CheckpointError(f"{path} is not a fasttrain checkpoint: its 'config' keys are not all names")
    return state


# (entry, type, what it is) of what save_run writes beside the tensors; each may be absent (older files).
_BOOKKEEPING = (
    ("config", dict, "a table of settings"),
    ("world_size", int, "a number of ranks"),
    ("epoch_size", int, "a number of records"),
    ("total_steps", int, "a step number"),
    ("run_id", str, "a run identity"),
)


def is_state_dict(value) -> bool:
    """Whether `value` is a model's state_dict as a file holds it: parameter and buffer names to tensors."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    )


def load_tensors(path: Path, map_location="cpu"):
    """Whatever a torch.save file holds (a fasttrain checkpoint, a plain state_dict, ...), loaded as
    load_checkpoint loads it (checksum when a sidecar is there, weights_only); CheckpointError if unusable."""
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
    except OSError as exc:
        raise CheckpointUnreadable(_unreadable(path, exc)) from None
    except Exception as exc:  # noqa: BLE001 - every failure mode means the same to the user
        raise CheckpointError(_load_failure(path, str(exc))) from None
    return state


def _unreadable(path: Path, exc: OSError) -> str:
    return (
        f"cannot read {exc.filename or path} ({exc.strerror}); fix its permissions or the file system, "
        "or move the checkpoint away"
    )


def _load_failure(path: Path, text: str) -> str:
    """torch.load's failure as one line. torch's own message opens with advice to retry with
    weights_only=False, which would run whatever code the file names: none of its advice is passed on,
    only the reason, and only from the lines that carry one."""
    lowered = text.lower()
    if "unsupported global" in lowered:  # torch <= 2.5 "Unsupported global", 2.6+ "unsupported GLOBAL"
        return (
            f"refusing to load {path}: it holds Python objects that would run code when unpickled "
            "(only tensors and plain data are accepted)"
        )
    if "weights only load failed" in lowered or "weightsunpickler error" in lowered:
        detail = text.split("WeightsUnpickler error:")[1] if "WeightsUnpickler error:" in text else ""
        reason = next((ln.strip() for ln in detail.splitlines() if ln.strip()), "")
        stopped = f" (torch's safe loader stopped at: {reason})" if reason else ""
        return (
            f"refusing to load {path}: it is not a checkpoint of tensors and plain data, or it is "
            f"corrupt{stopped}"
        )
    if not _looks_like_torch_file(path):  # torch's own message is then a bare KeyError: "101"
        return f"{path} is not a torch checkpoint file (neither torch.save's zip archive nor a pickle)"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "weights_only" not in ln]
    return f"cannot read checkpoint {path}: {lines[0] if lines else 'not a readable torch file'}"


def _looks_like_torch_file(path: Path) -> bool:
    """Whether the file opens as torch.save writes: a zip archive (PK), or the legacy format's pickle
    (protocol 2 and up start with 0x80)."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError:
        return True  # let the reason torch gave stand
    return head == b"PK" or head[:1] == b"\x80"


def load_latest(
    directory: Path, log: Callable[[str], None] = print, map_location="cpu"
) -> tuple[dict, Path] | None:
    """The newest usable checkpoint in directory, falling back past corrupt ones (each reported).

    An unreadable one (CheckpointUnreadable) stops the search: it may be fine once readable, and
    falling back would silently redo the steps since the older checkpoint.
    """
    for _, path in reversed(list_checkpoints(directory)):
        try:
            return load_checkpoint(path, map_location), path
        except CheckpointUnreadable:
            raise
        except CheckpointError as err:
            log(f"warning: {err}; trying the previous checkpoint")
    return None
