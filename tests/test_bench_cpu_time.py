"""bench/input_serve.py's tree_cpu_seconds: the CPU time of a row's whole process tree (its DataLoader
workers included), which bench/bench_input.py reports per image. No speed is asserted."""

import subprocess
import sys
import time

from bench.input_serve import tree_cpu_seconds

BURN = (
    "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\ntime.sleep(30)\n"
)


def test_a_live_child_processs_cpu_time_is_counted():
    before = tree_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", BURN])
    try:
        deadline = time.monotonic() + 60
        while tree_cpu_seconds() - before < 0.45 and time.monotonic() < deadline:
            time.sleep(0.1)  # the child is still alive (sleeping): its own utime counts
        assert tree_cpu_seconds() - before >= 0.45  # 0.5 s burnt, less the clock tick (10 ms)
    finally:
        child.kill()
        child.wait()
    assert tree_cpu_seconds() - before >= 0.45  # reaped: in this process's cutime now
