"""Optimizer update microbenchmarks: fasttrain's update paths vs torch.optim, full-size parameter sets.

    python -m pytest bench/bench_optim.py --benchmark-only     # --benchmark-json=FILE keeps numbers
    FASTTRAIN_BENCH_SMOKE=1 python -m pytest bench --benchmark-only   # what CI runs: seconds

One call = one update of every parameter plus the weight EMA (decay 0.9999 with TF's warm-up), with
the same L2 weight decay for every contender (RMSProp 4e-5, momentum 1e-4), on the parameter set of
ResNet-50 v1.5 (25,557,032 parameters, 161 tensors), ResNet-101 (44,549,160, 314) or Inception v3
(27,161,264, 292; 1000 classes; not in the smoke run, it has no width knob), shapes taken
from fasttrain.models built on the meta device (nothing runs). Full size on every device: on the CPU
the update is memory-bound only once the buffers outgrow the caches (100-180 MB each), which a
shrunken model hides. FASTTRAIN_BENCH_SMOKE=1 builds them at base width 4 (about 0.1M parameters)
with one round, to check that everything runs.

Contenders:
    fasttrain-triton     FusedRMSPropTF / FusedMomentum, Triton kernel (CUDA only; the CPU
                         interpreter is a test tool, not timed)
    fasttrain-chunked    the same optimizers, impl="chunked": the fast torch path (CPU, P40)
    fasttrain-reference  impl="torch": the readable multi-pass reference
    torch-foreach        torch.optim.RMSprop / SGD(foreach=True) + torch._foreach_lerp_ EMA (RMSprop's
                         numerics differ, see kernels/rmsprop_tf.py: a speed baseline only)
    torch-fused          torch.optim.SGD(fused=True) + _foreach_lerp_ (momentum only: torch's RMSprop
                         has no fused implementation)
    apex-fused           apex.optimizers.FusedSGD + _foreach_lerp_ (momentum, CUDA, when apex imports)
fasttrain's optimizers get grad_scale and found_inf as device tensors, as the trainer passes them.

`test_*_ema[contender-model]` time one contender each. `test_interleaved_*[model]` builds every
contender available on the device and times them in turn, round after round, with a copy to time
the bandwidth in the same round, so load from other processes hits all alike; its extra_info holds
each contender's median and its speed-up over torch-foreach (`interleaved`), and its top-level keys
describe the device's fastest fasttrain path (contender "<name> (interleaved)"), so
bench/report.py lists it as one more row.

Reported in extra_info: ms per update; `bytes_per_param`, the minimum traffic of a one-pass update
(RMSProp+EMA 36 B: w, g, ms, mom, ema read, w, ms, mom, ema written; Momentum+EMA 28 B); effective
GB/s at that traffic; the copy bandwidth measured in the same run (bench/common.py's copy_bandwidth
of 256 MiB on the CPU, 1 GiB on CUDA, read + write counted) and the fraction of it reached;
`copy_equivalent_bytes_per_param`, the bytes per parameter a copy would move in the update's time
(the floor, 36 or 28, means the update runs at copy speed); the load average before and after (the
machine may be shared); the environment.
Timing: bench/common.py's timer, CUDA events around CALLS updates after warm-up rounds (compilation
excluded); on the CPU time.perf_counter around CALLS updates.
"""

import functools
import os
import statistics

import pytest
import torch

from bench.common import copy_bandwidth, queued_timed, synchronize
from fasttrain.models import create_model
from fasttrain.optim import FusedMomentum, FusedRMSPropTF

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMOKE = os.environ.get("FASTTRAIN_BENCH_SMOKE") == "1"
BASE_CHANNELS = 4 if SMOKE else 64
# Inception v3 (the RMSProp seed's network) has no width knob: full size only, so not in the smoke run.
MODELS = ("resnet50", "resnet101") + (() if SMOKE else ("inception_v3",))
FULL_COUNTS = {"resnet50": 25_557_032, "resnet101": 44_549_160, "inception_v3": 27_161_264}
CALLS = 10 if DEVICE.type == "cuda" else 1  # updates per timed call (a CPU update takes 10-1000 ms)
ROUNDS, WARMUP_ROUNDS = (1, 0) if SMOKE else (20, 3) if DEVICE.type == "cuda" else (5, 1)
COPY_BYTES = 2**24 if SMOKE else 2**30 if DEVICE.type == "cuda" else 2**28
BYTES_PER_PARAM = {"rmsprop": 36, "momentum": 28}
WEIGHT_DECAY = {"rmsprop": 4e-5, "momentum": 1e-4}
EMA_DECAY, LR = 0.9999, 1e-3
CONTENDERS = {
    "rmsprop": ["fasttrain-triton", "fasttrain-chunked", "fasttrain-reference", "torch-foreach"],
    "momentum": [
        "fasttrain-triton", "fasttrain-chunked", "fasttrain-reference", "torch-foreach", "torch-fused",
        "apex-fused",
    ],
}  # fmt: skip


