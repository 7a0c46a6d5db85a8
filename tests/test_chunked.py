"""kernels/chunked.py, the fast torch path, against the readable torch references it must equal to
rounding: every buffer after 10 steps, for RMSProp, momentum and Nesterov, with and without weight
decay, grad_scale (None, a float, a tensor), lr (a float, a tensor), the EMA on and off, fp32 and bf16
gradients, sizes 1, 127, 1000 (in chunks of 96 over two workers) and 1000003 (the default chunks), and
both skip paths (the CPU's host read; the device's torch.where commit, forced on CPU tensors). Its
agreement with TensorFlow's equations is in test_rmsprop_tf.py and test_momentum.py, its bit-identical
skip in test_kernels.py, with the other implementations. Its CPU route, the compiled loop of
kernels/cpu.py, is checked bit for bit against a NumPy float32 transcription of the equations, and
taken only where it applies.

Tolerances: those of test_rmsprop_tf.py (atol 2e-6 + rtol 1e-6): a few products and sums are rounded
once here and twice in the reference. Measured at 1000003 elements after 10 steps: at most 1.9e-6 on
momentum buffers of magnitude 8-10 and 1.4e-6 on weights of magnitude ~5 (2 ulp).
"""

from unittest import mock

import numpy as np
import pytest
import torch
from fasttrain.kernels import chunked, rmsprop_tf
from fasttrain.kernels import momentum as momentum_kernel
from fasttrain.kernels.common import ema_one_minus_decay

ATOL, RTOL = 2e-6, 1e-6
LRS = [0.1 * 0.8**i for i in range(10)]  # the LR changes every step


