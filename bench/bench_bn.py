"""BatchNorm (+ residual add) + ReLU, forward and backward, at ResNet-50's shapes: fasttrain's Triton kernels
(--bn_kernels triton, kernels/batch_norm.py) against eager torch and inductor's fusion of the same ops.

    python -m pytest bench/bench_bn.py --benchmark-only -s        # on the GPU run: in its kernels step
    FASTTRAIN_BENCH_SMOKE=1 python -m pytest bench --benchmark-only   # CI: tiny, a check that it runs

One call = y = relu(batch_norm(x) [+ residual]) in training mode (batch statistics, running statistics
updated) and the gradients of x, weight, bias [and residual] for a given dy, as a training step runs
them, at batch 256 in bf16 channels_last (ResNet-50 v1.5: the stem's BN, a bottleneck's first BN, its
last BN with the shortcut added, and the same in layer3). Contenders, interleaved round after round
(CUDA events around CALLS calls after warm-up rounds, so drift hits all alike):

    triton   kernels/batch_norm.bn_act: 4 kernels, 8 passes over the activations (11 with the add);
             triton-TILExWARPS the same at another geometry (SWEEP), to tune GPU_TILE, GPU_NUM_WARPS and
             PROGRAMS_PER_SM
    eager    F.batch_norm (cuDNN) + add + ReLU, autograd's backward
    inductor torch.compile (mode default) of the eager function: what --compile and (d) run

Reported in extra_info per shape: each contender's median ms, and `passes_at_copy`: how many passes
over the (N, C, H, W) bf16 activations a copy would make in that time, at the device-to-device copy
bandwidth measured in the same run (the kernels' own count is 8 or 11; the third GPU run's profile put
inductor's BN/ReLU/add kernels at about 15.5 over the whole ResNet-50 step). On the CPU the smoke run
times the eager contender at a tiny size and runs the kernels once under Triton's interpreter: the
numbers say nothing, it checks that the benchmark runs.
"""

import os
import statistics

import pytest
import torch
import torch.nn.functional as F

from bench.common import copy_bandwidth, queued_timed, synchronize

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMOKE = os.environ.get("FASTTRAIN_BENCH_SMOKE") == "1"
ON_GPU = DEVICE.type == "cuda" and not SMOKE
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
CALLS = 10 if DEVICE.type == "cuda" else 1
ROUNDS, WARMUP_ROUNDS = (1, 0) if SMOKE or DEVICE.type != "cuda" else (10, 2)
# (N, C, H, W), residual: ResNet-50 v1.5 at batch 256 (stem bn1; layer1's bn1 and bn3 + shortcut;
# layer3's bn1 and bn3 + shortcut).
SHAPES = (
    [
        ((256, 64, 112, 112), False),
        ((256, 64, 56, 56), False),
        ((256, 256, 56, 56), True),
        ((256, 256, 14, 14), False),
        ((256, 1024, 14, 14), True),
    ]
    if ON_GPU
    else [((2, 8, 8, 8), False), ((2, 16, 4, 4), True)]
)


def _eager(x, w, b, rm, rv, res):
    y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.003, eps=1e-5)
    if res is not None:
        y = y + res
    return torch.relu(y)


def _triton(geometry=None):
    """bn_act, at the kernels' own geometry or at `geometry` (GPU_TILE, GPU_NUM_WARPS, PROGRAMS_PER_SM)
    for this call only."""
    from fasttrain.kernels import batch_norm, batch_norm_layout

    names = ("GPU_TILE", "GPU_NUM_WARPS", "PROGRAMS_PER_SM")

    def fn(x, w, b, rm, rv, res):
        saved = [getattr(batch_norm_layout, n) for n in names]
        for name, value in zip(names, geometry or saved):
            setattr(batch_norm_layout, name, value)
        try:
            return batch_norm.bn_act(x, w, b, rm, rv, momentum=0.003, eps=1e-5, residual=res)
        finally:
            for name, value in zip(names, saved):
                setattr(batch_norm_layout, name, value)

    return fn


# Other geometries timed beside the kernels' own (GPU only), so that one run can also tune them:
# (elements per tile, warps, reducing programs per SM: None = as many as fit, one wave); the backward
# launches at its forward's tiles (_BNAct keeps them). 2048x8 at a fixed 8 per SM: the geometry before
# the one-wave rule (the statistics then ran in two waves, the backward's sums in three).
SWEEP = [(2048, 8, 8), (1024, 4, None), (4096, 8, None), (2048, 4, None)]


