"""What every benchmark shares: the timer, the environment record, the device copy bandwidth.

timed(fn, calls, device)      seconds for `calls` calls of fn, device work included: CUDA events
                              around the calls on a GPU, time.perf_counter on the CPU (which
                              executes synchronously)
queued_timed(fn, calls, dev)  the device's own time for calls the host enqueues slower than the
                              device runs them (a sleep kernel holds the stream meanwhile)
environment(device, command)  where and how the numbers were measured: GPU, driver, CUDA, cuDNN,
                              torch, triton, DALI and the input libraries' versions, CPU, date,
                              command, git commit
copy_bandwidth(device)        dst.copy_(src) of a 1 GiB fp32 buffer on CUDA (64 MiB on the CPU);
                              bytes moved = 2 x size (read + write); the median of `windows`
                              windows after 3 untimed copies. The yardstick of an optimizer
                              update's effective GB/s.
run_limited(cmd, limit, log)  a command in its own process group under a time limit, its output in
                              a log (bench.run's and bench.gpu_run's steps)
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Versions recorded beside torch, triton, DALI and numpy: the input libraries the benchmarks compare.
PACKAGES = ("pillow", "simplejpeg", "numba", "google-crc32c", "tfrecord", "scikit-image")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # note: the host waits for the device's queued work


def timed(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds for `calls` calls of fn, device work included (events on CUDA)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()  # note: host waits for the window's device work, outside the window
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


# Cycles of torch.cuda._sleep before a queued window: about 0.1-0.2 s at 1-2 GHz, more than the host
# takes to enqueue a window of optimizer updates (20 x ~0.5 ms of Python each).
_QUEUE_CYCLES = 2 * 10**8


def queued_timed(fn: Callable[[], object], calls: int, device: torch.device) -> dict:
    """The device's own seconds for `calls` calls of fn, where the host is slower than the device per
    call (an optimizer update: ~0.5 ms of Python for a 0.17 ms kernel). timed() then measures the
    host, the device idle between calls. Here a sleep kernel holds the stream while the host enqueues
    every call, so the events around them time the device's work alone. {"seconds", "host_seconds",
    "held_seconds"}: host_seconds (enqueueing) above held_seconds (the sleep) means the queue ran dry
    and `seconds` is still the host's. On the CPU: timed()'s."""
    if device.type != "cuda":
        seconds = timed(fn, calls, device)
        return dict(seconds=seconds, host_seconds=seconds, held_seconds=0.0)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    events[0].record()
    torch.cuda._sleep(_QUEUE_CYCLES)
    events[1].record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    events[2].record()
    events[2].synchronize()  # note: host waits for the window's device work, outside the window
    return dict(
        seconds=events[1].elapsed_time(events[2]) / 1e3,
        host_seconds=host,
        held_seconds=events[0].elapsed_time(events[1]) / 1e3,
    )


def summarize(values: list[float]) -> dict:
    return dict(
        median=statistics.median(values),
        min=min(values),
        max=max(values),
        stdev=statistics.stdev(values) if len(values) > 1 else 0.0,
    )


def one_line(exc: BaseException) -> str:
    """An exception as the one line a result's `error` holds."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def copy_bandwidth(device: torch.device, nbytes: int = 0, calls: int = 0, windows: int = 3) -> dict:
    """Measured device-to-device copy GB/s (bytes read + written, median of `windows` windows)."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**26)
    calls = calls or (20 if device.type == "cuda" else 3)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)
    timed(copy, 3, device)  # warm-up: page faults, clocks
    seconds = statistics.median(timed(copy, calls, device) for _ in range(windows)) / calls
    return dict(bytes=nbytes, gb_per_s=2 * nbytes / seconds / 1e9)


def _run(cmd: list[str], cwd=None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _lscpu() -> dict:
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "CPU max MHz", "L2 cache", "L3 cache")
    text = _run(["lscpu"]) or ""
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if k in keep}


def environment(device: torch.device, command: list[str]) -> dict:
    """Where and how the numbers were measured; `command` is the argv after `python`."""
    try:
        import nvidia.dali

        dali = nvidia.dali.__version__
    except ImportError:
        dali = None
    try:
        from PIL import features

        libjpeg_turbo = features.version("jpg")
    except ImportError:
        libjpeg_turbo = None
    commit = _run(["git", "rev-parse", "HEAD"], cwd=ROOT)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT)
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=shlex.join(["python", *command]),
        git_commit=None if commit is None else commit + ("-dirty" if dirty else ""),
        python=platform.python_version(),
        torch=torch.__version__,
        triton=_version("triton", "pytorch-triton"),
        dali=dali,
        numpy=_version("numpy"),
        packages={name: _version(name) for name in PACKAGES} | {"libjpeg_turbo": libjpeg_turbo},
        cpu=_cpu_name(),
        cpu_count=os.cpu_count(),
        lscpu=_lscpu(),
        torch_threads=torch.get_num_threads(),
        device=device.type,
        triton_interpret=os.environ.get("TRITON_INTERPRET", ""),
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"])
        env.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            driver=driver.splitlines()[0] if driver else None,
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            tf32_cudnn=torch.backends.cudnn.allow_tf32,
        )
    return env


# Of a step's time limit, the last seconds (at most) between the SIGINT that asks it to stop and the
# SIGKILL: pytest prints the failures it has seen so far, selfcheck writes the rows that ran.
GRACE_S = 10.0


def run_limited(cmd: list[str], limit: float, log_path: Path, env: dict | None = None) -> dict:
    """Run cmd (in its own process group) with output to log_path, within `limit` s in all: at
    `limit` - grace, SIGINT to cmd (what it has to say about the work it did lands in the log); at
    `limit`, or once cmd has ended, SIGKILL to the group (what cmd started: inductor's compile
    workers, pytest's children)."""
    start = time.monotonic()
    grace = min(GRACE_S, limit / 10)
    with open(log_path, "w", encoding="utf-8") as log:
        # cwd at the root: `python -m bench.throughput` and `-m pytest` import this checkout.
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            returncode, timed_out = proc.wait(timeout=max(limit - grace, 0.0)), False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                os.kill(proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(limit - (time.monotonic() - start), 0.0))
            with contextlib.suppress(ProcessLookupError):  # the group's last member may be gone
                os.killpg(proc.pid, signal.SIGKILL)
            returncode, timed_out = proc.wait(), True
    return dict(returncode=returncode, timed_out=timed_out, seconds=time.monotonic() - start)
