"""fasttrain/data/thread_loader_time.py and thread_loader.py: where the loader threads' time goes
(ThreadTime), and the ring's CUDA release events, run here with stand-in events that complete a set
time after they are recorded.

The references are independent of the counters: a sample made to sleep (off the CPU) or to spin (on
it) for a known time, a consumer that sleeps, and the stand-in events' own completion times.
"""

import threading
import time

import pytest
import torch
from test_thread_loader import _cfg

from fasttrain.data import thread_loader
from fasttrain.data.sharding import epoch_positions
from fasttrain.data.thread_loader import PREFETCH, ThreadLoader
from fasttrain.data.torch_pipeline import SampleReader

SLEEP = 0.004  # seconds a slowed sample sleeps: far above a sample's own time here (~0.2 ms)


def _slowed(monkeypatch, how: str, log: list | None = None):
    """Each sample also sleeps (off the CPU) or spins (on it) SLEEP seconds; `log` gets
    (start time, position) of each sample."""
    sample = SampleReader.sample

    def slowed(self, position, out):
        if log is not None:
            log.append((time.perf_counter(), position))
        end = time.perf_counter() + SLEEP
        if how == "sleep":
            time.sleep(SLEEP)
        else:
            while time.perf_counter() < end:  # Python bytecode: holds the GIL and a core
                pass
        return sample(self, position, out)

    monkeypatch.setattr(SampleReader, "sample", slowed)


@pytest.mark.parametrize("how", ["sleep", "spin"])
def test_time_off_the_cpu_inside_samples_is_told_from_cpu_time(synthetic, monkeypatch, how):
    _slowed(monkeypatch, how)
    loader = ThreadLoader(_cfg(synthetic, num_workers=1), "train", True)
    started = time.perf_counter()
    count = sum(len(labels) for _, labels in loader)
    wall = time.perf_counter() - started
    spent = loader.thread_time()
    assert spent.threads == 1 and spent.images == count == 120  # 15 batches of 8
    assert spent.work_s >= count * SLEEP
    assert spent.work_s + spent.slot_wait_s <= wall  # one thread: its accounted time fits the epoch
    off_cpu = spent.work_s - spent.cpu_s
    if how == "sleep":
        assert off_cpu >= 0.9 * count * SLEEP  # the sleeps (a 10% margin for clock granularity)
    else:
        # The spin is CPU time: off the CPU only what the scheduler took from it (other processes on
        # the machine's two cores). A quiet run keeps over three quarters of the spin on the CPU; a CI
        # run sharing its cores with other test runs kept 0.95 of it (0.456 s of 0.48), with 0.34 s of
        # its work off the CPU. So the bound is on the CPU time, at 0.4 of the spin: far from the
        # sleeps above, which keep none of theirs.
        assert spent.cpu_s >= count * SLEEP * 0.4


def test_a_slow_consumer_leaves_the_threads_waiting_for_slots_a_slow_loader_the_consumer(
    synthetic, monkeypatch
):
    cfg = _cfg(synthetic, num_workers=2)
    slow_consumer = ThreadLoader(cfg, "train", True)
    for _ in slow_consumer:
        time.sleep(0.03)  # the batches PREFETCH ahead are made long before they are asked for
    fast = slow_consumer.thread_time()
    assert fast.slot_wait_s > 2 * 15 * 0.03 * 0.5  # two threads, 15 batches: most of each sleep
    assert fast.consumer_wait_s < 0.1 * fast.slot_wait_s

    _slowed(monkeypatch, "sleep")
    slow_loader = ThreadLoader(cfg, "train", True)
    started = time.perf_counter()
    for _ in slow_loader:
        pass
    wall = time.perf_counter() - started
    slow = slow_loader.thread_time()
    assert slow.consumer_wait_s > 0.5 * wall  # the consumer waited for nearly every batch
    assert slow.slot_wait_s < 0.1 * slow.consumer_wait_s


