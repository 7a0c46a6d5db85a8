"""The checks of `python -m fasttrain selfcheck` (fasttrain/selfcheck.py runs them and prints the table).

Each check takes a Context and returns what it compared and measured, raises Skip(reason) when it
cannot run here, and fails by raising (an AssertionError names the first buffer or figure that
differs). They follow the tests that prove the same on the CPU in CI and on a GPU with `-m gpu`:
tests/test_optim.py and test_chunked.py (optimizer paths), tests/test_step.py (eager step, graph
replay, fp16 overflow, host syncs), tests/test_distributed.py (buckets vs DDP),
tests/test_dali_pipeline.py (DALI vs the torch pipeline). Sizes are tiny: this is a minute or two
on the user's machine, not a benchmark (bench/run.py is that).
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fasttrain.selfcheck import Skip

# The test suite's tolerances (tests/test_kernels.py, test_step.py): the paths compute in fp32 and
# differ only in rounding order; semantic slips move values by >= 1e-3.
ATOL, RTOL = 2e-6, 1e-6


@dataclass
class Context:
    device: torch.device
    scratch: Path
    """A temporary directory, removed after the run."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def _needs_cuda(ctx: Context, what: str) -> None:
    if not ctx.cuda:
        raise Skip(f"no CUDA device: {what} runs only on a GPU")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # note: host waits for the device (timing and comparisons only)


# --- the optimizer: fast paths vs the readable reference ----------------------------------------


def _optimizer_run(kind: str, impl: str, device: torch.device, sizes, steps: int = 6):
    """`steps` updates (the 4th skipped by found_inf) of params of `sizes`; returns the optimizer."""
    from fasttrain.optim import FusedMomentum, FusedRMSPropTF

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device)) for n in sizes]
    groups = [{"params": params[::2], "weight_decay": 4e-5}, {"params": params[1::2], "weight_decay": 0.0}]
    lr = torch.tensor(0.1, device=device)
    if kind == "rmsprop":
        opt = FusedRMSPropTF(groups, lr=lr, decay=0.9, momentum=0.9, eps=1.0, ema_decay=0.999, impl=impl)
    else:
        opt = FusedMomentum(groups, lr=lr, momentum=0.9, nesterov=True, ema_decay=0.999, impl=impl)
    scale = torch.tensor(0.37 / 1024, device=device)  # a loss scale's unscale and a non-power-of-two
    for i in range(steps):
        lr.fill_(0.1 * 0.8**i)
        for p in params:
            p.grad.copy_(torch.randn(p.shape, generator=gen).to(device) * 1024)
        skip = i == 3
        if skip:
            before = [b.clone() for b in _buffers(opt)]
            for p in params:
                p.grad.fill_(float("inf"))
        opt.step(grad_scale=scale, found_inf=torch.tensor(float(skip), device=device))
        if skip:
            for name, b, a in zip(_names(opt), before, _buffers(opt)):
                assert torch.equal(b, a), f"{kind} {opt.impl}: the skipped step changed {name}"
    return opt


def _names(opt) -> list[str]:
    return ["weights", *opt._buffers.keys(), "applied_steps"]


def _buffers(opt) -> list[torch.Tensor]:
    return [opt.flat.params, *opt._buffers.values(), opt.applied_steps]


def _compare_optimizers(impl: str, device: torch.device, sizes) -> str:
    worst = 0.0
    for kind in ("rmsprop", "momentum"):
        fast = _optimizer_run(kind, impl, device, sizes)
        reference = _optimizer_run(kind, "torch", device, sizes)
        assert fast.impl == impl, f"asked for {impl}, the optimizer dispatched to {fast.impl}"
        for name, a, b in zip(_names(fast), _buffers(fast), _buffers(reference)):
            torch.testing.assert_close(
                a, b, atol=ATOL, rtol=RTOL, msg=lambda m, n=name, k=kind: f"{k} {n}: {m}"
            )
            if a.is_floating_point():
                worst = max(worst, float((a - b).abs().max()))
    return (
        f"RMSProp-TF and Nesterov momentum + EMA, {sum(sizes)} params in {len(sizes)} tensors, 6 steps "
        f"with a skipped overflow step: every buffer within {ATOL:g}+{RTOL:g}x of the reference "
        f"(max diff {worst:.1e}), the skip bit-identical"
    )


