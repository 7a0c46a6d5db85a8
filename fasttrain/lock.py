"""One trainer per run directory: rank 0 holds a POSIX record lock on `<train_dir>/run.lock`.

Two trainers on one --train_dir interleave their checkpoints (one run's ckpt-N beside the other's,
each pruning the other's files: one died with FileNotFoundError). The second one now stops at once,
naming the holder's pid and host, which the holder writes into the file.

Why an fcntl (POSIX) lock and not a pid file or flock:
- the kernel drops it when the holding process dies, however it dies (SIGKILL, OOM), so a crashed
  run leaves no stale lock to clear by hand; the file that stays behind is only a record;
- it is owned by the process, not inherited by forked children: after a SIGKILL of the trainer, its
  DataLoader workers live on for up to 5 s (torch's parent watchdog), and an inherited flock would
  stop a torchrun restart of the same job during that time;
- it works across the nodes of a shared file system where the NFS client supports locking (NFSv4,
  or NFSv3 with lockd); flock there is either node-local or emulated with fcntl locks anyway.
Only rank 0 takes it, so the other ranks of the same job are never stopped by it; a torchrun restart
starts after the agent has reaped the old workers, whose locks died with them.

A POSIX lock is released when its process closes ANY descriptor of the file: nothing else in the
trainer opens run.lock, and the holder reads and writes it only through the locking descriptor.

The run's identity, `<train_dir>/run.json`: `{"run_id": "<32 hex digits, random>", "created": "...",
"started_from": "<checkpoint_dir or null>"}`, written once by rank 0 when a run has restored (or
started) in the directory, beside config.json; a resume keeps it, a refused resume writes nothing, and
a directory from before run.json gets one at its next resume. The
evaluator compares it with the run.json beside a checkpoint it is given: a checkpoint of another run
is evaluated without touching this run's metrics.jsonl and curves (fasttrain/evaluate.py).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import uuid
from pathlib import Path

from fasttrain import checkpoint as ckpt
from fasttrain.errors import SettingError

LOCK_NAME = "run.lock"
IDENTITY_NAME = "run.json"


def claim_run_dir(run_dir: Path, log=print) -> RunLock:
    """Create and lock run_dir, check it can be written, and delete temporary files of saves that a
    dead trainer never finished; SettingError (one line) if it cannot be written or is in use."""
    if run_dir.exists() and not run_dir.is_dir():  # mkdir's words for it: "File exists"
        raise SettingError(
            f"train_dir {run_dir} is a file, not a directory; pass a directory", settings=("train_dir",)
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"  # fail now, not at the first checkpoint
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise SettingError(
            f"train_dir {run_dir} cannot be written ({exc.strerror}); pass a writable directory",
            settings=("train_dir",),
        ) from None
    lock = RunLock.acquire(run_dir, log)
    if removed := ckpt.remove_temporaries(run_dir):  # only now: a live trainer's save would lose them
        log(f"removed {', '.join(removed)}: partial files of a save that did not finish")
    return lock


class RunLock:
    """The lock on a run directory, held from acquire() until release() or the process's end."""

    def __init__(self, fd: int | None, path: Path):
        self._fd, self.path = fd, path

    @classmethod
    def acquire(cls, run_dir: Path, log=print) -> RunLock:
        """Lock run_dir, or raise SettingError naming the trainer that holds it.

        A file system without lock support gets a note and an unlocked run, not a refusal: the
        trainer still works there, only two of them on one directory are not caught.
        """
        path = Path(run_dir) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's record stays
        except OSError as exc:
            raise SettingError(
                f"cannot open {path} ({exc.strerror}); pass another train_dir", settings=("train_dir",)
            ) from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):  # e.g. ENOLCK: no lock daemon on NFS
                os.close(fd)
                log(
                    f"note: cannot lock {path} ({exc.strerror}); nothing stops a second trainer "
                    "from using this --train_dir at the same time"
                )
                return cls(None, path)
            holder = _read_record(fd)
            os.close(fd)
            raise SettingError(
                f"train_dir {run_dir} is in use by another trainer ({_describe(holder)}, per "
                f"{path}); wait for it to end or stop it, or pass another train_dir",
                settings=("train_dir",),
            ) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except OSError:  # a full disk: the lock holds all the same, a refused trainer names no pid
            pass
        return cls(fd, path)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_record(fd: int) -> dict:
    text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _describe(holder: dict) -> str:
    if "pid" not in holder:  # the holder has locked the file but not yet written its record
        return "pid and host not yet recorded"
    since = f", since {holder['started']}" if holder.get("started") else ""
    return f"pid {holder['pid']} on host {holder.get('host', '?')}{since}"


