"""Optimizer update microbenchmarks: the fused flat-buffer kernels vs the alternatives.

    python -m pytest bench/bench_optim.py --benchmark-only     # --benchmark-json=FILE keeps numbers

One call = one update of every parameter plus the weight EMA (decay 0.9999 with warm-up), on the
parameter set of ResNet-50 v1.5 (25,557,032 parameters, 161 tensors) or ResNet-101 (44,549,160, 314),
their shapes generated here. On the CPU the channel widths are divided by 8 (0.63M / 0.93M
parameters) so a run takes seconds; FASTTRAIN_BENCH_FULL=1 forces the full sets.

Contenders:
    rmsprop  fused-triton   FusedRMSPropTF, Triton kernel (CUDA only; the interpreter is not timed)
             fused-torch    FusedRMSPropTF(impl="torch"): the multi-pass reference
             torch-foreach  torch.optim.RMSprop(foreach=True) + torch._foreach_lerp_ EMA (different
                            numerics, see kernels/rmsprop_tf.py: the speed baseline only)
    momentum fused-triton, fused-torch (FusedMomentum), torch-foreach (torch.optim.SGD(foreach=True)
             + _foreach_lerp_), apex-fused (apex.optimizers.FusedSGD + _foreach_lerp_; CUDA, when
             NVIDIA apex imports)

The fused optimizers get grad_scale and found_inf as device tensors, as the trainer passes them.
Reported in extra_info: per-update ms; effective GB/s counting the minimum traffic of a one-pass
update (RMSProp+EMA 36 B/param, Momentum+EMA 28 B/param: w, g read; w, states, EMA read and
written); the device copy bandwidth measured in the same run (dst.copy_(src), read + write, 1 GiB on
CUDA, 64 MiB on the CPU) and the fraction of it reached; the environment. Targets on a GPU: >= 85% of
copy bandwidth and >= 4x torch-foreach. Timing: CUDA events around `CALLS` updates after warm-up
rounds (Triton compilation excluded); the host waits for the device inside each benchmark call.
"""

import os
import platform
import subprocess

import pytest
import torch

from fasttrain.optim import FusedMomentum, FusedRMSPropTF

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FULL = DEVICE.type == "cuda" or os.environ.get("FASTTRAIN_BENCH_FULL") == "1"
WIDTH_DIVISOR = 1 if FULL else 8
CALLS = 10 if DEVICE.type == "cuda" else 2  # updates per benchmark call
ROUNDS, WARMUP_ROUNDS = (20, 3) if DEVICE.type == "cuda" else (3, 1)
BLOCKS = {"resnet50": (3, 4, 6, 3), "resnet101": (3, 4, 23, 3)}
FULL_COUNTS = {"resnet50": 25_557_032, "resnet101": 44_549_160}
BYTES_PER_PARAM = {"rmsprop": 36, "momentum": 28}
EMA_DECAY, LR = 0.9999, 1e-3


def resnet_shapes(blocks: tuple[int, ...], width_divisor: int = 1, classes: int = 1000) -> list[tuple]:
    """Parameter shapes of ResNet v1.5 (bottleneck blocks, BN gamma and beta, fc with bias)."""
    c = lambda n: max(1, n // width_divisor)
    shapes = [(c(64), 3, 7, 7), (c(64),), (c(64),)]
    inplanes = c(64)
    for stage, count in enumerate(blocks):
        planes = c(64 * 2**stage)
        for block in range(count):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,)]
            shapes += [(planes, planes, 3, 3), (planes,), (planes,)]
            shapes += [(4 * planes, planes, 1, 1), (4 * planes,), (4 * planes,)]
            if block == 0:  # projection shortcut
                shapes += [(4 * planes, inplanes, 1, 1), (4 * planes,), (4 * planes,)]
            inplanes = 4 * planes
    return shapes + [(classes, inplanes), (classes,)]


def _params(model: str) -> list[torch.nn.Parameter]:
    shapes = resnet_shapes(BLOCKS[model], WIDTH_DIVISOR)
    if WIDTH_DIVISOR == 1:
        assert sum(torch.Size(s).numel() for s in shapes) == FULL_COUNTS[model]
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).to(DEVICE))
        if p.dim() == 4:  # as the trainer holds conv weights
            p.data = p.data.to(memory_format=torch.channels_last)
        p.grad = torch.randn_like(p) * 1e-2
        params.append(p)
    return params


