"""CPU threads under load: torch's defaults against fasttrain's policy (fasttrain/threads.py), in one run.

    python -m bench.bench_threads [--out DIR] [--rounds 3] [--steps 100] [--busy 0,1,2]

Two measurements, each contender in its own process (the OpenMP wait policy is read once, when torch
loads), the contenders interleaved and their order alternated per round:

demo     `python -m fasttrain` (the demo recipe: ResNet-18/16 channels, 64 px, batch 32, 2 loader
         workers) for --steps steps beside 0, 1 and 2 busy processes (`python -c "while True: pass"`).
         old = FASTTRAIN_THREADS=off (torch's defaults: one intra-op thread per core, libgomp's
         spin-wait); new = fasttrain's policy. Step time = the mean sec/batch of metrics.jsonl's
         windows after the first (warm-up: imports, numba's cache, the workers' start); CPU time =
         user + sys of the trainer and its workers (os.wait4), per image over all steps.
sequence one CPU optimizer step (kernels/cpu.py: momentum + EMA over 25.6 M fp32 parameters, a
         ResNet-50) and then a 3x3 convolution forward (--conv_batch x 256 x 56 x 56, 256 filters), as
         a training step does: the convolution before the step, right after it, and 1 s later, with
         the process's CPU time beside the wall time (spinning threads show up as CPU time).

The machine is shared: /proc/loadavg is recorded before and after each measurement. Output:
results.json (every window) and results.md (medians over rounds) in --out (default: the user's
cache, ~/.cache/fasttrain/bench/<date>-cpu-threads; never inside the checkout unless asked).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"old": {"FASTTRAIN_THREADS": "off"}, "new": {}}
BUSY_LOOP = [sys.executable, "-c", "while True: pass"]


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0] if Path("/proc/loadavg").exists() else "?"


def child_env(policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(POLICIES[policy], PYTHONPATH=str(ROOT))
    return env


def start_busy(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(BUSY_LOOP) for _ in range(count)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def run_demo(policy: str, steps: int, busy: int) -> dict:
    """One demo run beside `busy` busy loops; step times from its metrics.jsonl."""
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "fasttrain",
            f"--train_dir={tmp}/run",
            f"--max_steps={steps}",
            "--no-eval_at_end",
            "--no-tensorboard",
            f"--log_every={max(1, steps // 5)}",
            f"--checkpoint_every={steps * 10}",
        ]
        loads = [load()]
        procs = start_busy(busy)
        try:
            time.sleep(0.5 if busy else 0)  # the loops are running before the trainer starts
            start = time.perf_counter()
            with open(f"{tmp}/log", "wb") as log:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=child_env(policy), stdout=log, stderr=subprocess.STDOUT
                )
                _, status, usage = os.wait4(proc.pid, 0)  # usage: the trainer and its reaped workers
                proc.returncode = os.waitstatus_to_exitcode(status)
            wall = time.perf_counter() - start
        finally:
            stop_busy(procs)
        loads.append(load())
        if proc.returncode != 0:
            raise SystemExit(
                f"demo run failed ({policy}, busy {busy}):\n{Path(tmp, 'log').read_text()[-2000:]}"
            )
        records = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
        windows = [r["sec_per_batch"] for r in records if "sec_per_batch" in r]
        threads_line = [x for x in Path(tmp, "log").read_text().splitlines() if "CPU threads" in x]
    return dict(
        policy=policy,
        busy=busy,
        steps=steps,
        wall_s=wall,
        windows_s=windows,
        step_s=statistics.mean(windows[1:]),
        cpu_s=usage.ru_utime + usage.ru_stime,
        cpu_ms_per_image=(usage.ru_utime + usage.ru_stime) / (steps * 32) * 1e3,
        threads=threads_line[0] if threads_line else "torch defaults",
        load=loads,
    )


def sequence_child(conv_batch: int, repeats: int) -> None:
    """In its own process: the optimizer step then the convolution; prints one JSON line."""
    from fasttrain.threads import configure

    policy = configure(0)  # before torch: FASTTRAIN_THREADS=off makes this a no-op (the old way)
    import torch
    from fasttrain.kernels import chunked

    n = 25_557_032  # ResNet-50's parameters
    gen = torch.Generator().manual_seed(0)
    w, g, acc, ema = (torch.randn(n, generator=gen) for _ in range(4))
    scratch = chunked.new_scratch("cpu")
    ema_weight = torch.tensor(1e-4)
    conv = torch.nn.Conv2d(256, 256, 3, padding=1, bias=False)
    x = torch.randn(conv_batch, 256, 56, 56, generator=gen)

    def forward():
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            conv(x)
        return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3

    def step():
        wall = time.perf_counter()
        chunked.momentum_update_chunked(
            w, g, acc, ema, lr=0.1, momentum=0.9, weight_decay=1e-4, ema_weight=ema_weight, scratch=scratch
        )
        return (time.perf_counter() - wall) * 1e3

    forward(), step(), forward()  # warm-up: numba's cache, oneDNN's primitive, first-touch pages
    rows = []
    for _ in range(repeats):
        time.sleep(1.0)
        before = forward()
        opt = step()
        after = forward()
        time.sleep(1.0)
        later = forward()
        rows.append(dict(before=before, optimizer_ms=opt, after=after, later=later))
    print(json.dumps(dict(threads=policy.describe(), torch_threads=torch.get_num_threads(), rows=rows)))


def run_sequence(policy: str, busy: int, conv_batch: int, repeats: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_threads",
        "--child_sequence",
        f"--conv_batch={conv_batch}",
        f"--repeats={repeats}",
    ]
    loads = [load()]
    procs = start_busy(busy)
    try:
        time.sleep(0.5 if busy else 0)
        out = subprocess.run(cmd, cwd=ROOT, env=child_env(policy), capture_output=True, text=True, check=True)
    finally:
        stop_busy(procs)
    loads.append(load())
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = result.pop("rows")
    summary = {key: statistics.median(r[key][0] for r in rows) for key in ("before", "after", "later")} | {
        f"{key}_cpu": statistics.median(r[key][1] for r in rows) for key in ("before", "after", "later")
    }
    summary["optimizer_ms"] = statistics.median(r["optimizer_ms"] for r in rows)
    return dict(
        policy=policy, busy=busy, conv_batch=conv_batch, rows=rows, median=summary, load=loads, **result
    )


def markdown(results: dict) -> str:
    lines = [f"# CPU threads: torch's defaults (old) against fasttrain's policy (new), {results['date']}", ""]
    lines += [
        f"`{results['command']}`; commit {results['commit']}; {results['cpu']}; "
        f"{results['cores']} cores. Load (1 min) before/after each run in results.json.",
        "",
    ]
    demo = results["demo"]
    if demo:
        idle = {
            p: statistics.median(r["step_s"] for r in demo if r["policy"] == p and r["busy"] == 0)
            for p in POLICIES
            if any(r["policy"] == p and r["busy"] == 0 for r in demo)
        }
        lines += [
            "## Demo step time (median over rounds of the mean sec/batch after warm-up)",
            "",
            "| busy processes | old ms/step | new ms/step | old / idle old | new / idle new | "
            "old CPU ms/img | new CPU ms/img | load before..after (min-max) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for busy in sorted({r["busy"] for r in demo}):
            cell, ratio, cpu = {}, {}, {}
            for p in POLICIES:
                rs = [r for r in demo if r["policy"] == p and r["busy"] == busy]
                if rs:
                    cell[p] = statistics.median(r["step_s"] for r in rs)
                    ratio[p] = f"{cell[p] / idle[p]:.2f}x" if p in idle else "-"
                    cpu[p] = statistics.median(r["cpu_ms_per_image"] for r in rs)
            rs = [r for r in demo if r["busy"] == busy]
            loads = [float(x) for r in rs for x in r["load"] if x != "?"]
            lines.append(
                f"| {busy} | {cell.get('old', 0) * 1e3:.0f} | {cell.get('new', 0) * 1e3:.0f} | "
                f"{ratio.get('old')} | "
                f"{ratio.get('new')} | {cpu.get('old', 0):.1f} | {cpu.get('new', 0):.1f} | "
                f"{min(loads, default=0):.2f}..{max(loads, default=0):.2f} |"
            )
        lines += [
            "",
            "Per round (ms/step, in the order run): "
            + "; ".join(f"{r['policy']}/{r['busy']} busy {r['step_s'] * 1e3:.0f}" for r in demo),
            "",
        ]
        threads = sorted({r["threads"] for r in demo})
        lines += ["Thread settings seen: " + "; ".join(f"`{t}`" for t in threads), ""]
    seq = results["sequence"]
    if seq:
        lines += [
            "## Optimizer step, then a 3x3 convolution",
            "",
            "ms, median over repeats; the process's CPU ms in brackets.",
            "",
            "| policy | busy | threads | conv before | optimizer | conv right after | conv 1 s later "
            "| load |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in seq:
            m = r["median"]
            lines.append(
                f"| {r['policy']} | {r['busy']} | {r['torch_threads']} | "
                f"{m['before']:.0f} ({m['before_cpu']:.0f}) | "
                f"{m['optimizer_ms']:.0f} | {m['after']:.0f} ({m['after_cpu']:.0f}) | {m['later']:.0f} "
                f"({m['later_cpu']:.0f}) | {r['load'][0]}..{r['load'][1]} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="CPU threads under load: torch's defaults vs fasttrain's policy")
    p.add_argument(
        "--out", default="", help="results directory (default ~/.cache/fasttrain/bench/<date>-cpu-threads)"
    )
    p.add_argument("--rounds", type=int, default=3, help="repeats of every (policy, busy) demo run")
    p.add_argument("--steps", type=int, default=100, help="demo steps per run")
    p.add_argument("--busy", default="0,1,2", help="busy-process counts beside the demo")
    p.add_argument("--parts", default="demo,sequence", help="of demo,sequence")
    p.add_argument("--conv_batch", type=int, default=32, help="batch of the sequence's convolution")
    p.add_argument("--repeats", type=int, default=5, help="optimizer+convolution sequences per process")
    p.add_argument("--sequence_busy", default="0,1", help="busy-process counts beside the sequence")
    p.add_argument("--child_sequence", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_sequence:
        sequence_child(args.conv_batch, args.repeats)
        return 0
    from fasttrain.config import default_cache_dir

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = Path(args.out) if args.out else default_cache_dir() / "bench" / f"{date[:10]}-cpu-threads"
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    cpu = (
        next(
            (
                x.split(":", 1)[1].strip()
                for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")
            ),
            "?",
        )
        if Path("/proc/cpuinfo").exists()
        else "?"
    )
    command = "python -m bench.bench_threads " + " ".join(argv or sys.argv[1:])
    results = dict(
        date=date,
        command=command,
        commit=commit.stdout.strip() or "?",
        cpu=cpu,
        cores=os.cpu_count(),
        demo=[],
        sequence=[],
    )
    parts = args.parts.split(",")

    def save():
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "results.md").write_text(markdown(results))

    for rnd in range(args.rounds if "demo" in parts else 0):
        for busy in [int(b) for b in args.busy.split(",")]:
            order = list(POLICIES) if (rnd + busy) % 2 == 0 else list(POLICIES)[::-1]
            for policy in order:
                r = run_demo(policy, args.steps, busy)
                print(
                    f"demo round {rnd} {policy} busy {busy}: {r['step_s'] * 1e3:.0f} ms/step, "
                    f"load {r['load'][0]}..{r['load'][1]}",
                    flush=True,
                )
                results["demo"].append(r)
                save()
    if "sequence" in parts:
        for busy in [int(b) for b in args.sequence_busy.split(",")]:
            for policy in POLICIES:
                r = run_sequence(policy, busy, args.conv_batch, args.repeats)
                print(f"sequence {policy} busy {busy}: {r['median']}", flush=True)
                results["sequence"].append(r)
                save()
    save()
    print(f"wrote {out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