def test_a_wait_across_readings_is_split_between_their_intervals(synthetic):
    """A thread waiting for a slot when the loader is read: the wait counts up to the reading, so each
    interval's waits fit in it. Counted only when a wait ended, the interval that had it all said 0%
    and the next, much shorter one several times 100% (the trainer's "idle 101%")."""
    loader = ThreadLoader(_cfg(synthetic, num_workers=2), "train", True)
    batches = iter(loader)
    next(batches)
    time.sleep(0.05)  # every slot ahead made: both threads wait for one (a sample here is ~0.2 ms)
    readings = []
    for pause in (0.2, 0.05):
        readings.append((time.perf_counter(), loader.thread_time()))
        time.sleep(pause)  # the threads still waiting for a slot
    readings.append((time.perf_counter(), loader.thread_time()))
    batches.close()  # stops the threads mid-wait: that wait is kept, not dropped
    closed = loader.thread_time()
    for (t0, r0), (t1, r1) in zip(readings, readings[1:]):
        idle = r1.since(r0).shares(t1 - t0)["loader_slot_wait"]  # the test's own clock for the interval
        assert 0.8 < idle <= 1.0 + 1e-3, idle  # waited throughout (1e-3: the reads' own microseconds)
    assert closed.slot_wait_s >= readings[-1][1].slot_wait_s


def test_thread_time_sums_the_epochs_and_reads_during_one(synthetic):
    loader = ThreadLoader(_cfg(synthetic, num_workers=2), "train", True)
    for _ in loader:
        pass
    first = loader.thread_time()
    loader.set_epoch(1)
    during = None
    for j, _ in enumerate(loader):
        if j == 3:
            during = loader.thread_time().since(first)
    both = loader.thread_time()
    assert first.images == 120 and both.images == 240 and both.threads == 2
    assert 8 * 4 <= during.images <= 120  # batches 0-3 made, at most the whole epoch
    assert both.since(first).work_s > 0 and both.work_s == pytest.approx(
        first.work_s + both.since(first).work_s
    )


class _Event:
    """A stand-in CUDA event: complete DELAY seconds after record; synchronize() waits for that and
    counts its calls."""

    DELAY = 0.02
    calls = 0
    lock = threading.Lock()

    def __init__(self):
        self.at = time.perf_counter() + self.DELAY

    def synchronize(self):
        with _Event.lock:
            _Event.calls += 1
        time.sleep(max(0.0, self.at - time.perf_counter()))


def test_a_reused_slot_is_written_after_its_event_and_the_event_is_waited_for_once(synthetic, monkeypatch):
    events: dict[int, _Event] = {}  # batch released -> its event

    def recorded(batch=[0]):  # noqa: B006 - a counter: the batches are released in order
        events[batch[0]] = event = _Event()
        batch[0] += 1
        return event

    monkeypatch.setattr(thread_loader, "_release_events", lambda: True)
    monkeypatch.setattr(thread_loader, "_recorded_event", recorded)
    log: list = []
    _slowed(monkeypatch, "sleep", log)
    _Event.calls = 0
    cfg = _cfg(synthetic, num_workers=3)
    loader = ThreadLoader(cfg, "train", True, reuse_buffers=True)
    plan = epoch_positions(loader.table, True, cfg.seed, 0, 0, 1, cfg.shuffle_buffer)
    batch_of = {int(p): n // cfg.batch_size for n, p in enumerate(plan[: len(loader) * cfg.batch_size])}
    batches = [(images.clone(), labels.clone()) for images, labels in loader]
    slots = 1 + PREFETCH
    assert len(batches) == len(loader) > slots + 2 and len(log) == len(batches) * cfg.batch_size
    # Batch j's samples start after the event of batch j - slots (the slot's previous batch) completed.
    for started, position in log:
        j = batch_of[position]
        if j >= slots:
            assert started >= events[j - slots].at, f"batch {j} written before its slot was released"
    # Each reused slot's event: waited for by at most each thread once, not by each of its 8 samples.
    reused = len(batches) - slots
    assert reused <= _Event.calls <= reused * loader.num_threads
    assert loader.thread_time().gpu_wait_s > 0
    # The batches are the same as without the events.
    plain = [(i.clone(), lb.clone()) for i, lb in ThreadLoader(cfg, "train", True)]
    for (a, la), (b, lb) in zip(batches, plain, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
