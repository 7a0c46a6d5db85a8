"""How many CPU threads the trainer's own process uses, and how they wait: set before torch starts.

The policy (`configure`), applied by every command-line entry point before anything imports torch:

- intra-op threads = the cores this process may run on (its CPU affinity), divided among the
  node's ranks (torchrun's LOCAL_WORLD_SIZE), minus the input pipeline's workers (DataLoader
  processes, or DALI's CPU threads), at least 1: `intra_op_threads`. The workers are busy all the
  time decoding JPEGs, so threads beyond the free cores only take turns with them.
- a passive wait: OMP_WAIT_POLICY=PASSIVE (libgomp, which torch's Linux wheels use, and LLVM's
  OpenMP) and KMP_BLOCKTIME=0 (Intel's OpenMP): an OpenMP thread with no work sleeps at once.
  Left unset, libgomp spins for 300,000 polls after every parallel region (GOMP_SPINCOUNT's
  default, some milliseconds), holding a core the loader's workers or another program could use.
- an explicit setting wins: OMP_NUM_THREADS (torchrun sets it to 1 when it starts several processes)
  keeps torch's thread count; any of OMP_WAIT_POLICY, GOMP_SPINCOUNT, KMP_BLOCKTIME keeps the
  runtime's wait; FASTTRAIN_THREADS=off leaves everything as torch would (the old behaviour).

Why: measured on this project's 2-core machine under other work (load 9.5-17) beside 0-2 busy loops,
the demo's steps with torch's defaults (two spinning intra-op threads and two loader workers on two
cores; each parallel region waits for its slowest thread) took 11-32x as long as with this policy and
5-10x the CPU time per image (bench/bench_threads.py, bench/results/2026-11-25-cpu-threads/).

The wait policy is read once, when torch loads its OpenMP runtime, i.e. at `import torch`. Library
users who want it call `fasttrain.threads.configure(num_workers)` before importing torch or any
fasttrain module that does (`fasttrain.train`, `fasttrain.run`, `fasttrain.data`); called later it
still sets the thread count and says that the wait policy could not be applied.

The CPU optimizer (kernels/cpu.py) runs on torch.get_num_threads() threads of its own: a Python
thread pool whose idle threads block on a queue (no spinning); numba's threading layer is not used
(no parallel=True), so NUMBA_NUM_THREADS and its workqueue/omp/tbb layers play no part.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

OFF_VARIABLE = "FASTTRAIN_THREADS"  # "off": torch's own defaults
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
PASSIVE_WAIT = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


@dataclass(frozen=True)
class ThreadPolicy:
    """What `configure` chose, for the run's first log line."""

    threads: int
    wait: str
    why: str

    def describe(self) -> str:
        return f"CPU threads: {self.threads} intra-op ({self.why}), {self.wait} wait"


def available_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's or taskset's limit)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def intra_op_threads(input_workers: int, cores: int, local_ranks: int = 1) -> int:
    """Threads for torch's intra-op pool: this rank's share of the cores minus its input workers, >= 1."""
    return max(1, cores // max(1, local_ranks) - max(0, input_workers))


def input_workers(cfg) -> int:
    """The CPU workers a run's input pipeline keeps busy beside the trainer: DataLoader processes
    (torch backend; one when deterministic), DALI's CPU threads, none for synthetic batches."""
    if cfg.data_backend == "synthetic":
        return 0
    return min(cfg.num_workers, 1) if cfg.deterministic and cfg.data_backend == "torch" else cfg.num_workers


def configure(num_workers: int = 0, environ=None) -> ThreadPolicy:
    """Apply the policy of the module docstring to this process; call it before `import torch`."""
    env = os.environ if environ is None else environ
    if env.get(OFF_VARIABLE, "").lower() == "off":
        return ThreadPolicy(_torch_threads(), "the OpenMP runtime's", f"{OFF_VARIABLE}=off: torch's defaults")
    wait = "passive"
    if any(name in env for name in WAIT_VARIABLES):
        wait = "the environment's"
    elif "torch" in sys.modules:  # its OpenMP runtime has read the environment already
        wait = "spinning (torch was imported before fasttrain.threads.configure)"
    else:
        env.update(PASSIVE_WAIT)
    if env.get("OMP_NUM_THREADS"):
        return ThreadPolicy(_torch_threads(), wait, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    cores = available_cores()
    ranks = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    threads = intra_op_threads(num_workers, cores, ranks)
    import torch  # after the environment above: its OpenMP runtime reads it when it loads

    torch.set_num_threads(threads)
    share = f"{cores} cores" + (f" / {ranks} ranks" if ranks > 1 else "")
    return ThreadPolicy(threads, wait, f"{share}, {num_workers} input workers")


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
