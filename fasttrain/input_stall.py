"""Does the input keep up? The share of each log interval that training waited for its batches.

    CUDA  the step's stream idle between one step's end and the next step's start: timing events that
          fasttrain.step records around each step (for a replayed step, after the wait for its batch's
          host copy, so a late batch shows as idle), read at the log step after its host sync:
          stall = gaps / (steps + gaps). Gaps that are not the input's are left out: the interval's
          first (the log step's own sync and printing) and those after a checkpoint or an evaluation.
          Two event records per step: host calls that queue work, no sync (their CPU cost on a GPU
          machine is not measured yet).
    CPU   the trainer's wait in next(batches): the step runs synchronously, so that is all of it.

With the torch thread loader, each interval's ThreadTime (fasttrain.data.thread_loader_time) says why:
threads busy (too few cores or threads), off the CPU inside samples (the GIL, the disk), or idle
with every slot made (then the loader is not what holds training back). Its consumer wait (for a batch
not yet made) decides the advice: under half the stall, the batches were made ahead and the line says
so, and asks for cores, not workers.

The trainer writes `input_stall` (and the threads' `loader_busy`, `loader_off_cpu`) into
metrics.jsonl and the curves at every log step, and prints one line, once per run, the first time an
interval after the first two (start-up, warm-up, capture) stalls for STALLED of its time or more.
"""

from __future__ import annotations

import time

import torch

from fasttrain.threads import SHM_DIR, available_cores, local_ranks, shared_memory_free, shm_shortage

STALLED = 0.10  # a tenth of the time waiting for input: worth one line with what to change


class InputStall:
    def __init__(self, loader, cuda: bool, log, num_workers: int):
        self.loader, self.cuda, self.log, self.num_workers = loader, cuda, log, num_workers
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # reused, a pair per step
        self._steps = 0  # steps timed in this interval (CUDA)
        self._breaks: set[int] = set()  # steps whose gap before is not the input's (a save, an evaluation)
        self._waited = 0.0  # seconds in next(batches) this interval (CPU)
        self._threads = self._thread_time()
        self._intervals = 0
        self.warned = False

    # --- called by fasttrain.step around each step (CUDA) and by the trainer ---------------------
    def started(self) -> None:
        if self._steps == len(self._events):
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        self._events[self._steps][0].record()

    def ended(self) -> None:
        self._events[self._steps][1].record()
        self._steps += 1

    def next_batch(self, batches):
        """next(batches), its wait counted (CPU)."""
        waited = time.perf_counter()
        group = next(batches)
        self._waited += time.perf_counter() - waited
        return group

    def skip(self) -> None:
        """The gap before the next step is not the input's: a checkpoint or an evaluation came first."""
        self._breaks.add(self._steps)

    # --- at the log step, after its host sync ----------------------------------------------------
    def read(self, first: int, last: int, seconds: float) -> dict:
        """Metrics of steps first..last (`seconds` of wall time); prints the input-bound line once."""
        out = {}
        stall = self._stall(seconds)
        if stall is not None:
            out["input_stall"] = stall
        threads = self._thread_time()
        spent = None
        if threads is not None and self._threads is not None:
            spent = threads.since(self._threads)
            # Over the time between the two readings, not `seconds`: that leaves out an evaluation,
            # through which the threads wait with every slot made (an idle share over 100%).
            span = threads.at - self._threads.at
            if spent.work_s > 0:
                shares = spent.shares(span)
                out.update(loader_busy=shares["loader_busy"], loader_off_cpu=shares["loader_off_cpu"])
        self._intervals += 1
        if stall is not None and stall >= STALLED and self._intervals > 2 and not self.warned:
            self.warned = True
            where = "the GPU idled waiting" if self.cuda else "the step waited"
            why = f"; {spent.describe(span)}" if spent is not None and spent.work_s > 0 else ""
            description = self.loader.description
            # The thread loader tells a wait for a batch not yet made (its threads behind) from the
            # rest of the step's wait in next(batches) (batches made ahead, handed over late). DALI
            # and DataLoader processes do not: their wait is taken to be the workers'.
            if spent is not None and spent.consumer_wait_s < stall * seconds / 2:
                advice = self._not_the_loader(spent.consumer_wait_s / seconds)
            else:
                options = [self._more_workers()]
                if threads is not None:
                    options.append(self._processes())
                if not description.startswith("dali"):
                    options.append("--data_backend dali")
                last_two = f"{', '.join(options[:-1])} or {options[-1]}"
                advice = f"{options[0] if len(options) == 1 else last_two} would feed it faster"
            self.log(
                f"input-bound: {where} for its next batch {stall:.0%} of steps {first}-{last} "
                f"({description}){why}; {advice}"
            )
        self._steps, self._waited, self._breaks, self._threads = 0, 0.0, set(), threads
        return out

    def _more_workers(self) -> str:
        """More workers; on CUDA, where they and the trainer have this rank's share of the cores
        already, more cores (on the CPU the model's threads share them: more workers is the choice)."""
        cores, ranks, n = available_cores(), local_ranks(), self.num_workers
        if not self.cuda or n < cores // ranks - 1:
            return f"more --num_workers (now {n})"
        share = f"{cores} cores" + (f" / {ranks} ranks" if ranks > 1 else "")
        return (
            f"more CPU cores ({n} worker{'s' * (n != 1)} and the trainer have this rank's share of {share})"
        )

    def _not_the_loader(self, unmade: float) -> str:
        """The advice where the batches were mostly made before the step asked for them (`unmade`: the
        share of the interval it waited for one not yet made): more workers would sit idle too."""
        cores, ranks = available_cores(), local_ranks()
        share = f"{cores} cores" + (f" for {ranks} ranks" if ranks > 1 else "")
        host = "the step's launch and its batch's copy" if self.cuda else "the step"
        return (
            f"its batches were made ahead (it waited for one not yet made {unmade:.0%} of the time): the "
            f"wait is the hand-over (the loader's lock, the GIL) and {host} waiting for a core ({share}, "
            f"shared with the loader threads); more CPU cores would feed it faster, not more --num_workers"
        )

    def _processes(self) -> str:
        """--loader processes, said with what they would need where /dev/shm is short of it."""
        cfg = getattr(self.loader, "cfg", None)
        if cfg is not None and shm_shortage(cfg, self.num_workers, local_ranks(), shared_memory_free()):
            return f"--loader processes (no GIL shared; they need more {SHM_DIR})"
        return "--loader processes (no GIL shared)"

    def _stall(self, seconds: float) -> float | None:
        if not self.cuda:
            return self._waited / seconds if seconds > 0 else None
        pairs = self._events[: self._steps]
        if len(pairs) < 2:
            return None
        pairs[-1][1].synchronize()  # done already (the log step's sync); elapsed_time needs it
        busy = sum(start.elapsed_time(end) for start, end in pairs)
        gaps = sum(
            max(0.0, pairs[k - 1][1].elapsed_time(pairs[k][0]))
            for k in range(1, len(pairs))
            if k not in self._breaks
        )
        return gaps / (busy + gaps) if busy + gaps > 0 else None

    def _thread_time(self):
        read = getattr(self.loader, "thread_time", None)  # the torch thread loader's
        return read() if read is not None else None
