"""Process-group set-up (fasttrain.distributed): one process without a group, a broken torchrun
environment, device and batch errors, and a two-node torchrun job on one machine (gloo, loopback).

References, never the code under test: the environment torchrun documents, exact all-reduce sums.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch_helpers import run_torchrun
from torch import nn

from fasttrain.buckets import GradBuckets
from fasttrain.distributed import (
    DistInfo,
    all_reduce_flag,
    all_reduce_sum,
    check_graph_capture_env,
    cleanup,
    init_distributed,
    maybe_sync_bn,
    per_rank_batch,
    wrap_ddp,
)
from fasttrain.errors import SettingError, flag_text
from fasttrain.flat import FlatParameters


def _flat(groups: list[list[nn.Parameter]]) -> FlatParameters:
    return FlatParameters([{"params": g} for g in groups])


# --- the pieces that need no process group -----------------------------------------------------------


def test_single_process_needs_no_process_group(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    info = init_distributed("cpu")
    assert (info.rank, info.world_size, info.backend, info.is_main) == (0, 1, "none", True)
    assert not dist.is_initialized()
    assert all_reduce_flag(True, info) and not all_reduce_flag(False, info)
    t = torch.arange(3.0)
    assert torch.equal(all_reduce_sum(t, info), torch.arange(3.0))
    # GradBuckets is inert for one process: no hooks, begin/wait/rebuild do nothing.
    p = nn.Parameter(torch.ones(4))
    gb = GradBuckets(_flat([[p]]), info)
    gb.begin()
    p.sum().backward()
    gb.wait()
    assert not gb.rebuild_from_observed_order() and gb.comm_stats() is None
    with pytest.raises(SettingError, match="torchrun"):
        wrap_ddp(nn.Linear(2, 2), info)
    assert per_rank_batch(256, info) == 256


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK is not"),
        ({"RANK": "0"}, "WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
        (
            {
                "WORLD_SIZE": "2",
                "RANK": "2",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "1",
            },
            "inconsistent",
        ),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "MASTER_ADDR is not set"),
    ],
)
def test_init_distributed_rejects_a_broken_environment(monkeypatch, env, message):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingError, match=message):
        init_distributed("cpu")


def test_cuda_device_errors(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SettingError, match="no CUDA device is visible"):
        init_distributed("cuda")
    # Three processes per node on a node with two devices: the third has no device of its own.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(SettingError, match=r"LOCAL_RANK=2 but only 2 CUDA device\(s\).*--nproc_per_node=2"):
        init_distributed("auto")


@pytest.mark.parametrize(
    "env,refused",
    [
        ({}, None),
        ({"TORCH_NCCL_BLOCKING_WAIT": "0"}, None),
        ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, "TORCH_NCCL_BLOCKING_WAIT"),
        ({"TORCH_NCCL_BLOCKING_WAIT": "True"}, "TORCH_NCCL_BLOCKING_WAIT"),
        ({"NCCL_BLOCKING_WAIT": "yes"}, "NCCL_BLOCKING_WAIT"),
        # torch reads the TORCH_ name first: it decides when both are set
        ({"TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_BLOCKING_WAIT": "1"}, None),
        ({"TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_BLOCKING_WAIT": "0"}, "TORCH_NCCL_BLOCKING_WAIT"),
    ],
)
def test_nccl_blocking_wait_is_refused_before_a_graph_capture(monkeypatch, env, refused):
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    nccl = DistInfo(
        rank=0, world_size=2, local_rank=0, device=torch.device("cuda", 0), backend="nccl", is_main=True
    )
    gloo = DistInfo(
        rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo", is_main=True
    )
    check_graph_capture_env(nccl, cuda_graph=False)  # eager steps: blocking wait is the user's choice
    check_graph_capture_env(gloo, cuda_graph=True)
    if refused is None:
        check_graph_capture_env(nccl, cuda_graph=True)
        return
    with pytest.raises(SettingError) as info:
        check_graph_capture_env(nccl, cuda_graph=True)
    message = str(info.value)
    assert message.startswith(f"{refused}={env[refused]} ") and f"unset {refused}" in message
    assert "cuda_graph=false" in message and "--cuda_graph=false" in flag_text(info.value)


def test_per_rank_batch_and_sync_bn_errors():
    info = DistInfo(
        rank=0, world_size=3, local_rank=0, device=torch.device("cpu"), backend="gloo", is_main=True
    )
    assert per_rank_batch(96, info) == 32
    with pytest.raises(SettingError, match="global batch 256 is not divisible by the world size 3"):
        per_rank_batch(256, info)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    assert maybe_sync_bn(model, False, info) is model
    with pytest.raises(SettingError, match="^sync_bn needs CUDA") as e:
        maybe_sync_bn(model, True, info)
    assert flag_text(e.value).startswith("--sync_bn needs CUDA") and "drop --sync_bn for CPU" in flag_text(
        e.value
    )
    converted = maybe_sync_bn(model, True)
    assert isinstance(converted[1], nn.SyncBatchNorm) and converted[0].weight is model[0].weight


def test_sync_bn_refuses_a_batch_norm_torch_does_not_convert():
    # The Inception seed's slim batch norm (beta only) is a module of its own, which torch's
    # convert_sync_batchnorm passes over: --sync_bn trained on with each rank's own statistics.
    from fasttrain.config import make_config
    from fasttrain.config_checks import ConfigError
    from fasttrain.models.inception_v3 import SlimBatchNorm

    with pytest.raises(SettingError, match="cannot convert this model's SlimBatchNorm layers") as e:
        maybe_sync_bn(nn.Sequential(nn.Conv2d(3, 4, 1), SlimBatchNorm(4), nn.BatchNorm2d(4)), True)
    assert flag_text(e.value).endswith("drop --sync_bn")
    # Refused when the configuration is made, before a process group or a loader starts.
    with pytest.raises(ConfigError, match="--sync_bn converts torch's BatchNorm layers, and inception_v3"):
        make_config(recipe="inception_v3", sync_bn=True)
    cfg = make_config(recipe="inception_v3", sync_bn=True, inception_bn_gamma=True)  # nn.BatchNorm2d
    from fasttrain.run import build_model

    converted = maybe_sync_bn(build_model(cfg), True)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in converted.modules())
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in converted.modules()) == 96


# --- torchrun: two nodes on one machine ----------------------------------------------------------


def _probe_main() -> None:
    """Entry point when torchrun runs this file: join the job, check a collective, leave."""
    info = init_distributed("cpu", timeout_s=120)
    try:
        total = all_reduce_sum(torch.tensor([float(info.rank + 1)]), info)
        expected = info.world_size * (info.world_size + 1) / 2
        assert total.item() == expected, (total, expected)
        assert all_reduce_flag(info.rank == info.world_size - 1, info)
        print(f"probe rank {info.rank}/{info.world_size} local {info.local_rank} ok", flush=True)
    finally:
        cleanup()


def test_torchrun_two_nodes_on_one_machine():
    results = run_torchrun([str(Path(__file__).resolve())], nproc=1, nnodes=2)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    out = "".join(r.stdout for r in results)
    assert "probe rank 0/2" in out and "probe rank 1/2" in out, out[-3000:]


if __name__ == "__main__":
    _probe_main()
