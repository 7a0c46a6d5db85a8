"""The input pipeline's numba kernels compiled ahead, several processes at once:
`python -m fasttrain.data warm-up [--jobs N]`.

Every process that decodes JPEGs runs fasttrain's numba kernels. numba keeps each compiled kernel in its
disk cache (the __pycache__ folders beside the sources, or NUMBA_CACHE_DIR), so where they ran once
they load in about a second. The first time, they compile: on a new machine, for a new fasttrain
version, in a fresh checkout (numba keys the cache on each source file's time stamp). That compile
runs on one core: about 50 s on the project's 2-core VM and 132 s on the H200 machine beside other
work (bench/results/2026-11-27-cpu-numba-warm-up/, the second GPU run).

Here the kernels are split into PARTS, and each part compiles in a process of its own, `jobs` at a time,
longest first. The parts share callees (the doctored JPEG stream, the window decode), and each part
compiles those again, so the parts take about 1.8x the CPU time of one process. On the 2-core VM the
wall time is that of one process (47.6 and 53.7 s with --jobs 2, against 49.7 and 54.9 s;
bench/results/2026-11-27-cpu-numba-warm-up-parallel/). With 4 or more free cores the longest part
(vgg's, about 25 s there) would set it: about half, an estimate the GPU run's 16 cores will measure.
After the parts, the caller's own warm-up (`warm_up_all`, as the loaders run it) loads every kernel from
the cache, and compiles whatever a part did not leave there (a part that failed, a cache directory it
could not write). So a failure here costs time, never a wrong kernel.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from numba.core import event

from fasttrain.data import color, resize, vgg
from fasttrain.data.example import encode_example
from fasttrain.data.imagenet import SampleDecoder
from fasttrain.data.jpeg import fused
from fasttrain.data.seeding import SampleGenerator
from fasttrain.data.tfrecord import RecordBuffer
from fasttrain.data.transforms import sample_distorted_bounding_box
from fasttrain.data.transforms import warm_up as transforms_warm_up


def _resize(method: str) -> Callable[[], None]:
    return lambda: resize.warm_up((method,))


def warm_up_reader() -> None:
    """Compile (or load from numba's disk cache) SampleReader's own kernels (the Example scan, the
    seeding, the crop search) here, once, rather than in each worker's or thread's first sample."""
    rng = SampleGenerator().seeded((0, 0, 0))
    no_boxes = np.zeros((0, 4), np.float32)
    for writeable in (False, True):  # read-only arrays (the shared "no boxes") compile apart
        no_boxes.flags.writeable = writeable
        sample_distorted_bounding_box(rng, 2, 2, no_boxes)
    payload = encode_example({"image/encoded": b"", "image/class/label": 0})
    buffer = RecordBuffer(len(payload) + 16)
    buffer.data[12 : 12 + len(payload)] = payload  # where RecordBuffer.read puts it
    SampleDecoder(0, 1).decode(buffer, buffer.view[12 : 12 + len(payload)], "(warm-up)", 0)


# Longest first, so that the longest start at once (cold, two at a time on the 2-core VM: vgg 24-28 s,
# resnet 23-26 s, inception 12-14 s, the others 2-9 s).
PARTS: dict[str, Callable[[], None]] = {
    "vgg": vgg.warm_up,
    "resnet": fused.checked,  # the fused ResNet v1.5 crop and its check against the separate calls
    "inception": fused.warm_up_inception,
    "resize-bicubic": _resize("bicubic"),
    "reader": warm_up_reader,
    "resize-area": _resize("area"),
    "resize-nearest": _resize("nearest"),
    "resize-bilinear": _resize("bilinear"),
    "color": color.warm_up,
}


def warm_up_all() -> None:
    """Compile (or load from numba's cache) every kernel the loaders run, in this process."""
    transforms_warm_up()
    warm_up_reader()


def compiled_by(warm_up: Callable[[], None]) -> list[str]:
    """Run warm_up; the kernels numba compiled meanwhile (a load from its cache is no compile)."""
    with event.install_recorder("numba:compile") as compiles:
        warm_up()
    return sorted({e.data["dispatcher"].py_func.__qualname__ for _, e in compiles.buffer})


def cold() -> bool:
    """Whether numba's cache lacks this fasttrain's kernels: colour's small kernels (about 2 s to compile,
    milliseconds to load) compiled just now rather than loaded. A cache stale for other modules only
    (one source file edited) reads as warm, and those compile where the caller warms up."""
    return bool(compiled_by(color.warm_up))


def parallel_jobs(ranks: int, cores: int) -> int:
    """Processes for the parts in a loader's warm-up: 1 (none: compile in the caller) where the node has
    several ranks (each warms up; their parts would crowd the cores) or fewer than 4 cores (2 gain
    nothing, bench/results/2026-11-27-cpu-numba-warm-up-parallel/), else the cores, at most one a part."""
    if ranks > 1 or cores < 4:
        return 1
    return min(cores, len(PARTS))


def run_part(name: str) -> None:
    PARTS[name]()


def warm_up_parallel(jobs: int, limit: float = 900.0, say: Callable[[str], None] | None = None) -> dict:
    """Every part in a process of its own, `jobs` at a time, then `warm_up_all` here (from the cache).

    Returns {"parts": {name: seconds, or None where it failed or ran past `limit`}, "failed": [names],
    "parts_s": wall seconds of the parts, "here_s": this process's warm-up after them, "compiled_here":
    the kernels it compiled, not loaded from the cache (none, unless a part failed)}. `say` gets a line
    as each part ends."""
    say = say or (lambda line: None)
    # The parts run where this process's fasttrain is first on their path (a `python -c` puts its
    # working directory first), so they compile the same sources into the same cache.
    root = str(Path(__file__).resolve().parents[2])
    pending, running = list(PARTS), {}
    seconds: dict[str, float | None] = {}
    failed: list[str] = []
    started = time.monotonic()
    try:
        while pending or running:
            while pending and len(running) < max(1, jobs):
                name = pending.pop(0)
                code = f"from fasttrain.data.warm import run_part; run_part({name!r})"
                err = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty part never blocks
                proc = subprocess.Popen(
                    [sys.executable, "-c", code], cwd=root, stdout=subprocess.DEVNULL, stderr=err
                )
                running[name] = (proc, time.monotonic(), err)
            time.sleep(0.05)
            for name, (proc, t0, err) in list(running.items()):
                if proc.poll() is None and time.monotonic() - started <= limit:
                    continue
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                del running[name]
                err.seek(0)
                last = err.read().strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
                err.close()
                took = time.monotonic() - t0
                seconds[name] = took if proc.returncode == 0 else None
                if proc.returncode == 0:
                    say(f"warm-up: {name} {took:.1f} s")
                else:
                    failed.append(name)
                    say(f"warm-up: {name} failed after {took:.1f} s ({last[0][:200]}); compiled here instead")
    finally:
        for proc, _, err in running.values():  # an interrupt or an error here: no part outlives it
            proc.kill()
            proc.wait()
            err.close()
    parts_s = time.monotonic() - started
    t0 = time.monotonic()
    here = compiled_by(warm_up_all)
    here_s = time.monotonic() - t0
    return dict(parts=seconds, failed=failed, parts_s=parts_s, here_s=here_s, compiled_here=here)