class Unavailable(Exception):
    """A contender that cannot run here (reason in the message)."""


@functools.cache
def parameter_shapes(model: str) -> list[tuple[torch.Size, bool]]:
    """(shape, is a conv weight) of every parameter of `model`, built on the meta device."""
    with torch.device("meta"):
        width = 64 if model == "inception_v3" else BASE_CHANNELS
        net = create_model(model, num_classes=1000, base_channels=width)
    shapes = [(p.shape, p.dim() == 4) for p in net.parameters()]
    if not SMOKE:
        assert sum(s.numel() for s, _ in shapes) == FULL_COUNTS[model]
    return shapes


def _params(model: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape, conv in parameter_shapes(model):
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.05).to(DEVICE))
        if conv:  # as the trainer holds conv weights
            p.data = p.data.to(memory_format=torch.channels_last)
        p.grad = torch.randn_like(p) * 1e-2
        params.append(p)
    return params


@pytest.fixture(scope="module")
def copy_gb_per_s() -> float:
    """Device copy bandwidth in GB/s (read + write), median of 3 windows, once per run."""
    return copy_bandwidth(DEVICE, COPY_BYTES, calls=5)["gb_per_s"]


def _with_foreach_ema(params, optimizer):
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
    """The update function of contender `name`, or Unavailable."""
    wd = WEIGHT_DECAY[kind]
    if name.startswith("fasttrain-"):
        impl = {"fasttrain-triton": "triton", "fasttrain-chunked": "chunked"}.get(name, "torch")
        if impl == "triton" and DEVICE.type != "cuda":
            raise Unavailable("the Triton kernel is timed on CUDA only (the CPU interpreter is a test tool)")
        lr = torch.tensor(LR, device=DEVICE)
        one, zero = torch.ones((), device=DEVICE), torch.zeros((), device=DEVICE)
        if kind == "rmsprop":
            opt = FusedRMSPropTF(params, lr=lr, weight_decay=wd, ema_decay=EMA_DECAY, impl=impl)
        else:
            opt = FusedMomentum(params, lr=lr, weight_decay=wd, ema_decay=EMA_DECAY, impl=impl)
        return lambda: opt.step(grad_scale=one, found_inf=zero)
    if name == "torch-foreach":
        if kind == "rmsprop":
            opt = torch.optim.RMSprop(
                params, lr=LR, alpha=0.9, eps=1.0, momentum=0.9, weight_decay=wd, foreach=True
            )
        else:
            opt = torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=wd, foreach=True)
        return _with_foreach_ema(params, opt)
    if name == "torch-fused":
        if kind == "rmsprop":
            raise Unavailable("torch.optim.RMSprop has no fused implementation")
        return _with_foreach_ema(
            params, torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=wd, fused=True)
        )
    if name == "apex-fused":
        if DEVICE.type != "cuda":
            raise Unavailable("apex FusedSGD needs CUDA")
        try:
            from apex.optimizers import FusedSGD
        except ImportError as e:
            raise Unavailable("NVIDIA apex is not installed") from e
        return _with_foreach_ema(params, FusedSGD(params, lr=LR, momentum=0.9, weight_decay=wd))
    raise ValueError(name)


def _figures(kind: str, model: str, num_params: int, seconds: float, copy_gb_per_s: float) -> dict:
    """extra_info for one contender's seconds per update (the keys bench/report.py reads, and more)."""
    gb_per_s = BYTES_PER_PARAM[kind] * num_params / seconds / 1e9
    return dict(
        optimizer=kind,
        model=model,
        num_params=num_params,
        width_divisor=64 // BASE_CHANNELS,
        ms_per_update=seconds * 1e3,
        bytes_per_param=BYTES_PER_PARAM[kind],
        effective_gb_per_s=gb_per_s,
        copy_gb_per_s=copy_gb_per_s,
        fraction_of_copy=gb_per_s / copy_gb_per_s,
        copy_equivalent_bytes_per_param=seconds * copy_gb_per_s * 1e9 / num_params,
    )