def read_identity(run_dir: Path) -> dict | None:
    """run_dir/run.json as a dict; None when there is none (not a run, or one from before run.json)."""
    try:
        record = json.loads((Path(run_dir) / IDENTITY_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_run_id(run_dir: Path) -> str | None:
    """The run_id in run_dir/run.json; None when there is none (not a run, or one from before run.json)."""
    run_id = (read_identity(run_dir) or {}).get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def ensure_run_id(run_dir: Path, started_from: str = "", log=print) -> str:
    """run_dir's run_id, written to a new run.json first if it has none (by the lock's holder only);
    OSError when it cannot be written. A run.json that holds no run_id (damaged, or edited) is kept
    beside as run.json.unreadable, with a note, before the new one replaces it."""
    if (run_id := read_run_id(run_dir)) is not None:
        return run_id
    path = Path(run_dir) / IDENTITY_NAME
    if path.is_file():
        path.read_bytes()  # an OSError (EACCES, EIO) is not a damaged file: raised, the file left as it is
        aside = next(
            p
            for k in range(1, 10_000)
            if not (
                p := path.with_name(IDENTITY_NAME + (".unreadable" if k == 1 else f".unreadable-{k}"))
            ).exists()
        )
        os.replace(path, aside)
        log(
            f"note: {path} holds no run_id (damaged or edited): kept as {aside.name}; this run gets a new "
            "run_id, so checkpoints written before it name the old one (or none)"
        )
    run_id = uuid.uuid4().hex
    record = {
        "run_id": run_id,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "started_from": str(started_from) or None,
    }
    text = json.dumps(record) + "\n"
    ckpt.write_atomic(Path(run_dir) / IDENTITY_NAME, lambda f: f.write(text.encode()))
    return run_id


def same_run(run_dir: Path, checkpoint: Path) -> bool:
    """Whether `checkpoint` belongs to the run in run_dir: it lies in run_dir, or beside a run.json with
    the same run_id (a copy of the run's directory)."""
    return checkpoint_run(run_dir, checkpoint, None)[0] is True


def checkpoint_run(run_dir: Path, checkpoint: Path, written_by: str | None) -> tuple[bool | None, str]:
    """Whether `checkpoint` belongs to the run in run_dir, and the evidence, in words: True when it lies in
    run_dir; else as the run.json beside it (the identity of the run directory it is in, as a resume
    takes it), or without one the run_id it was written with (`written_by`, its "run_id"), says against
    run_dir's run.json; None when nothing tells (a TensorFlow checkpoint, a from-tf file, a checkpoint
    from before run identities, a run without run.json)."""
    home = Path(checkpoint).resolve().parent
    if home == Path(run_dir).resolve():
        return True, f"it is in {run_dir}"
    own = read_run_id(run_dir)
    if own is None:
        return None, f"it is not in {run_dir}, which has no run.json to compare run_ids with"
    beside = read_run_id(home)
    if beside is not None:
        if beside == own:
            return True, f"{home / IDENTITY_NAME} is {run_dir}'s run ({own[:8]})"
        return False, f"{home / IDENTITY_NAME} is run {beside[:8]}; {run_dir}'s is run {own[:8]}"
    if written_by:
        if written_by == own:
            return True, f"it was written by {run_dir}'s run ({own[:8]})"
        return False, f"it was written by run {written_by[:8]}; {run_dir}'s run.json is run {own[:8]}"
    return None, f"it is not in {run_dir} and names no run: no run_id in it, no run.json beside it"
