"""What a run reports and listens to: the seeds' log line, metrics.jsonl, a progress bar, stop signals."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from pathlib import Path

from fasttrain.distributed import all_reduce_flag


def log_step(
    log, progress, step: int, loss: float, examples_per_sec: float, sec_per_batch: float, train_top1: float
) -> None:
    """The Inception seed's line, then the training top-1 of the batches since the previous line (the
    ResNet seed logs a running train_accuracy)."""
    line = (
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}: step {step}, loss = {loss:.2f} "
        f"({examples_per_sec:.1f} examples/sec; {sec_per_batch:.3f} sec/batch), train top-1 {train_top1:.3f}"
    )
    if progress.enabled:
        progress.write(line)
    else:
        log(line, flush=True)


def run_summary(steps: int, images: int, train_seconds: float, total_seconds: float) -> str:
    """'300 steps this run (9600 images) in 38.2 s, 251.3 images/s; 52.0 s with set-up and evaluation':
    the training loop's time (evaluations between steps left out, the first steps' warm-up and capture
    kept in), and the time since train() began (model, data and resume set-up, evaluations)."""
    rate = f", {images / max(train_seconds, 1e-9):.1f} images/s" if steps else ""
    plural = "" if steps == 1 else "s"
    return (
        f"{steps} step{plural} this run ({images} images) in {_duration(train_seconds)}{rate}; "
        f"{_duration(total_seconds)} with set-up and evaluation"
    )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 120:
        return f"{minutes} min {seconds - 60 * minutes:.0f} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


class MetricsLog:
    """JSON lines in the run directory, appended and flushed as they come."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled
        self._tail_checked = False
        self._failed = False  # the last write failed (said once, until one succeeds)

    def write(self, **record) -> None:
        if self.enabled:
            try:
                with self._locked():
                    if not self._tail_checked:
                        self._tail_checked = True
                        self._drop_torn_tail()
                    with open(self.path, "a", encoding="utf-8") as f:
                        f.write(json.dumps({"time": time.time(), **record}) + "\n")
            except OSError as exc:  # a full disk: the run goes on (its checkpoints say for themselves)
                if not self._failed:
                    sys.stderr.write(
                        f"fasttrain: note: cannot write {self.path} ({exc.strerror}); its rows are not kept "
                        "until it can be written again (the log lines above and below still show them)\n"
                    )
                self._failed = True
            else:
                self._failed = False

    def has_row(self, step: int, **fields) -> bool:
        """Whether the file holds a row of `step` with these fields (False when it cannot be read)."""
        try:
            lines = self.path.read_bytes().splitlines()
        except OSError:
            return False
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("step") == step:
                if all(record.get(k) == v for k, v in fields.items()):
                    return True
        return False

    @contextlib.contextmanager
    def _locked(self):
        """An exclusive flock on the file's directory, held by each append and by resume_at's rewrite:
        the evaluator (another process) appends to the trainer's file, and a row it appended while a
        resuming trainer read and replaced the file went with the old file. flock, not lock.py's POSIX
        lock: POSIX locks are the process's (a second open in it does not wait; closing any descriptor
        of the file drops them). Its reach: processes of one machine; on a network file system an
        evaluator on another machine may not be held back (NFS flock is node-local or emulated), and
        where the file system has no locks nothing is held: the race stays there, a rare lost row."""
        try:
            fd = os.open(self.path.parent, os.O_RDONLY)
        except OSError:
            yield
            return
        try:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _drop_torn_tail(self) -> None:
        """Before the first row this process appends: a last line without its newline (a writer killed
        mid-row) is cut off, or the row would be glued onto it (the evaluator's, which then vanished
        from the plot and, once more rows followed, made the file unreadable to it)."""
        try:
            with open(self.path, "rb+") as f:
                size = f.seek(0, os.SEEK_END)
                if size == 0:
                    return
                f.seek(size - 1)
                if f.read(1) == b"\n":
                    return
                start = max(0, size - (1 << 20))  # a row is far shorter than a MiB
                f.seek(start)
                tail = f.read()
                cut = tail.rfind(b"\n")
                f.truncate(start + cut + 1 if cut >= 0 else start)
        except OSError:
            return  # no file yet, or not readable: the append says what is wrong

    def resume_at(self, step: int) -> str:
        """Drop the rows past `step`, the step a run resumes from (0 for a fresh start): a run killed
        after its last checkpoint logged steps that the resumed run logs again, and readers (the plot,
        pandas) must see each step once. Also drops the torn last line of a run killed while writing it
        (appending after it would glue the next row onto it). Rows up to `step` are kept byte for byte,
        and the file is replaced whole (fasttrain.checkpoint.write_atomic: a crash leaves the old file or
        the new one). Returns the line to log ('' when nothing changed)."""
        if not self.enabled or not self.path.exists():
            return ""
        with self._locked():
            return self._rewrite_to(step)

    def _rewrite_to(self, step: int) -> str:
        from fasttrain.checkpoint import write_atomic

        try:
            lines = self.path.read_bytes().splitlines(keepends=True)
        except OSError as exc:
            return f"note: cannot read {self.path} ({exc.strerror}); rows past step {step} may repeat"
        kept = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except ValueError:
                if number == len(lines) or not line.strip():
                    continue  # torn by a kill mid-write, or blank
                kept.append(line)  # not this method's to judge: kept as it is
                continue
            past = isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step
            if not past:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
        if kept == lines:
            return ""
        dropped = len(lines) - len(kept)
        aside = None
        if step == 0:
            # A start over in a directory whose earlier run saved no checkpoint: that run's rows may be
            # all there is of it (another seed, another learning rate), so they are kept beside.
            aside = next(
                p
                for k in range(1, 10_000)
                if not (p := self.path.with_name(f"{self.path.name}.earlier-{k}")).exists()
            )
            try:
                write_atomic(aside, lambda f: f.writelines(lines))
            except OSError as exc:
                return f"note: cannot write {aside} ({exc.strerror}); rows past step 0 may repeat"
        try:
            write_atomic(self.path, lambda f: f.writelines(kept))
        except OSError as exc:
            return f"note: cannot rewrite {self.path} ({exc.strerror}); rows past step {step} may repeat"
        if aside is not None:
            return (
                f"{self.path.name}: this directory's earlier start saved no checkpoint; its {dropped} "
                f"row(s) past step 0 are kept in {aside.name}, and this run logs from step 0"
            )
        return f"{self.path.name}: dropped {dropped} line(s) past step {step}, which this run logs again"


class progress_bar:  # noqa: N801 - used like a function
    """A tqdm bar when stdout is a terminal on the main rank; otherwise it does nothing."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.enabled = enabled and sys.stdout.isatty()
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self.enabled:
            self._bar.update(n)

    def write(self, line: str) -> None:
        self._bar.write(line)

    def close(self) -> None:
        if self.enabled:
            self._bar.close()


class StopRequest:
    """SIGTERM/SIGINT set a flag; all ranks agree (all-reduced) to stop at the same step.

    One process checks its flag every step; several all-reduce it every `check_every` steps, a host
    sync, so the trainer passes its log interval, where it reads the loss back anyway.
    """

    def __init__(self, check_every: int):
        self.flag, self.signal_name, self.check_every = False, "", check_every
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        self.flag, self.signal_name = True, signal.Signals(signum).name

    def requested(self, info, step: int, now: bool = False) -> bool:
        """now: agree at this step whatever check_every says (every rank must ask at the same step)."""
        if info.world_size == 1:
            return self.flag
        if step % self.check_every and not now:
            return False
        # note: a collective and a host sync, every check_every steps
        agreed = all_reduce_flag(self.flag, info)
        self.signal_name = self.signal_name or "a signal on another rank"
        return agreed

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
