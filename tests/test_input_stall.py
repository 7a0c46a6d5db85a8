"""fasttrain/input_stall.py: the share of each log interval that training waited for its input, the
thread loader's reasons, and the one input-bound line, in metrics.jsonl and the log.

The references are made independent of the measurement: samples slowed by a known sleep against a
synthetic loader that never waits, and stand-in CUDA events whose times are the test's own sleeps.
"""

from __future__ import annotations

import json
import time

import pytest

import fasttrain.input_stall
from fasttrain.config import make_config
from fasttrain.data.thread_loader_time import ThreadTime
from fasttrain.data.torch_pipeline import SampleReader
from fasttrain.input_stall import InputStall
from fasttrain.train import train


def _cfg(tmp_path, data_dir=None, **overrides):
    """ResNet-18 8 channels wide at 32 px, batch 4, on the CPU: a few hundredths of a second a step."""
    values = dict(model="resnet18", base_channels=8, image_size=32, batch_size=4, num_classes=4)
    values.update(device="cpu", max_steps=10, log_every=2, eval_at_end=False, eval_every_epochs=0)
    values.update(train_dir=str(tmp_path / "run"), num_workers=1, tensorboard=False)
    if data_dir is None:
        values.update(data_backend="synthetic")
    else:
        values.update(data_backend="torch", data_dir=str(data_dir), label_offset=-1, shuffle_buffer=16)
    return make_config(**{**values, **overrides})


def _metrics(tmp_path) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split", "train") == "train" and "loss" in r]


SLEEP = 0.06  # per sample: 4 x 60 ms a batch on one thread, several times a step's compute here, even on
# a busy machine (at 30 ms, a CI run sharing its 2 cores measured a stall of 0.21, the step slowed)


def test_a_slow_loader_is_told_once_with_its_threads_reasons(synthetic, tmp_path, monkeypatch, capsys):
    sample = SampleReader.sample

    def slowed(self, position, out):
        time.sleep(SLEEP)  # off the CPU, as a thread waiting for the GIL or the disk would be
        return sample(self, position, out)

    monkeypatch.setattr(SampleReader, "sample", slowed)
    train(_cfg(tmp_path, synthetic))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("input-bound:")]
    assert len(lines) == 1, out  # once per run, though every interval stalls
    assert "the step waited for its next batch" in lines[0] and "1 loader thread " in lines[0]
    assert "--num_workers (now 1)" in lines[0]
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10]
    for r in records[1:]:  # the first interval holds the loader's start (its first batches) as well
        # A batch takes 4 x SLEEP to make and the one thread makes nothing else: the step waits for
        # most of that (the thread runs ahead only while the step computes).
        assert 0.5 < r["input_stall"] <= 1.0
        assert r["loader_busy"] > 0.8  # the thread is never idle: always a sample to make
        assert r["loader_off_cpu"] > 0.8  # and inside them it sleeps


def test_a_loader_that_keeps_up_is_not_told(tmp_path, capsys):
    train(_cfg(tmp_path))  # the synthetic loader: the same batch every step, no wait
    out = capsys.readouterr().out
    assert "input-bound" not in out
    for r in _metrics(tmp_path):
        assert 0.0 <= r["input_stall"] < 0.05  # next() of an in-memory batch: microseconds
        assert "loader_busy" not in r  # no loader threads to tell about


class _Event:
    """A stand-in CUDA event: its time is the perf_counter at record()."""

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


def test_on_cuda_the_stall_is_the_streams_idle_time_between_steps(monkeypatch):
    monkeypatch.setattr(fasttrain.input_stall.torch.cuda, "Event", _Event)
    said = []
    stall = InputStall(loader=None, cuda=True, log=said.append, num_workers=4)
    stall.loader = type("L", (), {"description": "torch, 4 loader threads"})()
    busy, idle = 0.01, 0.03
    for interval in range(4):
        time.sleep(0.05)  # the log step's own sync and printing: left out of the interval
        for k in range(5):
            if interval == 1 and k == 3:  # a checkpoint between steps: its gap is not the input's
                stall.skip()
                time.sleep(0.1)
            stall.started()
            time.sleep(busy)
            stall.ended()
            time.sleep(idle)
        fields = stall.read(1 + 5 * interval, 5 * (interval + 1), 1.0)
        # 4 gaps of `idle` (3 in the interval with the checkpoint) beside 5 steps of `busy`, with
        # sleep's overshoot (a millisecond or two each here) in both.
        gaps = 3 if interval == 1 else 4
        assert fields["input_stall"] == pytest.approx(gaps * idle / (5 * busy + gaps * idle), abs=0.06)
    assert len(said) == 1 and said[0].startswith("input-bound: the GPU idled waiting for its next batch")
    assert "steps 11-15" in said[0]  # the first interval after the two start-up ones