def _call(fn, shape, residual):
    """One forward + backward of fn on fresh inputs of `shape` (made once)."""
    gen = torch.Generator().manual_seed(0)
    n, c, h, w_ = shape

    def act():
        t = torch.randn(shape, generator=gen).to(DEVICE, DTYPE)
        return t.contiguous(memory_format=torch.channels_last)

    x, dy = act().requires_grad_(), act()
    res = act().requires_grad_() if residual else None
    w = torch.randn(c, generator=gen).to(DEVICE).requires_grad_()
    b = torch.randn(c, generator=gen).to(DEVICE).requires_grad_()
    rm, rv = torch.zeros(c, device=DEVICE), torch.ones(c, device=DEVICE)
    inputs = [t for t in (x, w, b, res) if t is not None]

    def call():
        y = fn(x, w, b, rm, rv, res)
        return torch.autograd.grad(y, inputs, dy)

    return call


@pytest.mark.parametrize(
    "shape, residual",
    SHAPES,
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else ("add" if v else "noadd"),
)
def test_bn_relu_interleaved(benchmark, env_info, shape, residual):
    contenders = {"eager": _call(_eager, shape, residual)}
    if ON_GPU:
        contenders["inductor"] = _call(torch.compile(_eager), shape, residual)
    contenders["triton"] = _call(_triton(), shape, residual)
    # On the CPU each runs once below, untimed: the interpreter ignores the geometry.
    for tile, warps, per_sm in SWEEP:
        name = f"triton-{tile}x{warps}" + ("" if per_sm is None else f"-{per_sm}perSM")
        contenders[name] = _call(_triton((tile, warps, per_sm)), shape, residual)
    for call in contenders.values():  # compiles (Triton's JIT, inductor), cuDNN's choice
        call()
    times = {name: [] for name in contenders}
    host_bound = set()
    copy_rates = []
    for r in range(WARMUP_ROUNDS + ROUNDS):
        for name, call in contenders.items():
            if name.startswith("triton") and not ON_GPU:
                continue  # the interpreter runs it once above; its time says nothing
            # The device's own time: at ResNet-50's 14 x 14 shapes a call's Python (autograd, dynamo's
            # guards, Triton's launcher) outlasts its kernels, and timed() measured the host there
            # (the fourth GPU run: eager 0.4 ms, inductor 0.8, Triton 1.0 for about 50 us of traffic).
            t = queued_timed(call, CALLS, DEVICE)
            if r >= WARMUP_ROUNDS:
                times[name].append(t["seconds"] / CALLS * 1e3)
                if t["host_seconds"] > t["held_seconds"]:  # the queue ran dry: still the host's time
                    host_bound.add(name)
        if r >= WARMUP_ROUNDS:
            copy_rates.append(
                copy_bandwidth(DEVICE, 1 << 28 if ON_GPU else 1 << 22, calls=3, windows=1)["gb_per_s"]
            )
    synchronize(DEVICE)
    ms = {name: statistics.median(v) for name, v in times.items() if v}
    copy_gb_per_s = statistics.median(copy_rates)
    pass_gb = shape[0] * shape[1] * shape[2] * shape[3] * torch.finfo(DTYPE).bits / 8 / 1e9
    passes = {name: t / 1e3 * copy_gb_per_s / pass_gb for name, t in ms.items()}
    ratios = {
        f"{k}_over_triton": ms[k] / ms["triton"] for k in ("eager", "inductor") if k in ms and "triton" in ms
    }
    benchmark.extra_info.update(env_info)
    benchmark.extra_info.update(
        shape=list(shape), residual=residual, dtype=str(DTYPE).replace("torch.", ""), rounds=ROUNDS,
        calls=CALLS, ms=ms, passes_at_copy=passes, kernel_passes=11 if residual else 8,
        copy_gb_per_s=copy_gb_per_s, pass_gb=pass_gb, host_bound=sorted(host_bound), **ratios,
    )  # fmt: skip
    marks = {k: ", host-bound" if k in host_bound else "" for k in ms}
    line = ", ".join(f"{k} {v:.3f} ms ({passes[k]:.1f} passes{marks[k]})" for k, v in ms.items())
    print(f"\nBN{' + add' if residual else ''} + ReLU fwd+bwd {tuple(shape)} {DTYPE}: {line}")
    benchmark.pedantic(contenders["triton"] if ON_GPU else contenders["eager"], rounds=1, iterations=1)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "--benchmark-only", "-s"]))
