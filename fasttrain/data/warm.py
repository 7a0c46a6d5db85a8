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

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from numba.core import event


def _resnet() -> None:
    # The fused ResNet v1.5 crop and its check against the separate calls (decode_window_rows, the
    # bilinear resize), which compiles both.
    from fasttrain.data.jpeg import fused

    fused.checked()


def _inception() -> None:
    from fasttrain.data.jpeg import fused

    fused.warm_up_inception()


def _vgg() -> None:
    from fasttrain.data import vgg

    vgg.warm_up()


def _resize(method: str) -> Callable[[], None]:
    def part() -> None:
        from fasttrain.data import resize

        resize.warm_up((method,))

    return part


def _color() -> None:
    from fasttrain.data import color

    color.warm_up()


def _reader() -> None:
    from fasttrain.data.torch_pipeline import _warm_up_reader

    _warm_up_reader()


# Longest first, so that the longest start at once (cold, two at a time on the 2-core VM: vgg 24-28 s,
# resnet 23-26 s, inception 12-14 s, the others 2-9 s).
PARTS: dict[str, Callable[[], None]] = {
    "vgg": _vgg,
    "resnet": _resnet,
    "inception": _inception,
    "resize-bicubic": _resize("bicubic"),
    "reader": _reader,
    "resize-area": _resize("area"),
    "resize-nearest": _resize("nearest"),
    "resize-bilinear": _resize("bilinear"),
    "color": _color,
}


def warm_up_all() -> None:
    """Compile (or load from numba's cache) every kernel the loaders run, in this process."""
    from fasttrain.data.torch_pipeline import _warm_up_reader
    from fasttrain.data.transforms import warm_up

    warm_up()
    _warm_up_reader()


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
    with event.install_recorder("numba:compile") as compiles:  # a load from the cache is no compile
        warm_up_all()
    here = sorted({e.data["dispatcher"].py_func.__qualname__ for _, e in compiles.buffer})
    here_s = time.monotonic() - t0
    return dict(parts=seconds, failed=failed, parts_s=parts_s, here_s=here_s, compiled_here=here)


def default_jobs() -> int:
    """The cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