def _chunked_vs_reference(kind, case, n, scratch, update_kwargs):
    """10 updates of the same start with the reference and with the chunked path (`scratch`: its
    scratch, None for the default); returns the starting buffers and both results."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(n, generator=gen)
    start = [w, torch.ones(n), torch.zeros(n)] if kind == "rmsprop" else [w, torch.zeros(n)]
    if case["ema"]:
        start.append(w.clone())
    runs = {"reference": [b.clone() for b in start], "chunked": [b.clone() for b in start]}
    fns = {
        "rmsprop": (rmsprop_tf.rmsprop_tf_update_reference, chunked.rmsprop_tf_update_chunked),
        "momentum": (momentum_kernel.momentum_update_reference, chunked.momentum_update_chunked),
    }[kind]
    step = torch.zeros((), dtype=torch.int64)
    lr = torch.zeros(())
    # Gradients of order 1 once scaled (the magnitudes the tolerances were measured at).
    loss_scale = 1.0 if case["grad_scale"] is None else 1.0 / float(case["grad_scale"])
    for step_lr in LRS:
        g = (torch.randn(n, generator=gen) * loss_scale).to(case["grad_dtype"])
        lr.fill_(step_lr)
        kwargs = dict(
            lr=lr if case["lr_tensor"] else step_lr, weight_decay=case["weight_decay"],
            grad_scale=case["grad_scale"], found_inf=case["found_inf"],
            ema_weight=ema_one_minus_decay(step, 0.999, True) if case["ema"] else None, **update_kwargs,
        )  # fmt: skip
        for (name, buffers), fn in zip(runs.items(), fns):
            extra = {"scratch": scratch} if name == "chunked" else {}
            ema = buffers[-1] if case["ema"] else None
            states = buffers[1:-1] if case["ema"] else buffers[1:]
            fn(buffers[0], g, *states, ema, **kwargs, **extra)
        step += 1
    return start, runs["reference"], runs["chunked"]


CASES = {
    "plain": dict(weight_decay=0.0, grad_scale=None, found_inf=None, lr_tensor=False, ema=False),
    "decay-scale-tensor-ema": dict(
        weight_decay=4e-5,
        grad_scale=torch.tensor(1 / 64),
        found_inf=torch.zeros(()),
        lr_tensor=True,
        ema=True,
    ),
    "decay-scale-float-ema": dict(
        weight_decay=1e-4, grad_scale=0.015625, found_inf=None, lr_tensor=False, ema=True
    ),
}


KINDS = {
    "rmsprop": ("rmsprop", dict(decay=0.9, momentum=0.9, eps=1.0)),
    "momentum": ("momentum", dict(momentum=0.9, nesterov=False)),
    "nesterov": ("momentum", dict(momentum=0.9, nesterov=True)),
}
# Every combination at small sizes (chunk 96: 1000 is ten full chunks and a 40-element tail, split
# 6 + 5 between two workers); the default chunks at 1000003 (two workers of 16 chunks of 32,000) in
# the trainer's setting only, for time.
CHUNKED_CASES = [
    pytest.param(*KINDS[kind], n, chunk, case, dtype, path, id=f"{kind}-{n}-{case}-{dtype}-{path}")
    for kind in KINDS
    for n, chunk in [(1, None), (127, None), (1000, 96), (1000003, None)]
    for case in CASES
    for dtype in (torch.float32, torch.bfloat16)
    for path in ("host", "device")
    if n < 10**6 or (case == "decay-scale-tensor-ema" and dtype == torch.float32)
]


@pytest.mark.parametrize("kind, update_kwargs, n, chunk, case, grad_dtype, skip_path", CHUNKED_CASES)
def test_chunked_matches_reference_every_buffer(kind, update_kwargs, n, chunk, case, grad_dtype, skip_path):
    scratch = None if chunk is None else torch.empty((2, 6, chunk))  # 2 workers
    with mock.patch.object(chunked, "_host_reads_free", lambda device: skip_path == "host"):
        start, reference, fast = _chunked_vs_reference(
            kind, {**CASES[case], "grad_dtype": grad_dtype}, n, scratch, update_kwargs
        )
    for i, (a, b, before) in enumerate(zip(fast, reference, start)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=f"buffer {i}")
        assert not torch.equal(a, before), f"buffer {i} never changed: the comparison would be vacuous"


def _numpy_float32_update(kind, buffers, g, lr, weight_decay, scale, ema_weight, **hyper):
    """The references' equations in NumPy float32, one IEEE-rounded operation at a time (NumPy's
    float32 sqrt is correctly rounded; torch's vectorised CPU sqrt is not always: an ulp off on
    2 of 127 elements here, which is why the comparison with the torch reference needs a tolerance)."""
    f = np.float32
    w, *states, ema = buffers
    g = g * f(scale) + f(weight_decay) * w
    if kind == "rmsprop":
        ms, mom = states
        ms[:] = ms + f(1.0 - f(hyper["decay"])) * (g * g - ms)
        mom[:] = f(hyper["momentum"]) * mom + (g * f(lr)) / np.sqrt(ms + f(hyper["eps"]))
        w[:] = w - mom
    else:
        (acc,) = states
        acc[:] = f(hyper["momentum"]) * acc + g
        step = g + f(hyper["momentum"]) * acc if hyper["nesterov"] else acc
        w[:] = w - f(lr) * step
    if ema is not None:
        ema[:] = ema - f(ema_weight) * (ema - w)


# The compiled CPU loop (kernels/cpu.py) rounds each float32 operation of the references' equations
# once, without fast-math (no reassociation, no fused multiply-add): every buffer must be the NumPy
# transcription's bits, not merely close.
@pytest.mark.parametrize("kind, update_kwargs", list(KINDS.values()), ids=list(KINDS))
@pytest.mark.parametrize("case", ["plain", "decay-scale-float-ema"])
@pytest.mark.parametrize("n", [1, 127, 100003])
def test_compiled_cpu_path_is_the_float32_equations_bit_for_bit(kind, update_kwargs, case, n):
    assert chunked._compiled_on_cpu(torch.zeros(n), torch.zeros(n)), "the compiled path would not run"
    case = CASES[case]
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(n, generator=gen)
    start = [w, torch.ones(n), torch.zeros(n)] if kind == "rmsprop" else [w, torch.zeros(n)]
    start.append(w.clone() if case["ema"] else None)
    fast = [None if b is None else b.clone() for b in start]
    expected = [None if b is None else b.numpy().copy() for b in start]
    fn = chunked.rmsprop_tf_update_chunked if kind == "rmsprop" else chunked.momentum_update_chunked
    scale = 1.0 if case["grad_scale"] is None else case["grad_scale"]
    step = torch.zeros((), dtype=torch.int64)
    for lr in LRS:
        g = torch.randn(n, generator=gen) / scale
        ema_weight = ema_one_minus_decay(step, 0.999, True) if case["ema"] else None
        fn(*fast[:1], g, *fast[1:], lr=lr, weight_decay=case["weight_decay"], grad_scale=case["grad_scale"],
           ema_weight=ema_weight, **update_kwargs)  # fmt: skip
        _numpy_float32_update(
            kind, expected, g.numpy(), lr, case["weight_decay"], scale,
            None if ema_weight is None else float(ema_weight), **update_kwargs,
        )  # fmt: skip
        step += 1
    for i, (a, b, before) in enumerate(zip(fast, expected, start)):
        if a is None:
            continue
        assert np.array_equal(a.numpy(), b), f"buffer {i}: max difference {np.abs(a.numpy() - b).max()}"
        assert not torch.equal(a, before), f"buffer {i} never changed: the comparison would be vacuous"


def test_compiled_cpu_path_runs_only_where_it_applies():
    x = torch.zeros(8)
    assert chunked._compiled_on_cpu(x, x, None)
    assert not chunked._compiled_on_cpu(x, x.to(torch.bfloat16))  # widened by the torch ops instead
    assert not chunked._compiled_on_cpu(x, torch.zeros(16)[::2])  # not contiguous
    with mock.patch.object(chunked, "_host_reads_free", lambda device: False):
        assert not chunked._compiled_on_cpu(x, x)  # the device path: no host read of found_inf
