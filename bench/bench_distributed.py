"""Step time with fasttrain's gradient buckets vs torch DDP, 2 gloo ranks on the CPU.

    python -m pytest bench/bench_distributed.py --benchmark-only    # --benchmark-json=FILE keeps numbers

Two rank processes (torch.multiprocessing spawn, one thread each, loopback gloo) stay up for the whole
module; each benchmark call tells both to run `STEPS` training steps on a fixed synthetic batch and
waits for both, so a call is what a real step costs: forward, backward with the all-reduce overlapped,
FusedMomentum update. Model: the demo recipe's ResNet-18 at base width 16 (703,386 parameters, 2.7 MiB
of gradients), 10 classes, FASTTRAIN_BENCH_SIZE px (default 32), FASTTRAIN_BENCH_BATCH images per rank
(default 16), FASTTRAIN_BENCH_ROUNDS timed rounds (default 5); buckets and DDP cut the same two
buckets (about 1.1 MiB, then the rest under the 25 MiB cap: DDP's defaults).

Reported in extra_info: ms per step; for the ratio test, median step time of each mode over
interleaved rounds (so load from other processes hits both alike) and buckets/DDP (target <= 1.0),
then from a few profiled steps (`--profile_comm`'s measurement) the all-reduce time per step and the
fraction of it hidden behind backward. On one machine gloo's "network" is a memory copy, so the
all-reduce is a small share of the step; the ratio mostly measures the Python-side cost of the hooks.
"""

from __future__ import annotations

import functools
import os
import socket
import statistics

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from bench.common import timed

WORLD = 2
STEPS = 3  # training steps per benchmark call
ROUNDS = int(os.environ.get("FASTTRAIN_BENCH_ROUNDS", "5"))  # more rounds: a steadier median
SIZE = int(os.environ.get("FASTTRAIN_BENCH_SIZE", "32"))
BATCH = int(os.environ.get("FASTTRAIN_BENCH_BATCH", "16"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(info, mode: str):
    """One training step closure for `mode` (buckets, buckets_profiled or ddp) on this rank."""
    from fasttrain.distributed import GradBuckets, broadcast_module, wrap_ddp
    from fasttrain.models import create_model
    from fasttrain.optim import FusedMomentum

    torch.manual_seed(0)
    model = create_model("resnet18", 10, base_channels=16)
    broadcast_module(model)
    opt = FusedMomentum(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-5)
    gen = torch.Generator().manual_seed(info.rank)
    images = torch.randn(BATCH, 3, SIZE, SIZE, generator=gen)
    labels = torch.randint(0, 10, (BATCH,), generator=gen)
    if mode == "ddp":
        ddp = wrap_ddp(model, info, bucket_cap_mb=25.0)

        def step():
            opt.zero_grad()
            F.cross_entropy(ddp(images), labels).backward()
            opt.step(grad_scale=1.0)  # DDP has averaged already

        return step, None
    buckets = GradBuckets(opt.flat, info, bucket_cap_mb=25.0, profile=mode == "buckets_profiled")

    def step():
        opt.zero_grad()
        buckets.begin()
        F.cross_entropy(model(images), labels).backward()
        buckets.wait()
        opt.step(grad_scale=1.0 / info.world_size)

    step()
    buckets.rebuild_from_observed_order()  # as the trainer does after its first step
    buckets.comm_stats()  # drop the first step's numbers
    return step, buckets


def _rank_main(rank: int, port: int, conn) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)  # one core per rank on the 2-core CI machine
    from fasttrain.distributed import cleanup, init_distributed

    info = init_distributed("cpu", timeout_s=300)
    steps, buckets = {}, {}
    try:
        while True:
            command, arg = conn.recv()
            if command == "exit":
                break
            if command == "setup":
                steps[arg], buckets[arg] = _build(info, arg)
                conn.send(None)
            elif command == "run":
                mode, n = arg
                for _ in range(n):
                    steps[mode]()
                conn.send(None)
            elif command == "stats":
                conn.send(buckets[arg].comm_stats())
    finally:
        cleanup()


class _Ranks:
    def __init__(self):
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
        for rank in range(WORLD):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def ask(self, command: str, arg=None) -> list:
        for conn in self.conns:
            conn.send((command, arg))
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(("exit", None))
        for proc in self.procs:
            proc.join(timeout=60)


@pytest.fixture(scope="module")
def ranks():
    r = _Ranks()
    for mode in ("buckets", "ddp", "buckets_profiled"):
        r.ask("setup", mode)
    yield r
    r.close()


@pytest.mark.parametrize("mode", ["buckets", "ddp"])
def test_step_time(benchmark, ranks, env_info, mode):
    benchmark.pedantic(ranks.ask, args=("run", (mode, STEPS)), rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info.update(env_info)
    benchmark.extra_info.update(
        mode=mode,
        world=WORLD,
        backend="gloo",
        steps_per_call=STEPS,
        ms_per_step=benchmark.stats.stats.mean / STEPS * 1e3,
        image_size=SIZE,
        batch_per_rank=BATCH,
    )


def test_buckets_vs_ddp_ratio(benchmark, ranks, env_info):
    times = {"buckets": [], "ddp": []}

    def interleaved_pair():
        for mode in times:
            seconds = timed(functools.partial(ranks.ask, "run", (mode, STEPS)), 1, torch.device("cpu"))
            times[mode].append(seconds / STEPS)

    benchmark.pedantic(interleaved_pair, rounds=ROUNDS, warmup_rounds=1)
    buckets_ms = statistics.median(times["buckets"][1:]) * 1e3  # [0]: the warm-up round
    ddp_ms = statistics.median(times["ddp"][1:]) * 1e3
    ranks.ask("run", ("buckets_profiled", 2 * STEPS))
    comm = ranks.ask("stats", "buckets_profiled")[0]  # rank 0's view
    benchmark.extra_info.update(env_info)
    benchmark.extra_info.update(
        buckets_ms_per_step=buckets_ms,
        ddp_ms_per_step=ddp_ms,
        ratio_buckets_over_ddp=buckets_ms / ddp_ms,
        target_ratio="<= 1.0",
        comm_ms_per_step=comm["comm_ms"],
        comm_hidden_fraction=comm["hidden_fraction"],
        comm_exposed_ms=comm["exposed_ms"],
        buckets=len(comm["buckets"]),
        image_size=SIZE,
        batch_per_rank=BATCH,
    )
    print(
        f"\nbuckets {buckets_ms:.1f} ms/step, DDP {ddp_ms:.1f} ms/step, ratio {buckets_ms / ddp_ms:.3f}; "
        f"all-reduce {comm['comm_ms']:.2f} ms/step in {len(comm['buckets'])} buckets, "
        f"{comm['hidden_fraction']:.0%} hidden behind backward"
    )
