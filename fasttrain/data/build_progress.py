"""A build's progress lines (fasttrain.data.build_run): 'done/total images, rate, ETA' every interval,
from the main loop between shards and, where the shards are written in the main process itself (one
worker), from a thread of its own while a shard runs."""

from __future__ import annotations

import threading
import time


def progress_line(out, done: int, total: int, start: float) -> float:
    """Write 'done/total images, rate images/s, ETA'; returns when (time.perf_counter)."""
    now = time.perf_counter()
    rate = done / max(now - start, 1e-9)
    eta = f"{(total - done) / rate / 60:.1f} min" if rate > 0 else "not yet known"
    out(f"{done}/{total} images, {rate:.0f} images/s, ETA {eta}")
    return now


class Ticker:
    """Calls `line()` every `seconds` (a daemon thread) once that long has passed since last[0] (the time
    the last line was written, by either writer); with `seconds` 0 (tests: a line after every shard) it
    writes none of its own."""

    def __init__(self, line, last: list[float], seconds: float):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(line, last, seconds), daemon=True)
        if seconds > 0:
            self._thread.start()

    def _run(self, line, last: list[float], seconds: float) -> None:
        while not self._stop.wait(seconds / 4):
            if time.perf_counter() - last[0] >= seconds:
                last[0] = line()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
