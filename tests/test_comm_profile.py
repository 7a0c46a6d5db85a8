"""fasttrain/comm_profile.py: the overlap statistics of the bucket all-reduces, from launch and completion
times given by hand and the busy/hidden/exposed times worked out by hand (the module docstring's
equations); the profiler on live gloo collectives runs in tests/test_buckets.py."""

import pytest
import torch

from fasttrain.comm_profile import CommProfiler


def test_hidden_and_exposed_time_follow_the_stream_order():
    profiler = CommProfiler(torch.device("cpu"))
    # One step, wall-clock seconds: bucket 1 launched at 0 ms and done at 5, bucket 0 launched at 2 (it
    # queues behind bucket 1 on the one stream: busy from 5) and done at 9; backward ended at 6.
    #   bucket 1: busy 0-5, all of it before 6: 5 ms, 5 hidden
    #   bucket 0: busy 5-9, 5-6 before backward's end: 4 ms, 1 hidden; 9 - 6 = 3 ms exposed
    step = ([0.000, 0.002], [0.005, 0.009], 0.006, [1, 0], None)
    profiler.steps = [step, step]
    stats = profiler.collect(num_buckets=2)
    assert stats["steps"] == 2
    assert stats["comm_ms"] == pytest.approx(9.0) and stats["exposed_ms"] == pytest.approx(3.0)
    assert stats["hidden_fraction"] == pytest.approx(6.0 / 9.0)
    assert stats["buckets"] == pytest.approx([4.0, 5.0])
    assert profiler.collect(num_buckets=2) is None  # collected steps are reset


def test_communication_after_backward_is_all_exposed():
    profiler = CommProfiler(torch.device("cpu"))
    # Backward ended at 1 ms, before the only bucket was even launched (2 ms); it ran until 7 ms.
    profiler.steps = [([0.002], [0.007], 0.001, [0], None)]
    stats = profiler.collect(num_buckets=1)
    assert stats["hidden_fraction"] == 0.0 and stats["exposed_ms"] == pytest.approx(6.0)
    assert stats["comm_ms"] == pytest.approx(5.0)