def _environment() -> dict:
    env = {
        "device": str(DEVICE),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if DEVICE.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(DEVICE), cuda=torch.version.cuda)
        try:  # note: the driver version is only reachable through nvidia-smi
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def _timed(fn, calls: int) -> float:
    """Seconds for `calls` calls, device work included."""
    if DEVICE.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()  # note: host waits for the device, after the timed window closed
        return start.elapsed_time(end) / 1e3
    import time

    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def copy_gb_per_s() -> float:
    """Device copy bandwidth (read + write), median of 3 windows, measured once per run."""
    nbytes = 2**30 if DEVICE.type == "cuda" else 2**26
    src = torch.ones(nbytes // 4, device=DEVICE)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)
    _timed(copy, 3)
    windows = sorted(_timed(copy, 10) for _ in range(3))
    return 2 * nbytes / (windows[1] / 10) / 1e9


def _foreach_step(params, optimizer):
    """torch.optim step + foreach EMA with TF's warm-up decay (computed on the host)."""
    emas = [p.detach().clone() for p in params]
    count = [0]

    def step():
        optimizer.step()
        count[0] += 1
        decay = min(EMA_DECAY, (1 + count[0]) / (10 + count[0]))
        torch._foreach_lerp_(emas, [p.detach() for p in params], 1 - decay)

    return step


def _contender(kind: str, name: str, params):
    one = torch.ones((), device=DEVICE)
    zero = torch.zeros((), device=DEVICE)
    if name.startswith("fused"):
        impl = "triton" if name == "fused-triton" else "torch"
        if impl == "triton" and DEVICE.type != "cuda":
            pytest.skip("the Triton kernel is timed on CUDA only (the CPU interpreter is a test tool)")
        lr = torch.tensor(LR, device=DEVICE)
        if kind == "rmsprop":
            opt = FusedRMSPropTF(params, lr=lr, weight_decay=4e-5, ema_decay=EMA_DECAY, impl=impl)
        else:
            opt = FusedMomentum(params, lr=lr, weight_decay=1e-4, ema_decay=EMA_DECAY, impl=impl)
        return lambda: opt.step(grad_scale=one, found_inf=zero)
    if name == "torch-foreach":
        if kind == "rmsprop":
            opt = torch.optim.RMSprop(
                params, lr=LR, alpha=0.9, eps=1.0, momentum=0.9, weight_decay=4e-5, foreach=True
            )
        else:
            opt = torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=1e-4, foreach=True)
        return _foreach_step(params, opt)
    if name == "apex-fused":
        if DEVICE.type != "cuda":
            pytest.skip("apex FusedSGD needs CUDA")
        apex_optimizers = pytest.importorskip("apex.optimizers", reason="NVIDIA apex is not installed")
        opt = apex_optimizers.FusedSGD(params, lr=LR, momentum=0.9, weight_decay=1e-4)
        return _foreach_step(params, opt)
    raise ValueError(name)


def _measure(benchmark, kind: str, name: str, model: str, copy_gb_per_s: float) -> None:
    params = _params(model)
    step = _contender(kind, name, params)
    num_params = sum(p.numel() for p in params)

    def calls():
        for _ in range(CALLS):
            step()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()  # note: the device work belongs to the timed call

    benchmark.pedantic(calls, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    if benchmark.disabled:  # --benchmark-disable: ran once as a smoke test, nothing measured
        return
    seconds = benchmark.stats.stats.median / CALLS
    gb_per_s = BYTES_PER_PARAM[kind] * num_params / seconds / 1e9
    benchmark.extra_info.update(
        optimizer=kind,
        contender=name,
        model=model,
        num_params=num_params,
        width_divisor=WIDTH_DIVISOR,
        ms_per_update=seconds * 1e3,
        bytes_per_param=BYTES_PER_PARAM[kind],
        effective_gb_per_s=gb_per_s,
        copy_gb_per_s=copy_gb_per_s,
        fraction_of_copy=gb_per_s / copy_gb_per_s,
        **_environment(),
    )


@pytest.mark.parametrize("model", list(BLOCKS))
@pytest.mark.parametrize("name", ["fused-triton", "fused-torch", "torch-foreach"])
def test_rmsprop_ema(benchmark, name, model, copy_gb_per_s):
    benchmark.group = f"rmsprop+ema {model}"
    _measure(benchmark, "rmsprop", name, model, copy_gb_per_s)


@pytest.mark.parametrize("model", list(BLOCKS))
@pytest.mark.parametrize("name", ["fused-triton", "fused-torch", "torch-foreach", "apex-fused"])
def test_momentum_ema(benchmark, name, model, copy_gb_per_s):
    benchmark.group = f"momentum+ema {model}"
    _measure(benchmark, "momentum", name, model, copy_gb_per_s)
