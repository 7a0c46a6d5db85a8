"""Where the torch thread loader's time goes (fasttrain/data/thread_loader.py): ThreadTime, the loader
threads' time inside samples (wall and CPU), their waits for a slot and for the GPU, and the consumer's
wait for batches, as shares of an interval and as the line the trainer's input-bound note and
bench/loader_alone.py print."""

from __future__ import annotations

import dataclasses

_NOT_SUMMED = ("threads", "at")


@dataclasses.dataclass
class ThreadTime:
    """Where the loader threads' time went (seconds, all threads summed), and the consumer's wait.

    work: wall time inside samples (read, decode, transform, write); cpu: the CPU time the threads
    used inside them (time.thread_time), so work - cpu is time a thread spent in a sample off the CPU:
    waiting to take the GIL back, for a page of the shard from disk, or for a core. slot_wait: no
    sample to take (the ring's slots full, the batches PREFETCH ahead of the consumer made); gpu_wait:
    a slot's CUDA release event (the step still copying out of it). consumer_wait: the consumer's
    (the trainer's main thread) wait for a batch not yet made. at: when it was read (perf_counter);
    a wait going on then is counted up to it, so the waits between two readings fit in the time
    between them (`later.at - earlier.at`, the `seconds` to give shares and describe).
    """

    threads: int = 0
    images: int = 0
    work_s: float = 0.0
    cpu_s: float = 0.0
    slot_wait_s: float = 0.0
    gpu_wait_s: float = 0.0
    consumer_wait_s: float = 0.0
    at: float = 0.0

    def add(self, other: ThreadTime) -> None:
        for f in dataclasses.fields(self):
            if f.name not in _NOT_SUMMED:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.threads = max(self.threads, other.threads)
        self.at = max(self.at, other.at)

    def since(self, earlier: ThreadTime) -> ThreadTime:
        out = ThreadTime(**vars(self))
        for f in dataclasses.fields(self):
            if f.name not in _NOT_SUMMED:
                setattr(out, f.name, getattr(self, f.name) - getattr(earlier, f.name))
        return out

    def shares(self, seconds: float) -> dict[str, float]:
        """Over `seconds` of wall time: loader_busy, loader_slot_wait, loader_gpu_wait (shares of the
        threads' time) and loader_off_cpu (the share of the busy time off the CPU). With `seconds` the
        time between the two readings, each wait's share is at most 1: a thread waits for one thing
        at a time, and a wait going on at a reading is split there."""
        span = max(seconds * self.threads, 1e-9)
        return dict(
            loader_busy=min(1.0, self.work_s / span),  # a sample counts when it ends: one may straddle
            loader_off_cpu=max(0.0, (self.work_s - self.cpu_s) / max(self.work_s, 1e-9)),
            loader_slot_wait=self.slot_wait_s / span,
            loader_gpu_wait=self.gpu_wait_s / span,
        )

    def describe(self, seconds: float) -> str:
        """'14 loader threads 31% busy making images, 12% of that off the CPU (...); idle 60% with
        every slot ahead made, 9% for the GPU to free a slot' (that last part when it waited), over
        `seconds` of wall time."""
        s = self.shares(seconds)
        return (
            f"{self.threads} loader thread{'s' * (self.threads != 1)} {s['loader_busy']:.0%} busy making "
            f"images, {s['loader_off_cpu']:.0%} of that off the CPU (the GIL, disk or too few cores); "
            f"idle {s['loader_slot_wait']:.0%} with every slot ahead made"
            + (f", {s['loader_gpu_wait']:.0%} for the GPU to free a slot" if self.gpu_wait_s > 0 else "")
        )
