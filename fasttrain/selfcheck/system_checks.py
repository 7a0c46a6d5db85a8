"""The selfcheck's checks across processes and pipelines, after tests/test_buckets.py (fasttrain's
gradient buckets against torch DDP), tests/test_dali_pipeline.py (DALI against the torch pipeline),
and a short throughput figure (a sanity figure: python -m bench.run is the benchmark).
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from fasttrain.selfcheck.common import Context, Skip, batches, needs_cuda, sync, train_step

# --- gradient buckets vs torch DDP ---------------------------------------------------------------

_BUCKET_STEPS, _PER_RANK = 8, 4


def _convnet(device) -> torch.nn.Module:
    # No BatchNorm: parameters then depend only on the averaged gradients (as tests/test_buckets.py).
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 5),
    )  # fmt: skip
    return net.to(device)


def _bucket_rank(rank: int, world: int, port: int, device: str, out: str) -> None:
    """One rank: the same steps with fasttrain's buckets (captured in a graph on CUDA) and with DDP."""
    import torch.distributed as dist

    from fasttrain.distributed import cleanup, init_distributed, wrap_ddp
    from fasttrain.precision import Precision

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    torch.set_num_threads(1)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    info = init_distributed(device, timeout_s=120)  # a deadlock ends in an error, not a hang
    results = {}
    try:
        graph = info.device.type == "cuda"
        for mode in ("buckets", "ddp"):
            model = _convnet(info.device)
            ddp = wrap_ddp(model, info, bucket_cap_mb=0.002) if mode == "ddp" else None
            precision = Precision("fp32", channels_last=False, cuda_graph=graph and mode == "buckets")
            step = train_step(model, precision, info.device, dist_info=info, ddp_model=ddp, cap_mb=0.002)
            mine = slice(rank * _PER_RANK, (rank + 1) * _PER_RANK)
            for images, labels in batches(_BUCKET_STEPS, info.device, batch=_PER_RANK * world, size=8):
                step([(images[mine], labels[mine])])
            sync(info.device)
            captured = step.graph is not None
            if captured:
                step.release_graph()  # before leaving a NCCL group (pytorch#115388)
            vec = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            everyone = [torch.empty_like(vec) for _ in range(world)]
            dist.all_gather(everyone, vec)
            assert all(torch.equal(v, vec) for v in everyone), f"{mode}: ranks ended with different weights"
            buckets = len(step.buckets.bucket_ranges) if step.buckets is not None else 0
            results[mode] = (vec.cpu(), buckets, captured)
    finally:
        cleanup()
    if rank == 0:
        torch.save(results, out)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_buckets_vs_ddp(ctx: Context) -> str:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if ctx.cuda:
        if torch.cuda.device_count() < 2:
            raise Skip("one GPU: bucket all-reduces inside a graph need >= 2 GPUs (NCCL, one rank per GPU)")
        if not dist.is_nccl_available():
            raise Skip("this torch has no NCCL")
        # The trainer's own start-up check: blocking wait makes NCCL collectives uncapturable (a fail:
        # training with the default CUDA graph would refuse to start here).
        from fasttrain.dist_info import DistInfo
        from fasttrain.distributed import check_graph_capture_env

        check_graph_capture_env(DistInfo(0, 2, 0, ctx.device, "nccl", True), cuda_graph=True)
        backend, world = "cuda", 2
    else:
        if not dist.is_gloo_available():
            raise Skip("this torch has no gloo")
        backend, world = "cpu", 2
    out = ctx.scratch / "buckets.pt"
    mp.spawn(_bucket_rank, args=(world, _free_port(), backend, str(out)), nprocs=world, join=True)
    results = torch.load(out)
    (ours, buckets, captured), (ddp, _, _) = results["buckets"], results["ddp"]
    assert captured or not ctx.cuda, "the bucketed step was not captured in a CUDA graph"
    start = torch.cat([p.detach().reshape(-1) for p in _convnet("cpu").parameters()])
    moved = float((ours - start).norm() / start.norm())
    rel = float((ours - ddp).norm() / ddp.norm())
    assert moved > 1e-3, f"the bucketed run did not train (moved {moved:.1e})"
    assert buckets >= 2, f"only {buckets} bucket(s): the check needs several"
    assert rel <= 1e-5, f"bucketed weights differ from DDP's by {rel:.1e} (relative; limit 1e-5)"
    how = "NCCL, captured in a CUDA graph" if ctx.cuda else "gloo on CPU ranks, eager: no graph without CUDA"
    return (
        f"{world} ranks, {buckets} buckets, {_BUCKET_STEPS} steps ({how}): "
        f"weights = DDP's (rel diff {rel:.1e})"
    )


# --- DALI vs the torch pipeline ------------------------------------------------------------------


def _shards(ctx: Context):
    from fasttrain.config import make_config
    from fasttrain.data.synthetic import ensure_synthetic

    data = ctx.scratch / "shards"
    ensure_synthetic(data, 1, 1, 24, 4, seed=0)  # labels 1..4 in the converter's layout
    return make_config(
        data_dir=str(data), batch_size=8, image_size=32, num_classes=4, label_offset=-1,
        num_workers=0, preprocess="resnet", data_cache_dir=str(ctx.scratch / "index"),
    )  # fmt: skip


