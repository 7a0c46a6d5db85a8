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

The input pipeline's own workers, where --num_workers and --loader are left to "auto"
(`resolve_input`, applied by the trainer and by fasttrain.data.build_loader once the device is known):

- on a CUDA device, the torch backend gets this rank's share of the cores less one for the trainer's
  own thread, at most MAX_WORKERS, and DataLoader processes rather than threads above
  THREADS_UP_TO workers. Measured on one H200 with 16 cores (bench/results/2026-11-27-h200-second-run/,
  ResNet-50's train transform on photo shards): 14 loader threads made 4,215 images/s with 37% of
  their busy time off the CPU (the GIL-held part of each image), 14 processes 9,831 at 1.47 CPU ms an
  image; the step they feed trains at 6,609 images/s compiled. The old default, 4 threads a rank,
  makes at most about 2,600-3,000 (4 cores at 1.35-1.56 CPU ms an image): the GPU would wait. At
  1-2 workers the threads win (2-core VM: 1.18-1.22x the processes' rate at 16-22% less CPU an
  image, bench/results/2026-11-27-cpu-loader-threads-vs-processes/); the crossover between 2 and 14
  workers is not measured, and 6 is a judgement from the two ends.
- the processes hand their batches over in shared memory (/dev/shm), each worker PREFETCH batches
  ahead: where /dev/shm has too little free for that (a container's default is 64 MB; one ResNet
  batch of 256 is 38.5 MB), a worker would die with a bus error, so auto keeps the threads there
  and says why on the start-up line.
- DALI keeps DALI_WORKERS CPU threads (its decode is the GPU's; more were not measured), and a CPU
  run keeps CPU_WORKERS: there the model's intra-op threads need the cores, and its step, not its
  input, is the slow part.

The CPU optimizer (kernels/cpu.py) runs on torch.get_num_threads() threads of its own: a Python
thread pool whose idle threads block on a queue (no spinning); numba's threading layer is not used
(no parallel=True), so NUMBA_NUM_THREADS and its workqueue/omp/tbb layers play no part.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

CPU_WORKERS = 4  # "auto" on the CPU: the count before "auto" existed
DALI_WORKERS = 4  # "auto" for DALI's CPU threads (at most the rank's share of the cores)
MAX_WORKERS = 16  # 16 at 1.35-1.56 CPU ms an image make 10,000-11,800 images/s: 1.5x the H200's step
THREADS_UP_TO = 6  # 14 threads did the work of 6.4 cores (the GIL): above 6, processes
SHM_DIR = "/dev/shm"  # where torch's DataLoader workers put the batches they hand over (Linux)
PREFETCH = 2  # torch DataLoader's prefetch_factor: batches each worker makes ahead
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


def local_ranks(environ=None) -> int:
    """This node's ranks (torchrun's LOCAL_WORLD_SIZE; 1 when not launched by torchrun)."""
    env = os.environ if environ is None else environ
    try:
        return max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1


def auto_workers(backend: str, cuda: bool, cores: int, ranks: int = 1) -> int:
    """--num_workers auto: the input workers a rank gets (the module docstring says why)."""
    if not cuda:
        return CPU_WORKERS
    share = max(1, cores // max(1, ranks))
    if backend == "dali":
        return min(DALI_WORKERS, share)
    return max(1, min(MAX_WORKERS, share - 1))


def auto_loader(workers: int, deterministic: bool = False) -> str:
    """--loader auto before /dev/shm is asked (choose_input): threads (less CPU an image), processes
    above THREADS_UP_TO workers."""
    return "processes" if workers > THREADS_UP_TO and not deterministic else "threads"


def shared_memory_free(path: str = SHM_DIR) -> int | None:
    """Bytes free in `path` (None where there is no such file system)."""
    try:
        stat = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return stat.f_bavail * stat.f_frsize


def processes_shm_bytes(cfg, workers: int, ranks: int = 1) -> int:
    """Shared memory the DataLoader processes' batches may hold at once on this node: PREFETCH
    batches ahead per worker and two that the trainer holds, on each rank (uint8 NHWC, 3 channels)."""
    batch = max(cfg.batch_size, cfg.eval_batch_per_process)
    return (PREFETCH * workers + 2) * batch * cfg.image_size**2 * 3 * max(1, ranks)


def shm_shortage(cfg, workers: int, ranks: int, free: int | None) -> str:
    """ "" when `free` bytes of /dev/shm hold the batches of `workers` DataLoader processes, else why
    not, in words for the start-up line."""
    need = processes_shm_bytes(cfg, workers, ranks)
    if free is None or free >= need:
        return ""
    return (
        f"{SHM_DIR} has {_size(free)} free, {workers} DataLoader processes' batches may need "
        f"{_size(need)} (a worker short of it dies with a bus error; docker run --ipc=host or --shm-size)"
    )


def _size(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


@dataclass(frozen=True)
class InputChoice:
    """What --num_workers / --loader auto chose, and why the processes were not taken ("": they were,
    or were not wanted)."""

    workers: int
    loader: str
    why: str = ""

    def apply(self, cfg):
        """cfg with this count and loader (cfg itself where they are its own)."""
        if (self.workers, self.loader) == (cfg.num_workers, cfg.loader):
            return cfg
        return dataclasses.replace(cfg, num_workers=self.workers, loader=self.loader)


def choose_input(
    cfg,
    cuda: bool,
    backend: str | None = None,
    environ=None,
    cores: int | None = None,
    shm_free: int | None = -1,
) -> InputChoice:
    """The InputChoice for cfg's num_workers (None: auto) and loader ("auto") on a `cuda` device and
    the resolved `backend` (default cfg.data_backend); shm_free -1: read /dev/shm."""
    workers, loader, why = cfg.num_workers, cfg.loader, ""
    ranks = local_ranks(environ)
    if workers is None:
        cores = available_cores() if cores is None else cores
        workers = auto_workers(backend or cfg.data_backend, cuda, cores, ranks)
    if loader == "auto":
        loader = auto_loader(workers, cfg.deterministic)
        if loader == "processes":
            free = shared_memory_free() if shm_free == -1 else shm_free
            if why := shm_shortage(cfg, workers, ranks, free):
                loader, why = "threads", f"threads, not processes: {why}"
    return InputChoice(workers, loader, why)


def resolve_input(cfg, cuda: bool, backend: str | None = None, **where):
    """cfg with num_workers None ("auto") and loader "auto" made concrete by choose_input (`where`:
    its environ, cores, shm_free); explicit values are kept."""
    return choose_input(cfg, cuda, backend, **where).apply(cfg)


def input_workers(cfg) -> int:
    """The CPU workers a run's input pipeline keeps busy beside the trainer: DataLoader processes
    (torch backend; one when deterministic), DALI's CPU threads, none for synthetic batches."""
    if cfg.data_backend == "synthetic":
        return 0
    return min(cfg.num_workers, 1) if cfg.deterministic and cfg.data_backend == "torch" else cfg.num_workers


def configure(num_workers=0, environ=None) -> ThreadPolicy:
    """Apply the policy of the module docstring to this process; call it before `import torch`.

    num_workers: the input workers beside the trainer, or a function that returns them, called once
    torch is imported (so that it may ask torch for the device, as --num_workers auto needs)."""
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
    ranks = local_ranks(env)
    import torch  # after the environment above: its OpenMP runtime reads it when it loads

    num_workers = num_workers() if callable(num_workers) else num_workers
    threads = intra_op_threads(num_workers, cores, ranks)
    torch.set_num_threads(threads)
    share = f"{cores} cores" + (f" / {ranks} ranks" if ranks > 1 else "")
    return ThreadPolicy(threads, wait, f"{share}, {num_workers} input workers")


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
