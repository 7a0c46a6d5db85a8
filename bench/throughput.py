"""Training throughput of one configuration ("row"), measured the same way for every alternative.

The rows (what each trains, and how): bench/row_steps.py. Here, how every row is measured.

Timing: `warmup` steps run untimed (cudnn autotuning, CUDA-graph capture, compilation); then
`repeats` windows of `steps` steps, each window bracketed by CUDA events and synchronised (on the CPU,
which executes synchronously, by time.perf_counter). A window's images/s = steps * batch / seconds;
the row reports the median window and the min and max. `steps` is chosen once per row so that a
window lasts about `target_seconds` (3..max_steps steps) unless given.

Optimizer step alone (`optimizer=True`): the row's update (optimizer + weight EMA, no BN EMA), the
device's own time over repeated calls on the model's gradients (bench.common.queued_timed: an update's
Python outlasts its kernel, and timing the calls as they came measured the host; the host's time is
recorded beside it); the effective bandwidth counts the minimum traffic of
a one-pass update, 4 bytes x (3 + 2 x states + 2 x ema) per parameter: w and g read, w written, every
state and the EMA read and written. RMSProp+EMA: 36 B/param, Momentum+EMA: 28 B/param.

    python -m bench.throughput --spec JSON [--rows a,e,b] --opts JSON --result FILE
        (rows of one configuration in a process of their own, one JSON line each appended to FILE;
        bench.run's and bench.gpu_run's subprocess)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.common import one_line, queued_timed, summarize, synchronize, timed
from bench.row_steps import ROW_TITLES, RowSpec, build_row, config_for
from bench.step_profile import kernel_breakdown, profile_path, profile_record, profile_watchdog
from fasttrain.data import build_loader
from fasttrain.data.loader import batch_stream


@dataclass
class MeasureOptions:
    warmup: int = 5
    repeats: int = 5
    steps: int = 0
    """Steps per timed window (0: about target_seconds per window)."""
    target_seconds: float = 0.5
    max_steps: int = 100
    optimizer: bool = False
    """Also time the optimizer step alone."""
    optimizer_calls: int = 20
    profile: int = 0
    """Then profile this many steps (bench/step_profile.py: device time by kind of kernel; 0: none)."""


def input_stream(spec: RowSpec, device: torch.device) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """next_batch() for the row's input: the same device batch (synthetic) or the loader's batches."""
    cfg = config_for(spec, device)
    # The trainer's loader: the zero-copy ring (fasttrain.train).
    loader = build_loader(
        cfg, split="train", training=True, rank=0, world_size=1, device=device, reuse_buffers=True
    )
    if spec.input == "synthetic":
        images, labels = next(iter(loader))  # (N, H, W, 3) uint8 on the device
        return lambda: (images, labels)
    batches = batch_stream(loader, 1)
    return lambda: next(batches)[0]


def measure_row(
    spec: RowSpec, device: torch.device, opts: MeasureOptions, on_timed: Callable[[dict], None] | None = None
) -> dict:
    """Build, warm up and time one row. Never raises: a failure is the result's status. With
    opts.profile, on_timed (if given) gets the timed result before the profile starts, so a profiler
    that hangs (CUPTI with CUDA graphs has, on older CUDA) costs the breakdown, not the row."""
    result = dict(spec=dataclasses.asdict(spec), title=ROW_TITLES[spec.row], status="ok")
    row = None
    try:
        t0 = time.perf_counter()
        next_batch = input_stream(spec, device)
        row = build_row(spec, device)
        result["setting"] = row.setting
        run = lambda: row.step(*next_batch())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(opts.warmup + row.extra_warmup):
            run()
        synchronize(device)
        result["warmup_seconds"] = time.perf_counter() - t0  # build, autotune, capture, compile
        steps = opts.steps
        if not steps:
            one = timed(run, 1, device)
            steps = max(3, min(opts.max_steps, math.ceil(opts.target_seconds / max(one, 1e-6))))
        seconds = [timed(run, steps, device) for _ in range(opts.repeats)]
        ips = [steps * spec.batch / s for s in seconds]
        result.update(steps_per_repeat=steps, seconds=seconds, images_per_s=summarize(ips))
        if device.type == "cuda":
            result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if opts.optimizer:
            for _ in range(2):
                row.optimizer_step()
            synchronize(device)
            # The device's own time: timed() measured the host's Python (0.40 ms a ResNet-50 update in
            # the third run, whose profile gave the kernel 0.17 ms).
            window = queued_timed(row.optimizer_step, opts.optimizer_calls, device)
            sec = window["seconds"] / opts.optimizer_calls
            result["optimizer"] = dict(
                num_params=row.num_params,
                bytes_per_param=row.optimizer_bytes,
                ms=sec * 1e3,
                effective_gb_per_s=row.num_params * row.optimizer_bytes / sec / 1e9,
                host_ms=window["host_seconds"] / opts.optimizer_calls * 1e3,
                host_bound=window["host_seconds"] > window["held_seconds"],
            )
        if opts.profile:
            if on_timed is not None:
                on_timed(dict(result))
            try:  # after the timed windows: a profiler failure costs the breakdown, not the row
                result["profile"] = kernel_breakdown(run, opts.profile, device)
            except Exception as exc:
                result["profile_error"] = one_line(exc)
    except Exception as exc:  # a row that cannot run is reported, not fatal (OOM, compile errors)
        result["status"] = "failed"
        result["error"] = one_line(exc)
        result["traceback"] = traceback.format_exc(limit=8)
    finally:
        row = None  # free the model, graph and optimizer state before the next row
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    """Rows in this process (bench.run uses it for (d), whose compilation can hang or blow up;
    bench.gpu_run for each configuration's rows)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help="RowSpec as JSON")
    parser.add_argument("--rows", default="", help="comma-separated rows to measure in turn (default spec's)")
    parser.add_argument("--opts", default="{}", help="MeasureOptions as JSON")
    parser.add_argument("--result", required=True, help="JSON lines file: one result appended per row")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument(
        "--profile_limit", type=float, default=30.0, help="seconds a row's profile may take (default 30)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = RowSpec(**json.loads(args.spec))
    opts = MeasureOptions(**json.loads(args.opts))
    failed = 0

    def append(path: str, record: dict) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    for row in [r.strip() for r in args.rows.split(",") if r.strip()] or [spec.row]:
        # Appended as each row is timed, so that a process killed at its time limit keeps what it
        # measured; its profile, after, goes to profile_path (profile_record).
        timed: list[dict] = []
        watchdog = profile_watchdog(args.profile_limit)

        def on_timed(r: dict, timed: list[dict] = timed, watchdog=watchdog) -> None:
            append(args.result, r)
            timed.append(r)
            watchdog.start()  # the row is safe: a profile that never ends ends the process

        result = measure_row(dataclasses.replace(spec, row=row), torch.device(args.device), opts, on_timed)
        watchdog.cancel()
        if timed:
            append(profile_path(args.result), profile_record(result))
        else:
            append(args.result, result)
        failed += result["status"] != "ok"
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