def _measure(benchmark, env_info, kind: str, name: str, model: str, copy_gb_per_s: float) -> None:
    load_before = os.getloadavg()
    params = _params(model)
    try:
        step = _contender(kind, name, params)
    except Unavailable as why:
        pytest.skip(str(why))

    def calls():
        for _ in range(CALLS):
            step()
        synchronize(DEVICE)  # the device work belongs to the call

    benchmark.pedantic(calls, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    if benchmark.disabled:  # --benchmark-disable: ran once as a smoke test, nothing measured
        return
    seconds = benchmark.stats.stats.median / CALLS
    benchmark.extra_info.update(env_info)
    benchmark.extra_info.update(
        contender=name,
        **_figures(kind, model, sum(p.numel() for p in params), seconds, copy_gb_per_s),
        load_average_before=load_before,
        load_average_after=os.getloadavg(),
    )


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", CONTENDERS["rmsprop"])
def test_rmsprop_ema(benchmark, env_info, name, model, copy_gb_per_s):
    benchmark.group = f"rmsprop+ema {model}"
    _measure(benchmark, env_info, "rmsprop", name, model, copy_gb_per_s)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", CONTENDERS["momentum"])
def test_momentum_ema(benchmark, env_info, name, model, copy_gb_per_s):
    benchmark.group = f"momentum+ema {model}"
    _measure(benchmark, env_info, "momentum", name, model, copy_gb_per_s)


def _interleaved(benchmark, env_info, kind: str, model: str) -> None:
    load_before = os.getloadavg()
    steps, skipped = {}, {}
    for name in CONTENDERS[kind]:
        try:
            steps[name] = _contender(kind, name, _params(model))
        except Unavailable as why:
            skipped[name] = str(why)
    num_params = sum(shape.numel() for shape, _ in parameter_shapes(model))
    times = {name: [] for name in steps}
    copy_rates = []  # the copy bandwidth is timed in every round too, under the same load

    def one_round():
        for name, step in steps.items():
            # The device's own time (an update's Python outlasts its kernel: timed() measured the host).
            times[name].append(queued_timed(step, CALLS, DEVICE)["seconds"] / CALLS)
        copy_rates.append(copy_bandwidth(DEVICE, COPY_BYTES, calls=3, windows=1)["gb_per_s"])

    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    if benchmark.disabled:
        return
    # The warm-up rounds also appended: keep the timed ones.
    median = {name: statistics.median(t[WARMUP_ROUNDS:]) for name, t in times.items()}
    copy_gb_per_s = statistics.median(copy_rates[WARMUP_ROUNDS:])
    base = median.get("torch-foreach")
    interleaved = {
        name: dict(
            ms_per_update=median[name] * 1e3,
            ms_per_round=[t * 1e3 for t in times[name][WARMUP_ROUNDS:]],
            speedup_vs_torch_foreach=None if base is None else base / median[name],
            **{
                k: v
                for k, v in _figures(kind, model, num_params, median[name], copy_gb_per_s).items()
                if k in ("effective_gb_per_s", "fraction_of_copy", "copy_equivalent_bytes_per_param")
            },
        )
        for name in steps
    }
    fast = "fasttrain-triton" if "fasttrain-triton" in steps else "fasttrain-chunked"
    benchmark.extra_info.update(env_info)
    benchmark.extra_info.update(
        contender=f"{fast} (interleaved)",
        **_figures(kind, model, num_params, median[fast], copy_gb_per_s),
        interleaved=interleaved,
        not_run=skipped,
        load_average_before=load_before,
        load_average_after=os.getloadavg(),
    )
    print(f"\n{kind}+ema {model} ({num_params / 1e6:.1f}M params), medians of {ROUNDS} interleaved rounds:")
    for name, row in interleaved.items():
        vs = row["speedup_vs_torch_foreach"]
        at_copy = row["copy_equivalent_bytes_per_param"]
        print(
            f"  {name:20s} {row['ms_per_update']:9.2f} ms  {at_copy:6.1f} B/param at copy speed"
            f"  {'' if vs is None else f'{vs:.2f}x torch-foreach'}"
        )


@pytest.mark.parametrize("model", MODELS)
def test_interleaved_rmsprop_ema(benchmark, env_info, model):
    benchmark.group = f"rmsprop+ema {model} interleaved"
    _interleaved(benchmark, env_info, "rmsprop", model)


@pytest.mark.parametrize("model", MODELS)
def test_interleaved_momentum_ema(benchmark, env_info, model):
    benchmark.group = f"momentum+ema {model} interleaved"
    _interleaved(benchmark, env_info, "momentum", model)