def check_optimizer_chunked(ctx: Context) -> str:
    return _compare_optimizers("chunked", ctx.device, (1, 127, 1000, 40_003))


def check_optimizer_triton(ctx: Context) -> str:
    from fasttrain.kernels._common import HAVE_TRITON

    if not HAVE_TRITON:
        raise Skip("triton is not installed: the chunked torch path is used")
    if ctx.cuda:
        if torch.cuda.get_device_capability(ctx.device) < (7, 0):
            raise Skip("Triton does not support this GPU (sm < 70): the chunked torch path is used")
        return "compiled: " + _compare_optimizers("triton", ctx.device, (1, 127, 1000, 1_000_003))
    # On the CPU the kernels run in Triton's interpreter (NumPy): a few hundred elements, so seconds.
    with _env("TRITON_INTERPRET", "1"):
        return "interpreter (CPU): " + _compare_optimizers("triton", ctx.device, (1, 127, 300))


@contextlib.contextmanager
def _env(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


# --- the training step ---------------------------------------------------------------------------


def _batches(n: int, device, batch=4, size=32, classes=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=gen).to(device),
            torch.randint(0, classes, (batch,), generator=gen).to(device),
        )
        for _ in range(n)
    ]


def _train_step(model, precision, device, impl="auto", dist_info=None, ddp_model=None, cap_mb=0.25):
    """The trainer's TrainStep with momentum SGD (lr 0.05, wd 1e-4), label smoothing 0.1."""
    from fasttrain.buckets import GradBuckets
    from fasttrain.config import make_config
    from fasttrain.optim import FusedMomentum
    from fasttrain.schedule import LRSchedule
    from fasttrain.step import TrainStep, classification_loss

    cfg = make_config(initial_learning_rate=0.05, learning_rate_decay_factor=1.0)
    opt = FusedMomentum(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, impl=impl)
    schedule = LRSchedule(cfg, steps_per_epoch=100, global_batch=4, device=device)
    loss_fn = lambda out, y: classification_loss(out, y, label_smoothing=0.1)  # noqa: E731
    buckets = None
    if dist_info is not None and ddp_model is None:
        buckets = GradBuckets(
            opt.flat, dist_info, bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb / 5, enabled=True
        )
    world = dist_info.world_size if dist_info is not None else 1
    step = TrainStep(
        model, opt, precision, device, schedule, loss_fn, "resnet",
        world_size=world, buckets=buckets, ddp_model=ddp_model,
    )  # fmt: skip
    return step


def _small_resnet(device, channels_last=False, seed=0):
    from fasttrain.models import create_model

    torch.manual_seed(seed)
    model = create_model("resnet18", 5, base_channels=8 if device.type == "cpu" else 16).to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def check_eager_step(ctx: Context) -> str:
    # As tests/test_step.py: each step starts both sides from the same weights and momentum, so the
    # comparison is one step deep (a BN-heavy net amplifies last-bit rounding over free steps).
    from fasttrain.data.normalize import normalize_images
    from fasttrain.precision import Precision

    with _deterministic():
        model = _small_resnet(ctx.device)
        reference = copy.deepcopy(model)
        step = _train_step(model, Precision("fp32", channels_last=False, cuda_graph=False), ctx.device)
        sgd = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        tol = dict(rtol=2e-6, atol=1e-7) if not ctx.cuda else dict(rtol=1e-5, atol=1e-6)
        for images, labels in _batches(4, ctx.device):
            step([(images, labels)])
            sgd.zero_grad()
            x = normalize_images(images, "resnet", torch.float32, False)
            F.cross_entropy(reference(x), labels, label_smoothing=0.1).backward()
            sgd.step()
            ours = step.optimizer.state_dict()["state"]
            for i, ((name, a), b) in enumerate(zip(model.named_parameters(), reference.parameters())):
                torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")
                momentum = sgd.state[b]["momentum_buffer"]
                torch.testing.assert_close(ours[i]["momentum_buffer"], momentum, **tol)
                b.data.copy_(a)
                momentum.copy_(ours[i]["momentum_buffer"])
    impl = step.optimizer.impl
    return f"ResNet-18 (tiny), 4 steps, optimizer {impl}: weights and momentum = torch.optim.SGD"


