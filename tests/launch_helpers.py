"""Launching test jobs: gloo ranks spawned in-process (`spawn`) and torchrun agents (`run_torchrun`),
all on loopback, each with a time limit that fails a hung job instead of hanging the suite."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from fasttrain.distributed import cleanup, init_distributed

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env() -> dict[str, str]:
    # gloo picks the interface of the host name unless told: keep every connection on loopback.
    return {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def _entry(rank: int, fn, world: int, port: int, args: tuple) -> None:
    os.environ.update(
        loopback_env(),
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    info = init_distributed("cpu", timeout_s=120)  # a deadlock ends in an error, not a hung test
    try:
        fn(info, *args)
    finally:
        cleanup()


def spawn(fn, world: int, *args) -> None:
    """Run fn(info, *args) on `world` gloo ranks; an exception on any rank fails the caller."""
    mp.spawn(_entry, args=(fn, world, free_port(), args), nprocs=world, join=True)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (found before any of them is killed)."""
    tree, todo = [], [pid]
    while todo:
        parent = todo.pop()
        tree.append(parent)
        out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
        todo += [int(child) for child in out.split()]
    for victim in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def run_torchrun(
    target: list[str],
    nproc: int = 2,
    nnodes: int = 1,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> list[subprocess.CompletedProcess]:
    """Launch `python -m torch.distributed.run ... target` (a script or ['-m', module, args...]).

    nnodes > 1 starts one torchrun agent per node on this machine (--node_rank 0..nnodes-1) meeting
    through a c10d rendezvous on 127.0.0.1, as on a real cluster. Returns each agent's result.
    """
    port = free_port()
    full_env = {**os.environ, **loopback_env(), **(env or {})}  # PYTHONPATH: conftest.py
    procs = []
    for node in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--node_rank={node}",
            f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            f"--rdzv_id=fasttrain-test-{port}",
            "--local_addr=127.0.0.1",
            "--max_restarts=0",
            *target,
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                env=full_env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            # Killing only the agent would leave its workers (torchrun starts them in sessions of
            # their own) holding the pipe open, and communicate() would then wait for ever: a hung
            # job must fail the test, not hang it.
            kill_tree(p.pid)
            out, _ = p.communicate()
            out += f"\n[test harness: killed after {timeout:.0f} s]"
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    return results


# --- one tiny CPU trainer as a user starts it (the preemption, lock and save-failure tests) -------


def trainer_args(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """Flags for a ResNet-18 demo run at 32 px, batch 4: about 0.03 s a step on one core."""
    return [
        f"--data_dir={data_dir}",
        f"--train_dir={run_dir}",
        "--num_classes=4",
        "--batch_size=4",
        "--image_size=32",
        "--log_every=1",
        "--no-eval_at_end",
        *extra,
    ]


def trainer(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fasttrain", *trainer_args(data_dir, run_dir, *extra)]


def trainer_env() -> dict[str, str]:
    return {**os.environ, **loopback_env()}  # PYTHONPATH: conftest.py


# --- the same trainer, deterministic and checkpointing every 2 steps (the end-to-end reliability tests:
# resume, stop signals, non-finite losses, corrupt data, one-line CLI errors) ----------------------

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # PYTHONPATH: conftest.py


def command(data_dir, run_dir, *extra):
    """`python -m fasttrain` on the tiny set: deterministic, RMSProp with an EMA, one line a step."""
    return [
        sys.executable,
        "-m",
        "fasttrain",
        f"--data_dir={data_dir}",
        f"--train_dir={run_dir}",
        "--num_classes=4",
        "--batch_size=4",
        "--image_size=32",
        "--num_workers=0",
        "--log_every=1",
        "--checkpoint_every=2",
        "--deterministic",
        "--no-eval_at_end",
        "--optimizer=rmsprop",
        "--ema_decay=0.9",
        "--optimizer_impl=torch",
        *extra,
    ]


def reached_step(run_dir: Path) -> int:
    """The last step metrics.jsonl records (0 before the first log line)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, limit: float = 120) -> None:
    """Return once the run has logged `step`; fail (killing proc's tree) if it ends or hangs first."""
    deadline = time.monotonic() + limit
    while reached_step(run_dir) < step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if reached_step(run_dir) < step:
        kill_tree(proc.pid)
        _, err = proc.communicate()
        tail = (err or "")[-3000:]
        raise AssertionError(f"the run never reached step {step} (exit {proc.returncode}): {tail}")