def test_the_line_asks_for_cores_where_the_workers_have_them_all(monkeypatch):
    import fasttrain.input_stall as stall_module

    monkeypatch.setattr(stall_module, "available_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    loader = type("L", (), {"description": "torch, 4 loader threads"})()
    assert InputStall(loader, True, print, 4)._more_workers() == "more --num_workers (now 4)"
    said = InputStall(loader, True, print, 15)._more_workers()  # auto's count on 16 cores
    assert said == "more CPU cores (15 workers and the trainer have this rank's share of 16 cores)"
    assert InputStall(loader, False, print, 15)._more_workers() == "more --num_workers (now 15)"  # CPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    said = InputStall(loader, True, print, 3)._more_workers()
    assert said == "more CPU cores (3 workers and the trainer have this rank's share of 16 cores / 4 ranks)"
    # --loader processes, and what they would need where /dev/shm is short (fasttrain.threads)
    loader.cfg = make_config(batch_size=256, image_size=224)
    monkeypatch.setattr(stall_module, "shared_memory_free", lambda: 64 * 2**20)
    assert "they need more /dev/shm" in InputStall(loader, False, print, 15)._processes()
    monkeypatch.setattr(stall_module, "shared_memory_free", lambda: 2**40)
    assert InputStall(loader, False, print, 15)._processes() == "--loader processes (no GIL shared)"


def test_one_timed_step_says_nothing():
    stall = InputStall(loader=None, cuda=True, log=print, num_workers=0)
    assert stall.read(1, 1, 1.0) == {}  # no pair of steps, no gap to measure (and no CUDA touched)


class _Loader:
    """A stand-in thread loader: thread_time() hands out the test's readings in turn."""

    description = "torch, 1 loader thread"

    def __init__(self, readings):
        self.readings = iter(readings)

    def thread_time(self):
        return next(self.readings)


def _said(readings, seconds: float, waited: float) -> str:
    """The input-bound line of a CPU run whose step waited `waited` of each interval's `seconds`, its
    loader read as `readings` (the first at the start, then one an interval)."""
    said = []
    stall = InputStall(_Loader(readings), cuda=False, log=said.append, num_workers=1)
    for interval in range(len(readings) - 1):
        stall._waited = waited  # the step's wait in next(batches), as next_batch counts it
        stall.read(1 + 5 * interval, 5 * (interval + 1), seconds)
    assert len(said) == 1
    return said[0]


def _reading(at: float, work: float, slot_wait: float, consumer_wait: float) -> ThreadTime:
    return ThreadTime(
        threads=1, work_s=work, cpu_s=work / 2, slot_wait_s=slot_wait, consumer_wait_s=consumer_wait, at=at
    )


def test_the_loaders_shares_are_of_the_time_between_its_readings(monkeypatch):
    # Each interval 10 s between readings, 5 s of it an evaluation the trainer leaves out of `seconds`:
    # the thread waited for a slot 9 s of each 10 (through the evaluation too), so idle 90%, not 180%.
    monkeypatch.setattr(fasttrain.input_stall, "available_cores", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    readings = [_reading(10.0 * k, 0.8 * k, 9.0 * k, 0.5 * k) for k in range(4)]
    line = _said(readings, seconds=5.0, waited=1.0)
    assert "1 loader thread 8% busy making images, 50% of that off the CPU" in line
    assert "idle 90% with every slot ahead made" in line


def test_a_loader_ahead_is_not_asked_for_more_workers(monkeypatch):
    # The audit's case (2 ranks on 2 cores, 1 loader thread): the step waited 10% of the interval, the
    # thread 8% busy and idle the rest with every slot made, and the step waited for a batch not yet
    # made for 1% of it: the wait is not the loader's making, and more workers would sit idle too.
    monkeypatch.setattr(fasttrain.input_stall, "available_cores", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    readings = [_reading(10.0 * k, 0.8 * k, 9.0 * k, 0.1 * k) for k in range(4)]
    line = _said(readings, seconds=10.0, waited=1.0)
    assert "the step waited for its next batch 10% of steps 11-15" in line
    assert "--num_workers (now" not in line and "--loader processes" not in line and "dali" not in line
    assert "its batches were made ahead (it waited for one not yet made 1% of the time)" in line
    assert line.endswith("more CPU cores would feed it faster, not more --num_workers")
    assert "(2 cores for 2 ranks, shared with the loader threads)" in line
    # The same loader, behind: the step waited for batches not yet made most of its wait (busy thread).
    readings = [_reading(10.0 * k, 9.5 * k, 0.0, 0.9 * k) for k in range(4)]
    line = _said(readings, seconds=10.0, waited=1.0)
    assert "idle 0% with every slot ahead made" in line
    assert "more --num_workers (now 1), --loader processes (no GIL shared) or --data_backend dali" in line
