"""kernels/rmsprop_tf.py, TensorFlow's RMSProp with the weight EMA: the Triton kernel (interpreter on
the CPU, compiled on CUDA), the chunked torch fast path (with its CPU skip by host read and its device
skip by torch.where) and the torch reference vs an independent float64 NumPy transcription of
TensorFlow's update equations; Triton vs the reference; subnormal updates kept (the chunked path vs
the reference: test_chunked.py; the skip on overflow and the compiled kernels: test_kernels.py).
Tolerances (atol 2e-6 + rtol 1e-6): the kernels compute in fp32. Against float64, 10 steps leave at
most 1.2e-6 absolute error on weights of magnitude ~5 (2.5 ulp; ms and mom: < 2.3e-7), measured on
the CPU. Triton vs the reference differ only by rounding too: torch's CPU sqrt is not correctly
rounded (1 ulp; NumPy's, used by the interpreter, is) and CUDA may contract a*b+c into an FMA, so
the same tolerances apply rather than bit equality; so does the chunked path, which rounds a few
products and sums once where the reference rounds twice (see test_chunked.py). Semantic slips (ms from
zeros, eps outside the sqrt, lr outside the momentum) move values by >= 1e-3.
"""

import numpy as np
import pytest
import torch
from fasttrain.kernels import chunked, rmsprop_tf
from fasttrain.kernels.common import ema_one_minus_decay
from kernel_helpers import (
    ATOL,
    DEVICES,
    LRS,
    RTOL,
    _compare,
    _device_skip,
    _random,
    _triton_interpreter,  # noqa: F401  (an autouse fixture)
    needs_triton,
    tf_ema,
)

IMPLS = [
    pytest.param(rmsprop_tf.rmsprop_tf_update_reference, id="torch"),
    pytest.param(chunked.rmsprop_tf_update_chunked, id="chunked"),
    pytest.param(_device_skip(chunked.rmsprop_tf_update_chunked), id="chunked-device-skip"),
    pytest.param(rmsprop_tf.rmsprop_tf_update, id="triton", marks=needs_triton),
]


# --- independent float64 transcriptions of TensorFlow's kernels (training_ops.cc, moving_averages.py)


def tf_rmsprop(s, g, lr, rho, momentum, eps, wd, scale, ema_decay, num_updates):
    g = g * scale + wd * s["w"]
    s["ms"] += (np.square(g) - s["ms"]) * (1 - rho)
    s["mom"] = s["mom"] * momentum + g * lr / np.sqrt(s["ms"] + eps)
    s["w"] -= s["mom"]
    tf_ema(s, ema_decay, num_updates)


def _run_rmsprop(update, n, device, grad_dtype, lr_as_tensor, ema_warmup=True, seed=0):
    """STEPS updates with `update`; returns its fp32 buffers and the float64 TF transcription's."""
    gen = torch.Generator().manual_seed(seed)
    w = _random(n, gen, device)
    state = {
        "w": w,
        "ms": torch.ones(n, device=device),
        "mom": torch.zeros(n, device=device),
        "ema": w.clone(),
    }
    expected = {key: t.double().cpu().numpy().copy() for key, t in state.items()}
    step = torch.zeros((), dtype=torch.int64, device=device)
    lr_tensor = torch.zeros((), device=device)
    loss_scale = 1024.0
    grad_scale = torch.tensor(0.37 / loss_scale, device=device)  # 1/loss_scale and a non-power-of-2
    no_overflow = torch.zeros((), device=device)  # as the trainer passes it (the commit path runs)
    for i, lr in enumerate(LRS):
        g = (_random(n, gen, device) * loss_scale).to(grad_dtype)
        lr_tensor.fill_(lr)
        ema_weight = ema_one_minus_decay(step, 0.999, ema_warmup)
        update(
            state["w"], g, state["ms"], state["mom"], state["ema"],
            lr=lr_tensor if lr_as_tensor else lr, decay=0.9, momentum=0.9, eps=1.0,
            weight_decay=4e-5, grad_scale=grad_scale, ema_weight=ema_weight, found_inf=no_overflow,
        )  # fmt: skip
        step += 1
        g64 = g.double().cpu().numpy()  # the values the kernel reads (exact in float64)
        tf_rmsprop(
            expected, g64, lr, 0.9, 0.9, 1.0, 4e-5, 0.37 / loss_scale, 0.999, i + 1 if ema_warmup else None
        )
    return state, expected


# --- RMSProp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("update", IMPLS)
@pytest.mark.parametrize("n", [1, 127, 1000003])
def test_rmsprop_tf_matches_tensorflow_equations(update, n, device):
    state, expected = _run_rmsprop(update, n, device, torch.float32, lr_as_tensor=True)
    _compare(state, expected)


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("update", IMPLS)
def test_rmsprop_tf_half_precision_gradients(update, grad_dtype):
    state, expected = _run_rmsprop(update, 4099, "cpu", grad_dtype, lr_as_tensor=False)
    _compare(state, expected)


@pytest.mark.parametrize("update", IMPLS)
def test_rmsprop_tf_plain_ema_decay_without_warmup(update):
    state, expected = _run_rmsprop(update, 127, "cpu", torch.float32, lr_as_tensor=False, ema_warmup=False)
    _compare(state, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [127, 1000003])
@needs_triton
def test_rmsprop_tf_triton_matches_reference(n, device):
    kernel, _ = _run_rmsprop(rmsprop_tf.rmsprop_tf_update, n, device, torch.float32, True, seed=1)
    reference, _ = _run_rmsprop(
        rmsprop_tf.rmsprop_tf_update_reference, n, device, torch.float32, True, seed=1
    )
    for key in kernel:
        torch.testing.assert_close(kernel[key], reference[key], rtol=RTOL, atol=ATOL, msg=f"buffer {key}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("update", IMPLS)
def test_rmsprop_tf_keeps_subnormal_updates(update, device):
    # g * lr and the step it yields are subnormal (below 1.18e-38): a flush-to-zero build of the
    # kernel (Triton <= 3.5's libdevice sqrt/div) leaves mom and w at 0 where TF and torch do not.
    n = 64
    g = torch.full((n,), 1e-36, device=device)
    w, ms, mom = torch.zeros(n, device=device), torch.ones(n, device=device), torch.zeros(n, device=device)
    update(w, g, ms, mom, None, lr=1e-4, decay=0.9, momentum=0.9, eps=1.0)
    expected = np.float32(np.float32(1e-36) * np.float32(1e-4)) / np.sqrt(np.float32(0.9) + np.float32(1.0))
    assert 0 < expected < np.finfo(np.float32).tiny
    assert torch.all(mom > 0) and torch.all(w < 0), "a subnormal update was flushed to zero"
    # rtol: a subnormal near 7e-41 has about 16 significant bits, so one unit in its last place is
    # 2e-5 of it, and torch's CPU sqrt may differ from NumPy's by an ulp.
    np.testing.assert_allclose(mom.cpu().numpy(), expected, rtol=1e-4)
