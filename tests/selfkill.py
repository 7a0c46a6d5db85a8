"""`python tests/selfkill.py WHERE STEP FLAG...`: `python -m fasttrain FLAG...` that SIGKILLs itself at
a chosen point, so that a crash test kills the run where it means to, every time (a test that polled
metrics.jsonl and killed from outside sometimes saw the run finish first).

WHERE:
- log: right after metrics.jsonl has the training line of step STEP;
- save: in the middle of writing ckpt-STEP.pt (torch.save has written its first bytes);
- rename: when ckpt-STEP.pt's checksum file has landed and the data file is about to be renamed
  into place;
- term: right after training step STEP, with SIGTERM instead (the stop signal a scheduler sends,
  which the trainer handles), so that a stop test stops at the step it means to.

The process kills itself with SIGKILL (no handler, no cleanup, no atexit), as an OOM killer or a
preempted node would.
"""

import os
import runpy
import signal
import sys


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(where: str, step: int) -> None:
    from fasttrain import checkpoint, monitor
    from fasttrain import step as step_module

    if where == "term":
        call = step_module.TrainStep.__call__
        done = [0]

        def step_then_term(self, batches):
            call(self, batches)
            done[0] += 1
            if done[0] == step:
                os.kill(os.getpid(), signal.SIGTERM)

        step_module.TrainStep.__call__ = step_then_term
    elif where == "log":
        write = monitor.MetricsLog.write

        def write_then_die(self, **record):
            write(self, **record)
            if record.get("step") == step and "loss" in record:
                die()

        monitor.MetricsLog.write = write_then_die
    elif where == "save":
        sink_write = checkpoint._Sink.write

        def write_some_then_die(self, data):
            written = sink_write(self, data)
            if os.path.basename(self.f.name) == f".ckpt-{step}.pt.tmp":
                self.f.flush()  # the partial file is on disk, as a crash mid-save leaves it
                die()
            return written

        checkpoint._Sink.write = write_some_then_die
    elif where == "rename":
        replace = os.replace

        def die_before(src, dst, *args, **kwargs):
            if os.path.basename(dst) == f"ckpt-{step}.pt":
                die()
            return replace(src, dst, *args, **kwargs)

        os.replace = die_before
    else:
        raise SystemExit(f"selfkill.py: unknown point {where!r} (log, save, rename or term)")


if __name__ == "__main__":
    where, step = sys.argv[1], int(sys.argv[2])
    sys.argv = ["fasttrain", *sys.argv[3:]]
    arm(where, step)
    runpy.run_module("fasttrain", run_name="__main__", alter_sys=True)
