"""Who acts on a stop signal: the trainer's main process only, never its DataLoader workers.

A scheduler preempting a job (SLURM), Ctrl-C in a terminal, and torchrun's agent when it is itself
stopped (`docker stop`) all send SIGTERM or SIGINT to a whole process group: the trainer and its
DataLoader workers at once. A worker dies of it by default (torch installs a C handler that
re-raises SIGTERM), the DataLoader's SIGCHLD handler then raises "DataLoader worker ... is killed by
signal: Terminated" in the trainer, and the run ends with exit 1 and no checkpoint. So workers take
no notice of both signals and the main process (fasttrain.monitor.StopRequest) saves a checkpoint
and exits 0; the workers end when the trainer drops its DataLoader, or within torch's 5 s parent
watchdog if the trainer is killed.

Not SIG_IGN: the trainer itself stops its workers with SIGTERM when they do not end in time, and
multiprocessing does so at interpreter exit for workers still alive (a rank that died of an uncaught
error), then waits for them without a time limit: with SIG_IGN that exit hung until torchrun's
SIGKILL 30 s later. So, as torch's own C handler does, a worker still obeys a SIGTERM sent by its
parent: the signals stay blocked in the worker and a thread takes them with sigwaitinfo, which
tells the sender apart.

The workers are forked with both signals blocked (`stop_signals_blocked` around the DataLoader's
start): a signal arriving before the worker's thread runs stays pending and is taken by it then.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_sigint() -> None:
    """A process pool's initializer: Ctrl-C reaches every process of the terminal's group, and the
    main process alone handles it (each worker printed a traceback of its own, and the pool one more).
    SIGTERM gets its default action back: the data tools' main process turns it into Ctrl-C
    (fasttrain.data.__main__), and a worker forked with that handler would print a traceback when
    the pool ends it with SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader worker_init_fn: from now on only a SIGTERM from the parent process ends this worker."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # threads started below inherit the block
    parent = os.getppid()
    threading.Thread(target=_take_stop_signals, args=(parent,), name="stop-signals", daemon=True).start()


def _take_stop_signals(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)  # the DataLoader (or multiprocessing at exit) ending its worker, as torch does


@contextlib.contextmanager
def stop_signals_blocked():
    """Hold SIGTERM/SIGINT pending in this thread (and in processes forked meanwhile) for the block."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
