"""kernels/momentum.py, TensorFlow's momentum (and Nesterov) with the weight EMA: the Triton kernel
(interpreter on the CPU, compiled on CUDA), the chunked torch fast path (with its CPU skip by host read
and its device skip by torch.where) and the torch reference vs an independent float64 NumPy
transcription of TensorFlow's update equations (the chunked path vs the reference: test_chunked.py;
the skip on overflow and the compiled kernels: test_kernels.py).

Tolerances: those of test_rmsprop_tf.py (atol 2e-6 + rtol 1e-6, fp32 kernels against float64), for
the same reasons.
"""

import pytest
import torch
from fasttrain.kernels import chunked
from fasttrain.kernels import momentum as momentum_kernel
from fasttrain.kernels.common import ema_one_minus_decay
from kernel_helpers import (
    DEVICES,
    LRS,
    _compare,
    _device_skip,
    _random,
    _triton_interpreter,  # noqa: F401  (an autouse fixture)
    needs_triton,
    tf_ema,
)

MOMENTUM_IMPLS = [
    pytest.param(momentum_kernel.momentum_update_reference, id="torch"),
    pytest.param(chunked.momentum_update_chunked, id="chunked"),
    pytest.param(_device_skip(chunked.momentum_update_chunked), id="chunked-device-skip"),
    pytest.param(momentum_kernel.momentum_update, id="triton", marks=needs_triton),
]


# --- independent float64 transcriptions of TensorFlow's kernels (training_ops.cc, moving_averages.py)


def tf_momentum(s, g, lr, momentum, wd, scale, nesterov, ema_decay, num_updates):
    g = g * scale + wd * s["w"]
    s["acc"] = s["acc"] * momentum + g
    s["w"] -= g * lr + s["acc"] * momentum * lr if nesterov else s["acc"] * lr
    tf_ema(s, ema_decay, num_updates)


# --- Momentum


def _run_momentum(update, n, device, grad_dtype, nesterov, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = _random(n, gen, device)
    state = {"w": w, "acc": torch.zeros(n, device=device), "ema": w.clone()}
    expected = {key: t.double().cpu().numpy().copy() for key, t in state.items()}
    step = torch.zeros((), dtype=torch.int64, device=device)
    no_overflow = torch.zeros((), device=device)
    for i, lr in enumerate(LRS):
        g = _random(n, gen, device, scale=0.5).to(grad_dtype)
        ema_weight = ema_one_minus_decay(step, 0.99, True)
        update(
            state["w"], g, state["acc"], state["ema"], lr=lr, momentum=0.9, nesterov=nesterov,
            weight_decay=1e-4, grad_scale=0.125, ema_weight=ema_weight, found_inf=no_overflow,
        )  # fmt: skip
        step += 1
        tf_momentum(expected, g.double().cpu().numpy(), lr, 0.9, 1e-4, 0.125, nesterov, 0.99, i + 1)
    return state, expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("update", MOMENTUM_IMPLS)
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("n", [1, 127, 1000003])
def test_momentum_matches_tensorflow_equations(update, n, nesterov, device):
    state, expected = _run_momentum(update, n, device, torch.float32, nesterov)
    _compare(state, expected)


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("update", MOMENTUM_IMPLS)
def test_momentum_half_precision_gradients(update, grad_dtype):
    state, expected = _run_momentum(update, 4099, "cpu", grad_dtype, nesterov=False)
    _compare(state, expected)
