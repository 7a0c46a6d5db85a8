"""The loaders' numba kernels: the cold compile of their warm-up, and a doctored stream's time, per commit.

    python -m bench.numba_warm_up --commits BASE,NEW --out DIR [--rounds 2]

For each round and each commit in turn (interleaved): a fresh copy of the commit's tree (`git archive`,
so no numba cache in its __pycache__ folders) and, in a new process with that tree first on sys.path,
the loaders' warm-up (fasttrain.data.torch_pipeline: warm_up() and _warm_up_reader(), as ShardLoader
runs them) timed cold; then, in a second process from the cache it left, the doctored stream
(fasttrain.data.jpeg.doctor.doctor) of 200 random 200 x 250 windows of a 1024 x 512 scikit-image
photograph (quality 90, 4:2:0, row checkpoints), the best of 5 passes, in microseconds a call.
Writes DIR/results.jsonl (one line per commit and round) and DIR/environment.json; prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WARM = """
import time
t = time.perf_counter()
import fasttrain.data.torch_pipeline as p
t1 = time.perf_counter(); p.warm_up(); p._warm_up_reader()
print(time.perf_counter() - t1)
"""

DOCTOR = """
import time, numpy as np, simplejpeg, skimage.data
from fasttrain.data.jpeg import doctor
from fasttrain.data.jpeg.scan import row_checkpoints
image = np.ascontiguousarray(np.concatenate([skimage.data.astronaut()] * 2, 0))
jpeg = simplejpeg.encode_jpeg(image, quality=90, colorsubsampling="420")
cp, (h, w) = row_checkpoints(jpeg), image.shape[:2]
rng = np.random.default_rng(0)
windows = [(int(rng.integers(100, h - 300)), int(rng.integers(0, w - 300)), 200, 250) for _ in range(200)]
doctor.doctor(jpeg, cp, *windows[0])
best = 1e9
for _ in range(5):
    t = time.perf_counter()
    for window in windows:
        doctor.doctor(jpeg, cp, *window)
    best = min(best, time.perf_counter() - t)
print(best / len(windows) * 1e6)
"""


def _run(tree: Path, code: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"numba_warm_up: {tree}: {out.stderr.strip().splitlines()[-1]}")
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--commits", required=True, help="git commits, comma-separated (e.g. HEAD~1,HEAD)")
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    commits = [c for c in args.commits.split(",") if c]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(python=platform.python_version(), machine=platform.machine(), cpus=os.cpu_count())
    env["numba"] = subprocess.run(
        [sys.executable, "-c", "import numba; print(numba.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    env["commits"] = {
        c: subprocess.run(["git", "rev-parse", c], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        for c in commits
    }
    (out / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    rows = []
    with open(out / "results.jsonl", "w", encoding="utf-8") as f:
        for round_ in range(args.rounds):
            for commit in commits:
                with tempfile.TemporaryDirectory() as tmp:
                    archive = subprocess.run(
                        ["git", "archive", commit], cwd=ROOT, capture_output=True, check=True
                    )
                    subprocess.run(["tar", "x", "-C", tmp], input=archive.stdout, check=True)
                    tree = Path(tmp)
                    row = dict(commit=commit, round=round_, warm_up_cold_s=_run(tree, WARM))
                    row["doctor_us"] = _run(tree, DOCTOR)
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(json.dumps(row), flush=True)
    for commit in commits:
        mine = [r for r in rows if r["commit"] == commit]
        warm = statistics.median(r["warm_up_cold_s"] for r in mine)
        doc = statistics.median(r["doctor_us"] for r in mine)
        print(f"{commit}: cold warm-up {warm:.1f} s, doctored stream {doc:.1f} us (medians of {len(mine)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
