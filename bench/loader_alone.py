"""The trainer's input alone: its loader, built from the trainer's own flags, drained as fast as it goes.

    python -m bench.loader_alone --batches 60 [--no-fused] -- FLAG ... (the trainer's flags: --data_dir, ...)

No model and no step: each batch is handed back as soon as it comes (on CUDA the trainer's pinned ring,
whose release events then complete at once). So the rate is what the loader can give, and beside the
trainer's rate on the same data (bench/gpu_e2e.py) it tells a loader that cannot go faster from one
held back by the training process around it (its main thread, the GPU's release events). Prints one
JSON line: images/s over the batches after the first --skip (start-up, the threads filling their
ring), the CPU time per image of this process and its children (DataLoader workers), and the cores
that kept busy; for the thread loader, where its threads' time went (ThreadTime: busy making images,
off the CPU inside them, idle for a slot or for the GPU) and the main thread's wait for batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=60, help="batches drained in all (default 60)")
    p.add_argument("--skip", type=int, default=10, help="first batches left out of the rate (default 10)")
    p.add_argument(
        "--no-fused", dest="fused", action="store_false",
        help="the ResNet train transform's separate decode and resize calls (three GIL drops an image), "
        "not the fused one (fasttrain/data/jpeg/fused.py): the baseline of the fused call",
    )  # fmt: skip
    p.add_argument("flags", nargs=argparse.REMAINDER, help="the trainer's flags, after --")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from bench.input_serve import tree_cpu_seconds  # noqa: PLC0415 (imports no torch)
    from fasttrain.flags import parse_args  # noqa: PLC0415
    from fasttrain.threads import configure  # noqa: PLC0415

    cfg = parse_args([f for f in args.flags if f != "--"])

    def workers() -> int:  # the trainer's thread policy, before torch loads (fasttrain.__main__)
        from fasttrain.data import startup_workers  # noqa: PLC0415 (imports torch)

        return startup_workers(cfg)

    configure(workers)

    from fasttrain.data import build_loader  # noqa: PLC0415
    from fasttrain.data.jpeg import fused  # noqa: PLC0415

    fused.FUSED = fused.FUSED and args.fused  # read at each call; forked workers inherit it
    from fasttrain.data.loader import batch_stream  # noqa: PLC0415
    from fasttrain.distributed import _pick_device  # noqa: PLC0415 (the trainer's own choice)

    device = _pick_device(cfg.device, 0, distributed=False)
    loader = build_loader(cfg, "train", training=True, device=device, reuse_buffers=True)
    marks = []
    threads = getattr(loader, "thread_time", None)  # the thread loader's (fasttrain.data.thread_loader)
    for count, _ in enumerate(batch_stream(loader, 1), 1):  # across epochs, as the trainer reads
        if count in (args.skip + 1, args.batches):
            marks.append((time.perf_counter(), tree_cpu_seconds(), count, threads() if threads else None))
        if count >= args.batches:
            break
    cfg = getattr(loader, "cfg", cfg)  # --num_workers and --loader auto as the loader resolved them
    result = dict(loader=cfg.loader, workers=cfg.num_workers, batch=cfg.batch_size, cpu_count=os.cpu_count())
    result["fused"] = fused.FUSED
    if len(marks) == 2:
        (t0, c0, n0, s0), (t1, c1, n1, s1) = marks
        images = (n1 - n0) * cfg.batch_size
        result.update(
            images_per_s=images / (t1 - t0),
            cpu_ms_per_image=(c1 - c0) / images * 1e3,
            cpu_cores_busy=(c1 - c0) / (t1 - t0),
            batches_timed=n1 - n0,
        )
        if s0 is not None:  # where the threads' time went: shares of threads x wall time
            spent, span = s1.since(s0), s1.at - s0.at  # the readings' own times: the waits fit in them
            result.update(
                spent.shares(span),
                consumer_wait=spent.consumer_wait_s / span,
                threads_said=spent.describe(span),
            )
    print(json.dumps(result), flush=True)
    return 0 if len(marks) == 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
