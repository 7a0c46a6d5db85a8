"""Where a training step's device time goes: a few steps under torch.profiler, the kernels grouped.

    breakdown = kernel_breakdown(run, steps=3, device=device)
    breakdown["ms_per_step"]   # {"convolution": 21.3, "inductor (Triton)": 9.8, ...}
    breakdown["top"]           # the kernels, most time first (TOP of them: in practice all of them),
                               # [{"name", "group", "ms_per_step", "calls_per_step"}]

bench/throughput.py runs it after a row's timed windows (MeasureOptions.profile steps), so the rows of
one setting, (f) fasttrain --compile beside (d) torch.compile say which kind of work one of them
spends more on: the convolutions (cuDNN's choice of kernels, the stem), inductor's fused
BatchNorm/ReLU/add kernels, ATen's own elementwise and reduction kernels, the optimizer, copies.
The groups are by kernel name (GROUPS, first match wins); on a GPU the times are the kernels' own
device times (a CUDA graph's replay included: CUPTI reports the kernels inside it), on the CPU the
operators' self CPU times (the dry run's; only a check that it runs). Profiling slows the host side,
not the kernels, and its steps are not the timed ones. bench/throughput.py writes a profiled row's
breakdown apart from the row (profile_path, profile_record), after the row, under a time limit
(profile_watchdog).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import threading
from collections.abc import Callable

import torch

from bench.common import synchronize

# (group, pattern over the kernel's or operator's name, case-insensitive); the first that matches.
GROUPS = (
    ("optimizer (fasttrain Triton)", r"_rmsprop_tf_kernel|_momentum_kernel|rmsprop_tf_upd|momentum_upd"),
    ("inductor (Triton)", r"^triton|cpp_fused"),  # its CUDA kernels, its C++ ones on the CPU
    ("pooling", r"pool"),
    ("convolution", r"conv|implicit|wgrad|dgrad|fprop|cudnn|nchwtonhwc|nhwctonchw"),  # before matmul
    # cuBLAS's GEMMs (nvjet_*: the 1x1 convolutions cuDNN hands to cuBLAS, the classifier) were
    # "other" in the third run's tables, 1.8-3.6 ms a ResNet-50 step.
    ("matmul", r"gemm|cutlass|matmul|aten::mm|aten::addmm|linear|nvjet"),
    ("batch norm (ATen)", r"batch_norm|batchnorm|bn_fw|bn_bw|welford"),
    ("copy / fill", r"memcpy|memset|copy|fill|\bcat\b|catarray"),
    ("elementwise / reduction (ATen)", r"elementwise|vectorized|reduce|unrolled|foreach|multi_tensor|lerp"),
)
# Every kernel of a step in practice (the third run kept 25, too few to tell which kernels made (f)'s
# 0.9 ms more copy and ATen elementwise time than (d)'s at ResNet-50 bf16 batch 256).
TOP = 400


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def kernel_breakdown(run: Callable[[], object], steps: int, device: torch.device) -> dict:
    """Profile `steps` calls of run() (warm: the caller has run it before); ms per step by group and
    the TOP kernels. Device kernels on CUDA, operators' self CPU time elsewhere."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        synchronize(device)
    kernels: dict[str, list[float]] = {}  # name -> [microseconds, calls]
    for event in prof.key_averages():
        if cuda:
            if str(event.device_type).rsplit(".", 1)[-1] != "CUDA":
                continue
            us = getattr(event, "self_device_time_total", None)
            if us is None:
                us = event.self_cuda_time_total
        else:
            us = event.self_cpu_time_total
        if us <= 0:
            continue
        entry = kernels.setdefault(event.key, [0.0, 0])
        entry[0] += us
        entry[1] += event.count
    by_group: dict[str, float] = {}
    for name, (us, _) in kernels.items():
        by_group[group_of(name)] = by_group.get(group_of(name), 0.0) + us / 1e3 / steps
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:TOP]
    return dict(
        steps=steps,
        source="CUDA kernels (device time)" if cuda else "CPU operators (self CPU time)",
        total_ms_per_step=sum(by_group.values()),
        ms_per_step=dict(sorted(by_group.items(), key=lambda item: -item[1])),
        top=[
            dict(
                name=name[:160], group=group_of(name), ms_per_step=us / 1e3 / steps, calls_per_step=n / steps
            )
            for name, (us, n) in top
        ],
    )


def breakdown_table(rows: list[tuple[str, dict, float | None]]) -> list[str]:
    """Markdown: one column per (label, breakdown, the row's timed ms per step), one line per group."""
    if not rows:
        return []
    groups = [g for g, _ in GROUPS] + ["other"]
    groups = [g for g in groups if any(g in b["ms_per_step"] for _, b, _ in rows)]
    out = ["| group (ms per step) | " + " | ".join(label for label, _, _ in rows) + " |"]
    out.append("|" + " --- |" * (len(rows) + 1))
    for g in groups:
        cells = [f"{b['ms_per_step'].get(g, 0.0):.2f}" for _, b, _ in rows]
        out.append(f"| {g} | " + " | ".join(cells) + " |")
    totals = [f"**{b['total_ms_per_step']:.2f}**" for _, b, _ in rows]
    out.append("| **all of them** | " + " | ".join(totals) + " |")
    timed = [f"{ms:.2f}" if ms else "-" for _, _, ms in rows]
    out.append("| the timed step (its windows' median) | " + " | ".join(timed) + " |")
    return out


# --- bench.throughput's profiled rows: the record apart from the row, and the time limit ------------


def profile_path(result_path: str) -> str:
    """Where the profiles of the rows in `result_path` (a .jsonl file) go: NAME.profile.jsonl."""
    return str(result_path).removesuffix(".jsonl") + ".profile.jsonl"


def profile_record(result: dict) -> dict:
    """A profiled row's breakdown with what says which row it is and how long its timed step took."""
    seconds, steps = result.get("seconds") or [], result.get("steps_per_repeat") or 0
    record = dict(spec=result["spec"], timed_ms_per_step=None)
    if seconds and steps:
        record["timed_ms_per_step"] = statistics.median(seconds) / steps * 1e3
    for key in ("profile", "profile_error"):
        if key in result:
            record[key] = result[key]
    return record


def profile_watchdog(limit: float) -> threading.Timer:
    """A timer (not started) that ends the process with exit code 5 after `limit` seconds: started once
    a row is written, so that a profile that never ends (CUPTI stuck on a CUDA graph) costs seconds."""

    def stuck() -> None:
        sys.stderr.write(f"throughput: the profile ran past {limit:.0f} s (its row is written); stopping\n")
        sys.stderr.flush()
        os._exit(5)

    timer = threading.Timer(limit, stuck)
    timer.daemon = True
    return timer
