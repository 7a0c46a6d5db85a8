"""The trainer end to end on JPEG TFRecord shards, against the same trainer on synthetic data.

    python -m bench.gpu_e2e --data_dir SHARDS --work DIR --out e2e.json [--dry-run] [--limit S]

Three runs of the CLI, `python -m fasttrain --recipe resnet50_v1.5` (ResNet-50 v1.5, bf16 by the GPU
policy, batch 256, the whole-step CUDA graph and, since the second GPU run, the model's blocks compiled
inside it: the CLI's defaults on CUDA), each in a fresh run directory, alike but for the input:
`--data_backend synthetic` (one batch made on the device), `--data_backend torch --loader threads` (the
thread loader: threads decoding into pinned batch buffers, the shards' row checkpoints) and the same
with `--loader processes` (DataLoader processes), as many as the CLI's --num_workers auto gives this
machine (fasttrain/threads.py; --workers N sets them), each run's count read from its start-up line;
then each loader alone, built from the same flags and drained with no model and no step
(bench/loader_alone.py), which tells a loader that cannot go faster from one held back by the training
process around it, and the threads once more with their decode and resize as separate calls (--no-fused:
three GIL drops an image where the fused call makes one, fasttrain/data/jpeg/fused.py), the fused call's
baseline on the same cores, and, in the time left, both loaders alone at 6 workers (THREADS_UP_TO, where
--loader auto changes from threads to processes), which says whether that threshold holds on this
machine. Each prints the seeds' line every --log_every steps with its examples/sec over those steps; the
rate is the median of those lines after the first two (start-up, capture, the loader filling up). At
each line this reads the trainer's CPU time (utime + stime of the process, its loader threads included,
/proc/PID/stat), so CPU seconds per image = CPU time / images between the third line and the last. From
each run's metrics.jsonl: the trainer's own input_stall (the GPU idle between steps,
fasttrain/input_stall.py) and its loader threads' loader_busy and loader_off_cpu (medians after the
first two log steps). Cores one GPU would need for its input = (jpeg CPU s/image - synthetic CPU
s/image) x the synthetic rate: the CPU the loader adds per image at the rate the GPU trains without it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fasttrain.threads import THREADS_UP_TO

LINE = re.compile(r"step (\d+), loss = \S+ \(([\d.]+) examples/sec")
INPUT = re.compile(r"\| data .*? \((.*)\) \| run dir ")  # the start-up line's input, e.g. "torch, 15 ..."


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def input_fields(run_dir: Path) -> dict:
    """Medians over the log steps after the first two of the trainer's own input measures
    (fasttrain/input_stall.py): input_stall, and with the thread loader loader_busy, loader_off_cpu."""
    try:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return {}
    steady = [r for r in records if "loss" in r][2:]
    out = {}
    for key in ("input_stall", "loader_busy", "loader_off_cpu"):
        values = [r[key] for r in steady if key in r]
        if values:
            out[key] = statistics.median(values)
    return out


def train(argv: list[str], log_path: Path, limit: float, batch: int, run_dir: Path | None = None) -> dict:
    """One trainer run; its lines, rates and CPU time per line (and its input measures, from run_dir)."""
    cmd = [sys.executable, "-m", "fasttrain", *argv]
    lines, result = [], {}
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        timed_out = False
        for text in proc.stdout:
            log.write(text)
            if (said := INPUT.search(text)) and "input" not in result:
                result["input"] = said.group(1)
            match = LINE.search(text)
            if match:
                lines.append(
                    dict(
                        step=int(match.group(1)),
                        examples_per_sec=float(match.group(2)),
                        cpu_s=_cpu_seconds(proc.pid),
                        wall_s=time.monotonic() - start,
                    )
                )
            if time.monotonic() - start > limit:
                proc.kill()
                timed_out = True
                break
        returncode = proc.wait()
    result = dict(command=" ".join(cmd), returncode=returncode, timed_out=timed_out, lines=lines, **result)
    steady = lines[2:]
    if len(steady) >= 2:
        result["images_per_s"] = statistics.median(x["examples_per_sec"] for x in steady)
        first, last = steady[0], steady[-1]
        images = (last["step"] - first["step"]) * batch
        if first["cpu_s"] is not None and last["cpu_s"] is not None and images > 0:
            result["cpu_ms_per_image"] = (last["cpu_s"] - first["cpu_s"]) / images * 1e3
            result["cpu_cores_busy"] = (last["cpu_s"] - first["cpu_s"]) / (last["wall_s"] - first["wall_s"])
    if run_dir is not None:
        result.update(input_fields(run_dir))
    return result


def alone(argv: list[str], log_path: Path, limit: float, batches: int, options: tuple = ()) -> dict:
    """The loader of these trainer flags alone (bench/loader_alone.py, its `options`): rate and CPU."""
    cmd = [sys.executable, "-m", "bench.loader_alone", "--batches", str(batches), *options]
    cmd += ["--skip", str(max(2, batches // 6)), "--", *argv]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        log_path.write_text(" ".join(cmd) + "\n" + (e.stdout or "") + (e.stderr or ""))
        return dict(command=" ".join(cmd), returncode=None, timed_out=True)
    log_path.write_text(" ".join(cmd) + "\n" + run.stdout + run.stderr)
    result = dict(command=" ".join(cmd), returncode=run.returncode, timed_out=False)
    lines = run.stdout.strip().splitlines()
    if run.returncode == 0 and lines:
        result.update(json.loads(lines[-1]))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data_dir", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=0, help="loader workers (default: the CLI's auto)")
    p.add_argument("--limit", type=float, default=120.0, help="seconds for both runs")
    p.add_argument("--dry-run", action="store_true", help="tiny: ResNet-18 at 32 px, batch 8, on the CPU")
    p.add_argument(
        "--warm", action="store_true",
        help="untimed: the synthetic run for 2 steps only, so that inductor's caches hold the trainer's "
        "compiled model (--compile, the default on CUDA) before the timed runs; prints its result",
    )  # fmt: skip
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    workers = args.workers or (2 if args.dry_run else None)  # None: the CLI's --num_workers auto
    count = [] if workers is None else ["--num_workers", str(workers)]
    if args.dry_run:
        batch, steps, every = 8, 12, 2
        size = ["--model", "resnet18", "--image_size", "32", "--base_channels", "8", "--device", "cpu"]
    else:
        batch, steps, every = 256, 160, 10
        size = []
    common = [
        "--recipe", "resnet50_v1.5", "--batch_size", str(batch), "--max_steps", str(steps),
        "--log_every", str(every), "--no-eval_at_end", "--eval_every_epochs", "0", "--no-tensorboard",
        "--checkpoint_every", "100000", *count, *size,
    ]  # fmt: skip
    if args.warm:  # the same model, batch and flags: the same compiled graphs as the timed runs
        shutil.rmtree(work / "warm", ignore_errors=True)
        argv_warm = [*common, "--train_dir", str(work / "warm"), "--data_backend", "synthetic"]
        argv_warm[argv_warm.index("--max_steps") + 1] = "2"
        warm = train(argv_warm, work / "warm.log", args.limit, batch)
        print(json.dumps({k: v for k, v in warm.items() if k != "lines"}))
        return 0 if warm["returncode"] == 0 else 1
    deadline = time.monotonic() + args.limit
    result = dict(batch=batch, steps=steps, log_every=every, workers=workers or "auto")
    result["cpu_count"] = os.cpu_count()
    runs = [
        ("synthetic", ["--data_backend", "synthetic"]),
        ("jpeg", ["--data_backend", "torch", "--data_dir", args.data_dir, "--loader", "threads"]),
        # DataLoader processes instead of threads: no GIL shared by the decoders (bench/bench_input.py).
        ("jpeg-processes", ["--data_backend", "torch", "--data_dir", args.data_dir, "--loader", "processes"]),
    ]
    # The loaders alone: short (a few seconds of draining after their start), so a fixed slice of the
    # time each, kept back from the trainer runs.
    # loader-threads-unfused: the threads with the separate decode and resize calls (3 GIL drops an
    # image, not 1: fasttrain/data/jpeg/fused.py), the fused call's baseline on this machine's cores.
    alone_runs = [
        ("loader-threads", runs[1][1], ()),
        ("loader-threads-unfused", runs[1][1], ("--no-fused",)),
        ("loader-processes", runs[2][1], ()),
    ]
    # Last, in what time is left: both loaders at the count where --loader auto changes from threads
    # to processes (fasttrain/threads.py's THREADS_UP_TO), to say whether that threshold holds here.
    few = 2 if args.dry_run else THREADS_UP_TO
    at_threshold = [
        (f"loader-{kind}-{few}", [*runs[k][1], "--num_workers", str(few)], ())
        for k, kind in ((1, "threads"), (2, "processes"))
    ]
    alone_limit = 20.0 if not args.dry_run else 60.0
    for k, (name, extra, *options) in enumerate(runs + alone_runs + at_threshold):
        left = deadline - time.monotonic()
        if left < 10:
            result[name] = dict(status="not run", reason="time limit")
            continue
        shutil.rmtree(work / name, ignore_errors=True)  # a fresh run, never a resumed or finished one
        argv_run = [*common, "--train_dir", str(work / name), *extra]
        if k >= len(runs):
            batches = 12 if args.dry_run else 60
            limit = min(alone_limit, left - 1)
            result[name] = alone(argv_run, work / f"{name}.log", limit, batches, *options)
        else:  # what is left, less the loaders' slices, split over the trainer runs still to come
            share = (left - alone_limit * len(alone_runs)) / (len(runs) - k)
            result[name] = train(argv_run, work / f"{name}.log", max(share, 10.0), batch, work / name)
        with open(args.out, "w", encoding="utf-8") as f:  # after each run: a kill keeps the first
            json.dump(result, f, indent=1)
    syn = result.get("synthetic", {})
    for name in ("jpeg", "jpeg-processes"):
        jpg = result.get(name, {})
        if "images_per_s" not in syn or "images_per_s" not in jpg:
            continue
        jpg["over_synthetic"] = jpg["images_per_s"] / syn["images_per_s"]
        if "cpu_ms_per_image" in jpg and "cpu_ms_per_image" in syn and name == "jpeg":
            # The thread loader's CPU is the trainer process's; DataLoader workers are other processes.
            input_ms = jpg["cpu_ms_per_image"] - syn["cpu_ms_per_image"]
            result["input_cpu_ms_per_image"] = input_ms
            result["cores_for_synthetic_rate"] = input_ms / 1e3 * syn["images_per_s"]
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    names = [run[0] for run in runs + alone_runs]  # the threshold pair is extra: its time is what is left
    ok = all(result.get(n, {}).get("returncode") == 0 for n in names)
    print(json.dumps({k: v for k, v in result.items() if k not in names}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