@contextlib.contextmanager
def _deterministic():
    flags = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags


def _run_graphed(ctx: Context, graph: bool, steps: int, precision: str = "fp32"):
    from fasttrain.precision import Precision

    model = _small_resnet(ctx.device, channels_last=True)
    step = _train_step(model, Precision(precision, channels_last=True, cuda_graph=graph), ctx.device)
    for batch in _batches(steps, ctx.device, seed=1):
        step([batch])
    _sync(ctx.device)
    return model, step


def check_graph_replay(ctx: Context) -> str:
    _needs_cuda(ctx, "CUDA-graph capture and replay")
    with _deterministic():
        eager, _ = _run_graphed(ctx, graph=False, steps=10)
        graphed, step = _run_graphed(ctx, graph=True, steps=10)
    assert step.graph is not None, "the step was not captured"
    for (key, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    return "ResNet-18 (tiny), fp32 channels_last, 10 steps (3 eager warm-up, 1 capture, 6 replays) = eager"


def check_fp16_overflow(ctx: Context) -> str:
    _needs_cuda(ctx, "fp16 loss scaling under graph replay")
    model, step = _run_graphed(ctx, graph=True, steps=5, precision="fp16")
    skipped = step.scaler.skipped_steps.item()  # note: host read, outside the replayed step
    before = [p.detach().clone() for p in model.parameters()]
    step.scaler.scale.fill_(3e38)  # the scaled loss overflows: inf/NaN gradients everywhere
    step([_batches(1, ctx.device, seed=7)[0]])
    _sync(ctx.device)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), (
        "an overflow step changed weights"
    )
    assert step.scaler.skipped_steps.item() == skipped + 1, "the overflow step was not counted as skipped"
    assert step.scaler.scale.item() == 1.5e38, f"loss scale not halved: {step.scaler.scale.item()}"
    step.scaler.scale.fill_(1024.0)
    step([_batches(1, ctx.device, seed=8)[0]])
    _sync(ctx.device)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters())), (
        "the next step did not train"
    )
    return (
        "scale forced to 3e38 in a replayed fp16 step: weights unchanged, skip counted, scale halved; "
        "the next step trains"
    )


def check_no_host_sync(ctx: Context) -> str:
    _needs_cuda(ctx, "torch.cuda.set_sync_debug_mode")
    _, step = _run_graphed(ctx, graph=True, steps=5)
    batch = _batches(1, ctx.device, seed=9)[0]
    torch.cuda.set_sync_debug_mode("error")
    try:
        step([batch])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return "a replayed step ran under torch.cuda.set_sync_debug_mode('error')"


# --- gradient buckets vs torch DDP ---------------------------------------------------------------

_BUCKET_STEPS, _PER_RANK = 8, 4


