"""Who acts on a stop signal: the trainer's main process only, never its DataLoader workers.

A scheduler preempting a job (SLURM), Ctrl-C in a terminal, and torchrun's agent when it is itself
stopped (`docker stop`) all send SIGTERM or SIGINT to a whole process group: the trainer and its
DataLoader workers at once. A worker dies of it by default (torch installs a C handler that
re-raises SIGTERM), the DataLoader's SIGCHLD handler then raises "DataLoader worker ... is killed by
signal: Terminated" in the trainer, and the run ends with exit 1 and no checkpoint. So workers ignore
both signals and the main process (fasttrain.monitor.StopRequest) saves a checkpoint and exits 0;
the workers end when the trainer drops its DataLoader, or within torch's 5 s parent watchdog if the
trainer is killed.

The workers are forked with both signals blocked (`stop_signals_blocked` around the DataLoader's
start): a signal arriving between the fork and the worker's `ignore_stop_signals` stays pending, is
discarded when the worker ignores it, and reaches the main process when it unblocks.
"""

from __future__ import annotations

import contextlib
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader worker_init_fn: SIGTERM and SIGINT do nothing in this worker from now on."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def stop_signals_blocked():
    """Hold SIGTERM/SIGINT pending in this thread (and in processes forked meanwhile) for the block."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