def _needs_dali() -> None:
    from fasttrain.data import dali_available

    if not dali_available():
        raise Skip("NVIDIA DALI is not installed (pip install 'fasttrain[dali]')")


def _dali_vs_torch(cfg, device) -> tuple[list, float, float]:
    """DALI eval batches on `device` against the torch pipeline's: labels equal; pixel levels."""
    from fasttrain.data.dali_pipeline import DaliLoader
    from fasttrain.data.normalize import normalize_images
    from fasttrain.data.torch_pipeline import TorchLoader

    dali = [(x.cpu(), y.cpu()) for x, y in DaliLoader(cfg, "validation", False, device=device)]
    reference = list(TorchLoader(cfg, "validation", False))
    assert len(dali) == len(reference) > 0, (
        f"DALI gave {len(dali)} batches, the torch pipeline {len(reference)}"
    )
    assert [y.tolist() for _, y in dali] == [y.tolist() for _, y in reference], "labels or their order differ"
    images = torch.cat([x for x, _ in dali])
    expected = torch.cat([normalize_images(x, "resnet", torch.float32, False) for x, _ in reference])
    levels = (images - expected.permute(0, 2, 3, 1)).abs()  # resnet inputs are in levels (mean subtracted)
    return dali, float(levels.mean()), float(levels.max())


def check_dali_cpu(ctx: Context) -> str:
    _needs_dali()
    _, mean, top = _dali_vs_torch(_shards(ctx), torch.device("cpu"))
    # DALI decodes with the accurate IDCT and resizes with its own filter; the torch pipeline is
    # TensorFlow's fast IDCT and resize: about a level apart on average on these synthetic JPEGs.
    assert mean < 2.0, f"DALI's CPU images differ from the torch pipeline's by {mean:.2f} levels on average"
    return f"24 eval records: labels equal, pixels {mean:.2f} levels apart on average (max {top:.0f})"


def check_dali_mixed(ctx: Context) -> str:
    needs_cuda(ctx, "DALI's mixed (nvJPEG) decode")
    _needs_dali()
    from fasttrain.data.dali_pipeline import DaliLoader

    cfg = _shards(ctx)
    gpu, mean, top = _dali_vs_torch(cfg, ctx.device)
    assert mean < 2.0, f"DALI's GPU images differ from the torch pipeline's by {mean:.2f} levels on average"
    cpu = list(DaliLoader(cfg, "validation", False))
    vs_cpu = max(float((g - c).abs().max()) for (g, _), (c, _) in zip(gpu, cpu))
    # nvJPEG and libjpeg-turbo may differ by a few levels in the IDCT; the resize averages them out.
    assert vs_cpu <= 4.0, f"DALI's GPU and CPU decodes differ by {vs_cpu:.0f} levels"
    images, _ = next(iter(DaliLoader(cfg, "train", True, device=ctx.device, dtype=torch.float16)))
    assert images.is_cuda and images.dtype == torch.float16, "training batches are not fp16 on the GPU"
    return (
        f"labels equal, {mean:.2f} levels from the torch pipeline (max {top:.0f}), "
        f"<= {vs_cpu:.0f} from DALI's CPU decode"
    )


# --- throughput ----------------------------------------------------------------------------------


def _throughput(ctx: Context, graph: bool) -> str:
    from fasttrain.config import make_config
    from fasttrain.models import create_model
    from fasttrain.precision import resolve_precision

    chosen = resolve_precision(make_config(), ctx.device)
    if ctx.cuda:
        name, kwargs, size, batch, warmup, timed = "resnet50", {}, 128, 64, 6, 20
    else:
        name, kwargs, size, batch, warmup, timed = "resnet18", {"base_channels": 16}, 64, 8, 1, 3
    torch.manual_seed(0)
    model = create_model(name, 1000, **kwargs).to(ctx.device)
    if chosen.channels_last:
        model = model.to(memory_format=torch.channels_last)
    precision = dataclasses.replace(chosen, cuda_graph=graph)  # its --pad_stem too
    step = train_step(model, precision, ctx.device)
    batch_data = batches(1, ctx.device, batch=batch, size=size, classes=1000)[0]
    for _ in range(warmup):  # the graph's eager warm-up and capture, cuDNN autotuning: not timed
        step([batch_data])
    sync(ctx.device)
    start = time.perf_counter()
    for _ in range(timed):
        step([batch_data])
    sync(ctx.device)
    rate = timed * batch / (time.perf_counter() - start)
    label = name if not kwargs else f"{name} at {kwargs['base_channels']} channels"
    return (
        f"{rate:,.0f} img/s ({label}, {size} px, batch {batch}, {precision.name}, {timed} steps); "
        "a sanity figure, not a benchmark (python -m bench.run)"
    )


def check_throughput_eager(ctx: Context) -> str:
    return _throughput(ctx, graph=False)


def check_throughput_graph(ctx: Context) -> str:
    needs_cuda(ctx, "a CUDA-graph step")
    return _throughput(ctx, graph=True)
