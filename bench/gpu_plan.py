"""What bench/gpu_run.py measures and within which limits: the step-speed settings and columns, each
step's time limits and the least time worth starting it with, the command line, and a step-speed
item's bench.throughput arguments (row_args).

The settings are the first-GPU-run issue's rows, most important first; the columns (f) fasttrain as its
CLI runs it on CUDA (whole-step graph, --compile), (a) with --no-compile, (g) (f) with
--pad_stem, (e) --no-cuda_graph, (h) (a) with --bn_kernels=triton, (b) eager PyTorch, (d)
torch.compile of (b) in default mode and (d-max) in max-autotune-no-cudagraphs (bench/row_steps.py
builds each, bench/throughput.py times it). Seconds in LIMITS and MIN_START come from the first run on an H200
(bench/results/2026-11-27-h200-first-run/): cold compiles of 75-151 s, compiled rows of 33-39 s from
inductor's cache, eager rows of 22-27 s.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Setting:
    """One configuration of the step-speed table."""

    model: str
    precision: str
    batch: int
    image_size: int
    base_channels: int = 64

    @property
    def key(self) -> str:
        return f"{self.model}-{self.precision}-{self.batch}"


# The rows, most important first: ResNet-50 v1.5 bf16 at 256 and 32, the ResNet seed's
# ResNet-101 v2 at its own batch 32 in fp32 (78 img/s on a P40) and bf16, Inception v3 bf16 at 128 and
# the Inception seed's fp32 at 32; last, ResNet-50 at 512 (what a larger per-GPU batch gives, the
# compile-in-graph issue's question; training at it would take LARS).
FULL = [
    Setting("resnet50", "bf16", 256, 224),
    Setting("resnet50", "bf16", 32, 224),
    Setting("resnet101_v2", "fp32", 32, 224),
    Setting("resnet101_v2", "bf16", 32, 224),
    Setting("inception_v3", "bf16", 128, 299),
    Setting("inception_v3", "fp32", 32, 299),
    Setting("resnet50", "bf16", 512, 224),
]
DRY = [Setting("resnet18", "fp32", 4, 32, 8), Setting("resnet18_v2", "fp32", 4, 32, 8)]
# (d-ro): torch.compile with its own CUDA graphs (mode reduce-overhead), what a user picks where
# launches bound the step; (d) and (d-max) have none, so at batch 32 their gap to (f) is mostly launch
# time (the third run: (d)'s kernels 10.8 ms of a 42.8 ms ResNet-101 v2 step, (f)'s 11.6 of 12.1).
# (f-max): fasttrain with --compile_mode max-autotune-no-cudagraphs (inductor's conv and GEMM templates
# autotuned, its reductions tuned by coordinate descent), beside (d-max): the fourth run's (f) and (d)
# spent the same 20.8 ms in the same inductor kernels at ResNet-50 batch 256.
COMPILE_MODES = {
    "d": "default", "d-max": "max-autotune-no-cudagraphs", "d-ro": "reduce-overhead", "f": "default",
    "g": "default", "f-max": "max-autotune-no-cudagraphs",
}  # fmt: skip
COLUMNS = ("a", "f", "g", "e", "b", "d", "d-max", "d-ro", "h", "f-max")
# Columns without a compile, measured in turn in one process (the "aeb" item).
EAGER = ("a", "e", "b", "h")
# Columns that compile, each in a process of its own, warmed in the lane in this order: (g) after (d), so
# that with two compiles at once (g) starts once (f) has put the blocks they share in inductor's cache.
COMPILED = ("f", "d", "g", "d-max", "d-ro", "f-max")
STEPS = ("selfcheck", "gpu_tests", "rows", "kernels", "e2e", "inductor_bw")
# Seconds an item needs at least to be worth starting, and its own limit (GPU; the dry run's in DRY_LIMITS).
# The second run (bench/results/2026-11-27-h200-second-run/): the loaders' kernels took 132 s cold under
# the compile lanes' load; selfcheck (120 s) and the GPU tests (160 s) ran out of time while they compiled
# those kernels themselves (since then `python -m fasttrain.data warm-up` compiles them in nine parts,
# several processes at once: about half the time where 4 or more cores are free, on the CPU VM's
# figures); e2e's trainers compile their model from inductor's cache (--compile, the default on CUDA
# since that run), about 20 s each. The third run (...-2026-11-28-h200-third-run/): Inception v3's two
# cold compiles ((f) and (d)) each ran past 200 s beside the GPU tests and the selfcheck (ResNet-50's
# took 77 and 109 s), so a cold compile now has 300 s.
LIMITS = {
    "preflight": 90, "loader_kernels": 180, "selfcheck": 150, "gpu_tests": 240, "shards": 150,
    "compile": 300, "compile-max": 420, "rows": 100, "d": 70, "kernels": 210, "e2e": 240,
    "inductor_bw": 360,
}  # fmt: skip
# kernels: 60 s until bench/bench_bn.py joined it (5 shapes, each compiled by inductor, about 10 s each,
# and the Triton kernels at 4 geometries).
# inductor_bw (bench/inductor_bw.py) compiles (d) cold with inductor's bandwidth profiler on (ResNet-50's
# plain cold compile took 109 s in the third run), then times each of its kernels once.
MIN_START = {"rows": 25, "d": 20, "d-cold": 100, "d-max": 150, "kernels": 25, "e2e": 200, "inductor_bw": 180}
DRY_LIMITS = {k: 600 for k in LIMITS}


# The GPU tests' files in the order they run (pytest keeps the order of the files it is given): the
# training step's (graph replay, the compiled step, the padded stem) and the kernels' first, the
# trainer's demo on CUDA last (the slowest: a cold start of the CLI), so that a run cut off at its limit
# has the core checks; then every other test file.
GPU_TESTS_FIRST = (
    "test_step.py", "test_stem.py", "test_bn_kernels.py", "test_optim.py", "test_momentum.py",
    "test_rmsprop_tf.py", "test_transforms.py", "test_torch_pipeline.py", "test_torchrun.py",
    "test_dali_pipeline.py",
)  # fmt: skip
GPU_TESTS_LAST = ("test_bench_run.py", "test_cli.py")


def gpu_test_files(root: Path = Path("tests")) -> list[str]:
    names = sorted(p.name for p in root.glob("test_*.py"))
    order = [n for n in GPU_TESTS_FIRST if n in names]
    order += [n for n in names if n not in GPU_TESTS_FIRST and n not in GPU_TESTS_LAST]
    order += [n for n in GPU_TESTS_LAST if n in names]
    return [str(root / n) for n in order]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_run", description="The GPU run, prepared (bench/gpu_run.py's docstring)."
    )
    p.add_argument("--out", required=True, help="results folder (the device tool's $OUT)")
    p.add_argument("--work", default="", help="folder for logs and data (default: a new temporary one)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for everything (default 450)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"of {','.join(STEPS)} (default all)")
    p.add_argument("--columns", default="a,f,g,e,b,d,h", help=f"step-speed columns, of {','.join(COLUMNS)}")
    p.add_argument("--configs", default="", help="setting keys such as resnet50-bf16-256 (default all)")
    p.add_argument(
        "--hide", default="", help="packages made to fail to import (the dry run's DALI, tfrecord)"
    )
    p.add_argument(
        "--compile_workers", type=int, default=2, help="compiles at once in the untimed lane (default 2)"
    )
    p.add_argument("--rows_first", action="store_true", help="every step-speed row before kernels and e2e")
    p.add_argument(
        "--gpu_tests_k", default="",
        help="pytest -k expression for the GPU tests (a rerun of what failed; default: every GPU test)",
    )  # fmt: skip
    p.add_argument(
        "--caches", default=str(Path(__file__).resolve().parents[1] / ".gpu_cache" / "caches.tar.gz"),
        help="an earlier run's caches.tar.gz, unpacked before anything compiles (bench/gpu_caches.py)",
    )  # fmt: skip
    p.add_argument("--commit", default="", help="the checkout's git commit (the device copy has no .git)")
    p.add_argument("--dry-run", action="store_true", help="on the CPU at tiny sizes (CI)")
    p.add_argument(
        "--resume", action="store_true",
        help="a later part with the same --work: skip what an earlier part finished (on a warm machine)",
    )  # fmt: skip
    args = p.parse_args(argv)
    args.steps = [s for s in args.steps.split(",") if s]
    args.column_list = [c for c in args.columns.split(",") if c]
    for flag, values, allowed in (("steps", args.steps, STEPS), ("columns", args.column_list, COLUMNS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            p.error(f"--{flag}: {bad[0]!r} is not one of {', '.join(allowed)}")
    return args


def row_args(
    s: Setting, column: str, result: Path, columns: list[str], dry_run: bool, warm: bool = False
) -> list[str]:
    """`python` arguments of one step-speed item: bench.throughput for `column` of setting `s` ("aeb":
    those of (a), (e), (b), (h) that `columns` asks for, in one process), its rows appended to `result`;
    `warm`: the compile lane's run, nothing timed."""
    spec = dict(
        row=column.split("-")[0], model=s.model, batch=s.batch,
        image_size=s.image_size, base_channels=s.base_channels, precision=s.precision,
        compile_mode=COMPILE_MODES.get(column, "default"),
    )  # fmt: skip
    if dry_run:
        opts = dict(warmup=1, repeats=3, steps=1)
    elif warm:  # compile and run the compiled step a few times: nothing timed
        opts = dict(warmup=1, repeats=1, steps=1)
    else:  # at least 3 windows of about 0.3 s after warm-up, the median reported
        opts = dict(warmup=5, repeats=5, target_seconds=0.3)
    opts["optimizer"] = column == "aeb"  # the update alone, timed in the fasttrain row (a)
    if not warm:  # then where the device time goes, by kind of kernel (bench/step_profile.py)
        opts["profile"] = 1 if dry_run else 3
    args = ["-m", "bench.throughput", "--spec", json.dumps(spec), "--opts", json.dumps(opts)]
    rows = ",".join(c for c in EAGER if c in columns) if column == "aeb" else ""
    return args + (["--rows", rows] if rows else []) + ["--result", str(result)]
