"""bench.run's command line: its flags, their defaults (the full suite on a GPU, the smoke configuration
without one), and the (model, batch, px, base_channels) configurations they select."""

import argparse
import os
from pathlib import Path

import torch

PARTS = ("gpu_tests", "rows", "pipeline", "kernels", "compile")
FULL_MODELS = ("resnet50", "resnet101", "inception_v3")


class UsageError(ValueError):
    """A bad flag: printed as one line, exit status 2."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="fasttrain's throughput suite (see bench/results/README.md)")
    p.add_argument("--smoke", action="store_true", help="tiny configuration (default without CUDA)")
    p.add_argument(
        "--out", default="", help="results directory (default ~/.cache/fasttrain/bench/<date>-<gpu>)"
    )
    p.add_argument("--models", default="", help=f"comma-separated (default {','.join(FULL_MODELS)})")
    p.add_argument("--batches", default="", help="comma-separated batch sizes (default 32,256)")
    p.add_argument("--image_size", type=int, default=0, help="px (default: 224, Inception 299)")
    p.add_argument("--rows", default="", help="rows to measure, of a,b,c,d,e (default all; smoke a,b,c)")
    p.add_argument("--parts", default="", help=f"of {','.join(PARTS)} (default all; smoke rows,pipeline)")
    p.add_argument("--data_dir", default="", help="TFRecord shards for the pipeline rows (default synthetic)")
    p.add_argument("--pipeline_rows", default="a:dali,a:torch,b:torch", help="row:backend pairs")
    p.add_argument("--num_workers", type=int, default=0, help="loader workers (default min(16, CPUs))")
    p.add_argument("--warmup", type=int, default=-1, help="untimed steps per row (default 5; smoke 1)")
    p.add_argument("--repeats", type=int, default=0, help="timed windows per row (default 5; smoke 3)")
    p.add_argument("--steps", type=int, default=-1, help="steps per window (default: ~0.3 s; smoke 1)")
    p.add_argument("--compile_mode", default="max-autotune", help="torch.compile mode of row (d)")
    p.add_argument("--compile_timeout", type=float, default=240.0, help="seconds per (d) configuration")
    p.add_argument("--time_budget", type=float, default=530.0, help="seconds for the whole run")
    p.add_argument("--merge", action="store_true", help="merge into --out's existing results.json")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    args.smoke = args.smoke or not cuda
    args.models = _list(args.models) or (["resnet18"] if args.smoke else list(FULL_MODELS))
    bad = [m for m in args.models if m not in ("resnet18", "resnet34", "resnet152", *FULL_MODELS)]
    if bad:
        raise UsageError(
            f"--models: unknown model {bad[0]!r}; choose from resnet18/34/50/101/152, inception_v3"
        )
    try:
        args.batches = [int(b) for b in _list(args.batches)] or ([4, 8] if args.smoke else [32, 256])
    except ValueError:
        raise UsageError(f"--batches takes comma-separated integers, got {args.batches!r}") from None
    args.rows = _list(args.rows) or (["a", "b", "c"] if args.smoke else ["a", "b", "c", "d", "e"])
    args.parts = _list(args.parts) or (["rows", "pipeline"] if args.smoke else list(PARTS))
    for name, values, allowed in (("rows", args.rows, "abcde"), ("parts", args.parts, PARTS)):
        unknown = [v for v in values if v not in allowed]
        if unknown:
            raise UsageError(f"--{name}: {unknown[0]!r} is not one of {', '.join(allowed)}")
    args.pipeline_rows = [tuple(x.split(":")) for x in _list(args.pipeline_rows)]
    if any(len(x) != 2 or x[0] not in "abc" or x[1] not in ("torch", "dali") for x in args.pipeline_rows):
        raise UsageError("--pipeline_rows takes row:backend pairs such as a:torch,b:dali (rows a-c)")
    if args.data_dir and not Path(args.data_dir).is_dir():
        raise UsageError(f"--data_dir {args.data_dir} is not a directory")
    # Two cores stay free for the training process and its pin-memory thread.
    args.num_workers = args.num_workers or (1 if args.smoke else max(1, min(16, (os.cpu_count() or 1) - 2)))
    args.warmup = args.warmup if args.warmup >= 0 else (1 if args.smoke else 5)
    args.repeats = args.repeats or (3 if args.smoke else 5)
    args.steps = args.steps if args.steps >= 0 else (1 if args.smoke else 0)
    return args


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def configurations(args) -> list[tuple[str, int, int, int]]:
    """(model, batch, px, base_channels) per configuration; the smoke pairs 32 px/4 and 64 px/8."""
    if args.smoke:
        sizes = [args.image_size or (32 if i == 0 else 64) for i in range(len(args.batches))]
        return [
            (m, b, s, 16 if m.startswith("resnet") else 64)
            for m in args.models
            for b, s in zip(args.batches, sizes)
        ]
    return [
        (m, b, args.image_size or (299 if m == "inception_v3" else 224), 64)
        for m in args.models
        for b in args.batches
    ]
