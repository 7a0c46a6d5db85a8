"""The timing loop every row of bench/bench_input.py runs in its own process (stdlib only: the
TensorFlow row imports it without torch, so it times with time.perf_counter rather than
bench/common.py's `timed`; every row yields host batches, so the wall clock is the measure).

The driver writes one JSON command per line to the row's stdin; the row answers each with one line
`@@ {json}` on stdout (other output, such as library warnings, is ignored by the driver):

    {"cmd": "warmup", "batches": W}   W batches untimed except as a whole (worker start, tracing,
                                      shuffle-buffer fill); answers seconds, shape and dtype
    {"cmd": "window", "drain": D, "batches": N}
                                      D batches untimed, then N batches timed: the seconds of the N,
                                      and cpu_seconds: user + system CPU time of the row's process
                                      tree over them (`tree_cpu_seconds`)
    {"cmd": "quit"}

Between its windows a row is idle while the driver times the others, and its prefetch buffers fill
up (a DataLoader holds 2 batches per worker, DALI 2, tf.data's AUTOTUNE prefetch a few): those
batches would arrive at once and inflate the next window. So each window first takes D batches,
D above every row's buffer depth, and times only the batches made after them.
"""

from __future__ import annotations

import json
import os
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
            c0, t0 = tree_cpu_seconds(), time.perf_counter()
            for _ in range(cmd["batches"]):
                batch = next(batches)
            seconds, cpu = time.perf_counter() - t0, tree_cpu_seconds() - c0
            reply(
                seconds=seconds,
                cpu_seconds=cpu,
                batches=cmd["batches"],
                **(describe(batch) if cmd["cmd"] == "warmup" else {}),
            )
    except Exception as exc:  # a missing library, a bad shard: reported to the driver as the row's status
        traceback.print_exc(file=sys.stderr)
        reply(error=f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}")


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process, its threads and every descendant process (alive,
    or ended and reaped: the kernel adds those to the parent's cutime/cstime), from /proc."""
    parent_of, times = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        except OSError:  # ended meanwhile
            continue
        pid = int(entry)
        parent_of[pid] = int(fields[1])  # field 4 of stat(5): ppid
        times[pid] = sum(int(x) for x in fields[11:15])  # fields 14-17: utime stime cutime cstime
    me, total = os.getpid(), 0
    for pid, ticks in times.items():
        p = pid
        while p not in (me, 0, 1) and p in parent_of:
            p = parent_of[p]
        if p == me:
            total += ticks
    return total / os.sysconf("SC_CLK_TCK")
