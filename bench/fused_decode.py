"""The loader threads' fused decode (fasttrain/data/jpeg/fused.py) against its separate calls, on the CPU.

    python -m bench.fused_decode --data_dir SHARDS --out DIR [--rounds 3] [--threads 2] [--batches 70]

SHARDS: JPEG TFRecord shards with their row checkpoints (python -m bench.photo_shards SHARDS, then
python -m fasttrain.data row-checkpoints SHARDS). For each seed's train transform (ResNet v1.5's
resnet50_v1.5, the ResNet seed's vgg resnet101, Inception v3 with colour) it runs bench.loader_alone
with and without --no-fused:

- GIL takes per image: perf's count of CPython's take_gil (a uprobe on the libpython this Python
  runs: `perf probe -x LIBPYTHON take_gil`, made here if missing; root) over one loader thread's run
  of --short and of --long batches, the difference divided by the images between them, so the
  start-up cancels out. Skipped, with the reason, where perf or the probe is not at hand.
- images/s and CPU ms per image: --rounds interleaved rounds of --threads threads, --batches batches
  each (the first 10 left out), fused and separate calls in turn.

Writes DIR/results.jsonl (one JSON line per run: the loader's own line, the mode and round) and
DIR/environment.json, and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

RECIPES = ("resnet50_v1.5", "resnet101", "inception_v3")
MODES = {"fused": [], "separate": ["--no-fused"]}


def _loader(recipe: str, mode: str, threads: int, batches: int, args, perf=()) -> subprocess.CompletedProcess:
    """bench.loader_alone's run (its JSON line last on stdout; perf's count on stderr)."""
    cmd = [*perf, sys.executable, "-m", "bench.loader_alone", "--batches", str(batches), "--skip"]
    cmd += [str(min(10, batches // 6)), *MODES[mode], "--", "--recipe", recipe, "--batch_size", "64"]
    cmd += ["--data_backend", "torch", "--data_dir", args.data_dir, "--device", "cpu"]
    cmd += ["--num_workers", str(threads), "--train_dir", str(Path(args.out) / "train_dir")]
    return subprocess.run(cmd, capture_output=True, text=True, check=True)


def _probe() -> str:
    """The perf event counting take_gil in this Python's libpython, or '' with the reason printed."""
    lib = Path(sysconfig.get_config_var("LIBDIR") or "") / (sysconfig.get_config_var("LDLIBRARY") or "")
    if shutil.which("perf") is None or not lib.name.startswith("libpython") or not lib.exists():
        print(f"GIL takes not counted: needs perf and a shared libpython (have {lib})", file=sys.stderr)
        return ""
    listed = subprocess.run(["perf", "probe", "-l"], capture_output=True, text=True).stdout
    if not re.search(r"\w+:take_gil\s", listed):
        made = subprocess.run(["perf", "probe", "-x", str(lib), "take_gil"], capture_output=True, text=True)
        listed = subprocess.run(["perf", "probe", "-l"], capture_output=True, text=True).stdout
        if made.returncode or not re.search(r"\w+:take_gil\s", listed):
            print(f"GIL takes not counted: perf probe failed: {made.stderr.strip()[-200:]}", file=sys.stderr)
            return ""
    return re.search(r"(\w+:take_gil)\s", listed).group(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, default=70)
    p.add_argument("--short", type=int, default=12, help="batches of the shorter perf run (default 12)")
    p.add_argument("--long", type=int, default=42, help="batches of the longer perf run (default 42)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True)
    import numba  # noqa: PLC0415

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    env = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S"), commit=commit.stdout.strip(),
        python=platform.python_version(), numba=numba.__version__,
        cpu=model.group(1) if model else platform.machine(), cores=os.cpu_count(),
        load_before=os.getloadavg(),
    )  # fmt: skip
    event, rows = _probe(), []
    with open(out / "results.jsonl", "w", encoding="utf-8") as f:
        for recipe in RECIPES:
            for mode in MODES if event else ():
                counts = []
                for batches in (args.short, args.long):
                    perf = ["perf", "stat", "-x", ",", "-e", event, "--"]
                    text = _loader(recipe, mode, 1, batches, args, perf).stderr
                    counts.append(int(re.search(rf"^(\d+),,{re.escape(event)}", text, re.M).group(1)))
                takes = (counts[1] - counts[0]) / ((args.long - args.short) * 64)
                rows.append(dict(kind="gil", recipe=recipe, mode=mode, counts=counts, takes_per_image=takes))
                f.write(json.dumps(rows[-1]) + "\n")
            for r in range(args.rounds):
                for mode in MODES:
                    text = _loader(recipe, mode, args.threads, args.batches, args).stdout
                    line = json.loads(text.splitlines()[-1])
                    rows.append(dict(kind="rate", recipe=recipe, mode=mode, round=r, **line))
                    f.write(json.dumps(rows[-1]) + "\n")
                    f.flush()
    env["load_after"] = os.getloadavg()
    (out / "environment.json").write_text(json.dumps(env, indent=1))
    shutil.rmtree(out / "train_dir", ignore_errors=True)
    for recipe in RECIPES:
        line = [recipe]
        for mode in MODES:
            mine = [x for x in rows if x["recipe"] == recipe and x["mode"] == mode]
            gil = [f", {x['takes_per_image']:.2f} GIL takes/img" for x in mine if x["kind"] == "gil"]
            rate = [x for x in mine if x["kind"] == "rate"]
            ips = statistics.median(x["images_per_s"] for x in rate)
            cpu = statistics.median(x["cpu_ms_per_image"] for x in rate)
            line.append(f"{mode}: {ips:,.0f} img/s, {cpu:.3f} CPU ms/img" + "".join(gil))
        print(" | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
