"""`python -m fasttrain selfcheck`: each fast path against its reference, on this machine.

    python -m fasttrain selfcheck [--out selfcheck.json] [--checks NAME,NAME] [--device cuda|cpu]

Prints the versions it runs on (device, driver, CUDA, NCCL, torch, Triton, DALI) and the precision
policy the trainer would pick, then one row per check: pass, fail with the reason, or skip with the
reason. Writes the same as JSON to --out. Exit code 1 when any row fails, 0 otherwise (skips are not
failures: on a CPU every GPU-only row is skipped and says why).

The references are those of the test suite, never the code under test: the readable torch optimizer
(kernels/*_reference) for the chunked and Triton paths; plain torch.optim.SGD for the eager step;
the eager step for CUDA-graph replay; torch DDP for the gradient buckets; the torch pipeline for
DALI. The checks are in step_checks.py (optimizer, step, graph) and system_checks.py (buckets, DALI,
throughput) beside this file, listed in checks.py. About 40 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fasttrain.cli_parser import Parser
from fasttrain.selfcheck.common import Skip

STATUSES = ("pass", "fail", "skip")


@dataclass
class Row:
    name: str
    status: str
    """pass, fail or skip."""
    detail: str
    """What was compared and measured (pass), the reason (fail, skip)."""
    seconds: float


def _run_check(name: str, check, ctx) -> Row:
    start = time.perf_counter()
    try:
        status, detail = "pass", check(ctx)
    except Skip as why:
        status, detail = "skip", str(why)
    except Exception as exc:  # a failing comparison or a crash: either way this row failed
        status = "fail"
        detail = f"{type(exc).__name__}: {exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__
        if not isinstance(exc, AssertionError):
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            detail += f" (at {Path(frame.filename).name}:{frame.lineno})"
    return Row(name, status, detail or "", round(time.perf_counter() - start, 2))


# --- environment ---------------------------------------------------------------------------------


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return "not installed"
    except Exception as exc:  # DALI without its CUDA libraries, for one
        return f"does not import ({type(exc).__name__})"


def _driver() -> str:
    if shutil.which("nvidia-smi") is None:
        return "none (no nvidia-smi)"
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})"
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else f"unknown (nvidia-smi exit {done.returncode})"


def _nccl() -> str:
    if not torch.cuda.is_available():
        return "not used (no CUDA device)"
    try:
        version = torch.cuda.nccl.version()
    except Exception as exc:  # a torch built without NCCL
        return f"not available ({type(exc).__name__})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _shared_memory() -> str:
    if not Path("/dev/shm").is_dir():
        return "no /dev/shm"
    # DataLoader workers hand batches over in shared memory: 14 workers x 2 prefetched x 256 images
    # at 299 px is about 2 GB. Too little makes the torch pipeline fail at batch 256.
    free_gb = shutil.disk_usage("/dev/shm").free / 1e9
    note = "" if free_gb >= 4 else " (too little for the torch pipeline's workers at batch 256)"
    return f"/dev/shm {free_gb:.1f} GB free{note}"


def environment(device: torch.device) -> dict:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = (
            f"{torch.cuda.get_device_name(device)} (sm_{major}{minor}), {torch.cuda.device_count()} visible"
        )
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), no CUDA device"
    return {
        "device": name,
        "shared_memory": _shared_memory(),
        "driver": _driver(),
        "cuda": torch.version.cuda or "none (CPU build of torch)",
        "nccl": _nccl(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "dali": _version("nvidia.dali"),
    }


def policy(device: torch.device) -> dict:
    """What `python -m fasttrain` picks here with no precision flags (fasttrain/precision.py)."""
    from fasttrain.compile import compile_wanted
    from fasttrain.config import make_config
    from fasttrain.optim import select_impl
    from fasttrain.precision import resolve_precision

    cfg = make_config()
    chosen = resolve_precision(cfg, device)
    return {
        "precision": chosen.name,
        "channels_last": chosen.channels_last,
        "cuda_graph": chosen.cuda_graph,
        "compile": compile_wanted(cfg.compile, device, cfg.deterministic, cfg.bn_kernels),
        "pad_stem": chosen.stem_channels == 4,
        "optimizer": select_impl("auto", device),
    }


# --- output --------------------------------------------------------------------------------------


def table(env: dict, pol: dict, rows: list[Row]) -> str:
    lines = [f"{key:>13}: {value}" for key, value in env.items()]
    lines.append(f"{'policy':>13}: " + ", ".join(f"{k} {v}" for k, v in pol.items()))
    lines.append("")
    width = max(len(r.name) for r in rows) if rows else 10
    lines.append(f"{'check':<{width}}  status  {'time':>6}  detail")
    lines.append(f"{'-' * width}  ------  ------  ------")
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.seconds:5.1f}s  {r.detail}")
    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    lines.append("")
    lines.append(f"selfcheck: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    return "\n".join(lines)


def _parse(argv: list[str]) -> argparse.Namespace:
    from fasttrain.selfcheck.checks import CHECKS

    p = Parser(
        prog="fasttrain selfcheck",
        description="Check each fast path (Triton kernels, CUDA-graph step, buckets, DALI) against "
        "its reference on this machine; exit 1 if any fails.",
    )
    p.add_argument("--out", default="selfcheck.json", help="JSON report (default selfcheck.json)")
    p.add_argument(
        "--checks", default="", help=f"comma-separated subset of: {', '.join(CHECKS)} (default all)"
    )
    p.add_argument("--device", default="", help="cuda or cpu (default: cuda when there is one)")
    args = p.parse_args(argv)
    args.checks = [c for c in args.checks.split(",") if c] or list(CHECKS)
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown:
        p.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if args.device not in ("", "cuda", "cpu"):
        p.error(f"--device must be cuda or cpu, not {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device=cuda but torch sees no CUDA device (a CPU build of torch, or no driver)")
    return args


def main(argv: list[str] | None = None) -> int:
    from fasttrain.selfcheck.checks import CHECKS
    from fasttrain.selfcheck.common import Context

    args = _parse(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    # Before the checks' minutes, and without leaving a file: a report that cannot be written is a bad
    # flag (exit 2; it came after every check, as exit 1, the code of a failed check).
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        problem = "a directory" if out.is_dir() else ""
        if not problem and not os.access(out if out.exists() else out.parent, os.W_OK):
            problem = "Permission denied"
    except OSError as exc:
        problem = exc.strerror
    if problem:
        sys.stderr.write(f"fasttrain selfcheck: cannot write {out} ({problem}); pick another --out\n")
        return 2
    # cuBLAS's documented setting for run-to-run reproducible results (a fixed workspace per stream),
    # read when its first handle is made: the graph-vs-eager check compares runs on different streams.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    env, pol = environment(device), policy(device)
    rows, interrupted = [], None
    with tempfile.TemporaryDirectory(prefix="fasttrain-selfcheck-") as scratch:
        ctx = Context(device=device, scratch=Path(scratch))
        for name in args.checks:
            start = time.perf_counter()
            try:
                rows.append(_run_check(name, CHECKS[name], ctx))
            except KeyboardInterrupt:  # Ctrl-C, or a time limit's SIGINT: keep the rows that ran
                interrupted = name
                seconds = round(time.perf_counter() - start, 2)
                rows.append(Row(name, "skip", "interrupted while it ran", seconds))
                rows += [Row(n, "skip", "not run: interrupted", 0.0) for n in args.checks[len(rows) :]]
                break
            print(f"selfcheck: {name}: {rows[-1].status} ({rows[-1].seconds:.1f} s)", file=sys.stderr)
    print(table(env, pol, rows))
    failed = any(r.status == "fail" for r in rows)
    report = {"environment": env, "policy": pol, "rows": [asdict(r) for r in rows]}
    report.update(passed=not failed and interrupted is None, interrupted=interrupted)
    try:
        out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        sys.stderr.write(f"fasttrain selfcheck: cannot write {out} ({exc.strerror}); pick another --out\n")
        return 1
    print(f"selfcheck: wrote {out}")
    if interrupted is not None:
        print(f"selfcheck: interrupted during {interrupted}; the rows before it ran", file=sys.stderr)
        return 130
    return 1 if failed else 0
