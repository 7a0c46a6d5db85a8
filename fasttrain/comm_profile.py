"""All-reduce timings of fasttrain's gradient buckets (GradBuckets(profile=True), the trainer's
--profile_comm): how much of each step's communication backward hides.

Per launched bucket k: s_k = launch time, e_k = completion time, and b = the time backward ended
(entry of GradBuckets.wait()); wall clock on the CPU, CUDA events on the GPU (eager steps only: events
in a captured graph cannot be timed). Collectives on one stream run one after another, so bucket k is
busy on [s'_k, e_k] with s'_k = max(s_k, e_{k-1}):
    duration_k = max(0, e_k - s'_k),  hidden_k = clip(min(e_k, b) - s'_k, 0, duration_k)
    hidden_fraction = sum hidden_k / sum duration_k,  exposed = max(0, max_k e_k - b)
"""

from __future__ import annotations

import time

import torch


class CommProfiler:
    """Launch/completion times per bucket and the end of backward, turned into overlap statistics."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.reset()

    def reset(self) -> None:
        self.steps: list[tuple] = []  # (starts, ends, backward_end, launch_order, reference event)

    def begin(self) -> None:
        # Events in a captured graph cannot be timed: profile eager steps only.
        self.recording = not (self.cuda and torch.cuda.is_current_stream_capturing())
        self.starts, self.ends, self.futures = [], [], []
        if self.recording and self.cuda:
            self.ref = _record_event()

    def before_launch(self) -> None:
        if self.recording:
            self.starts.append(_record_event() if self.cuda else time.perf_counter())

    def after_launch(self, work) -> None:
        if not self.recording:
            return
        if self.cuda:
            # The side stream waits for this collective only, so its event fires when the all-reduce ends.
            with torch.cuda.stream(self.side):
                work.wait()
                self.ends.append(_record_event())
        else:
            k = len(self.ends)
            self.ends.append(None)
            stamp = lambda _fut: self.ends.__setitem__(k, time.perf_counter())  # runs on completion
            self.futures.append(work.get_future().then(stamp))

    def backward_ended(self) -> None:
        if self.recording:
            self.backward_end = _record_event() if self.cuda else time.perf_counter()

    def step_done(self, launch_order: list[int]) -> None:
        if not self.recording:
            return
        for fut in self.futures:
            fut.wait()  # the completion callbacks have run
        self.steps.append(
            (self.starts, self.ends, self.backward_end, list(launch_order), self.ref if self.cuda else None)
        )

    def collect(self, num_buckets: int) -> dict | None:
        if not self.steps:
            return None
        if self.cuda:
            torch.cuda.synchronize()  # note: a host sync, only when the trainer logs comm stats
        per_bucket = [0.0] * num_buckets
        total = hidden = exposed = 0.0
        for starts, ends, bwd, order, ref in self.steps:
            if self.cuda:
                starts = [ref.elapsed_time(e) for e in starts]
                ends = [ref.elapsed_time(e) for e in ends]
                bwd = ref.elapsed_time(bwd)
            else:
                t0 = starts[0] if starts else bwd
                starts = [(t - t0) * 1e3 for t in starts]
                ends = [(t - t0) * 1e3 for t in ends]
                bwd = (bwd - t0) * 1e3
            prev_end = float("-inf")
            for b, s, e in zip(order, starts, ends, strict=False):
                busy_from = max(s, prev_end)
                duration = max(0.0, e - busy_from)
                per_bucket[b] += duration
                total += duration
                hidden += min(max(0.0, min(e, bwd) - busy_from), duration)
                prev_end = max(prev_end, e)
            exposed += max(0.0, max(ends, default=bwd) - bwd)
        n = len(self.steps)
        self.reset()
        return {
            "steps": n,
            "comm_ms": total / n,
            "exposed_ms": exposed / n,
            "hidden_fraction": hidden / total if total > 0 else 1.0,
            "buckets": [ms / n for ms in per_bucket],
        }


def _record_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