def _convnet(device) -> torch.nn.Module:
    # No BatchNorm: parameters then depend only on the averaged gradients (as tests/test_distributed.py).
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
    info = init_distributed(device, timeout_s=120)  # a deadlock ends in an error, not a hang
    results = {}
    try:
        graph = info.device.type == "cuda"
        for mode in ("buckets", "ddp"):
            model = _convnet(info.device)
            ddp = wrap_ddp(model, info, bucket_cap_mb=0.002) if mode == "ddp" else None
            precision = Precision("fp32", channels_last=False, cuda_graph=graph and mode == "buckets")
            step = _train_step(model, precision, info.device, dist_info=info, ddp_model=ddp, cap_mb=0.002)
            mine = slice(rank * _PER_RANK, (rank + 1) * _PER_RANK)
            for images, labels in _batches(_BUCKET_STEPS, info.device, batch=_PER_RANK * world, size=8):
                step([(images[mine], labels[mine])])
            _sync(info.device)
            if step.graph is not None:
                step.release_graph()  # before leaving a NCCL group (pytorch#115388)
            vec = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            everyone = [torch.empty_like(vec) for _ in range(world)]
            dist.all_gather(everyone, vec)
            assert all(torch.equal(v, vec) for v in everyone), f"{mode}: ranks ended with different weights"
            buckets = len(step.buckets.bucket_ranges) if step.buckets is not None else 0
            results[mode] = (vec.cpu(), buckets, step.graph is not None or (graph and mode == "buckets"))
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
        if os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") not in ("", "0"):
            raise Skip("TORCH_NCCL_BLOCKING_WAIT is set: NCCL collectives cannot be captured; unset it")
        backend, world = "cuda", 2
    else:
        if not dist.is_gloo_available():
            raise Skip("this torch has no gloo")
        backend, world = "cpu", 2
    out = ctx.scratch / "buckets.pt"
    mp.spawn(_bucket_rank, args=(world, _free_port(), backend, str(out)), nprocs=world, join=True)
    results = torch.load(out)
    (ours, buckets, _), (ddp, _, _) = results["buckets"], results["ddp"]
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
    _needs_cuda(ctx, "DALI's mixed (nvJPEG) decode")
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
    from fasttrain.precision import Precision, resolve_precision

    chosen = resolve_precision(make_config(), ctx.device)
    if ctx.cuda:
        name, kwargs, size, batch, warmup, timed = "resnet50", {}, 128, 64, 6, 20
    else:
        name, kwargs, size, batch, warmup, timed = "resnet18", {"base_channels": 16}, 64, 8, 1, 3
    torch.manual_seed(0)
    model = create_model(name, 1000, **kwargs).to(ctx.device)
    if chosen.channels_last:
        model = model.to(memory_format=torch.channels_last)
    precision = Precision(chosen.name, chosen.channels_last, cuda_graph=graph)
    step = _train_step(model, precision, ctx.device)
    batch_data = _batches(1, ctx.device, batch=batch, size=size, classes=1000)[0]
    for _ in range(warmup):  # the graph's eager warm-up and capture, cuDNN autotuning: not timed
        step([batch_data])
    _sync(ctx.device)
    start = time.perf_counter()
    for _ in range(timed):
        step([batch_data])
    _sync(ctx.device)
    rate = timed * batch / (time.perf_counter() - start)
    label = name if not kwargs else f"{name} at {kwargs['base_channels']} channels"
    return (
        f"{rate:,.0f} img/s ({label}, {size} px, batch {batch}, {precision.name}, {timed} steps); "
        "a sanity figure, not a benchmark (bench/run.py)"
    )


def check_throughput_eager(ctx: Context) -> str:
    return _throughput(ctx, graph=False)


def check_throughput_graph(ctx: Context) -> str:
    _needs_cuda(ctx, "a CUDA-graph step")
    return _throughput(ctx, graph=True)


CHECKS = {
    "optimizer-chunked": check_optimizer_chunked,
    "optimizer-triton": check_optimizer_triton,
    "eager-step": check_eager_step,
    "graph-replay": check_graph_replay,
    "fp16-overflow": check_fp16_overflow,
    "no-host-sync": check_no_host_sync,
    "buckets-vs-ddp": check_buckets_vs_ddp,
    "dali-cpu": check_dali_cpu,
    "dali-mixed": check_dali_mixed,
    "throughput-eager": check_throughput_eager,
    "throughput-graph": check_throughput_graph,
}
