"""The timing loop every row of bench/bench_input.py runs in its own process (stdlib only: the
TensorFlow row imports it without torch, so it times with time.perf_counter rather than
bench/common.py's `timed`; every row yields host batches, so the wall clock is the measure).

The driver writes one JSON command per line to the row's stdin; the row answers each with one line
`@@ {json}` on stdout (other output, such as library warnings, is ignored by the driver):

    {"cmd": "warmup", "batches": W}   W batches untimed except as a whole (worker start, tracing,
                                      shuffle-buffer fill); answers seconds, shape and dtype
    {"cmd": "window", "drain": D, "batches": N}
                                      D batches untimed, then N batches timed: the seconds of the N
    {"cmd": "quit"}

Between its windows a row is idle while the driver times the others, and its prefetch buffers fill
up (a DataLoader holds 2 batches per worker, DALI 2, tf.data's AUTOTUNE prefetch a few): those
batches would arrive at once and inflate the next window. So each window first takes D batches,
D above every row's buffer depth, and times only the batches made after them.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator


def reply(**fields) -> None:
    sys.stdout.write("@@ " + json.dumps(fields) + "\n")
    sys.stdout.flush()


def serve(make_batches: Callable[[], Iterator], describe: Callable[[object], dict]) -> None:
    """Answer the driver's commands. make_batches() -> endless iterator of batches; describe(batch) ->
    {"shape": [...], "dtype": "..."}. Any failure is answered as {"error": one line} and ends the row."""
    try:
        batches = make_batches()
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            for _ in range(cmd.get("drain", 0)):
                next(batches)
            t0 = time.perf_counter()
            for _ in range(cmd["batches"]):
                batch = next(batches)
            seconds = time.perf_counter() - t0
            reply(
                seconds=seconds, batches=cmd["batches"], **(describe(batch) if cmd["cmd"] == "warmup" else {})
            )
    except Exception as exc:  # a missing library, a bad shard: reported to the driver as the row's status
        traceback.print_exc(file=sys.stderr)
        reply(error=f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}")
