"""Shared by the kernel tests (test_rmsprop_tf.py, test_momentum.py, test_kernels.py): tolerances, the
implementations' markers, Triton's interpreter on the CPU, TensorFlow's EMA in float64, and buffer
comparison. The names are those the tests had in test_kernels.py, so the moved tests read unchanged."""

from unittest import mock

import numpy as np
import pytest
import torch
from fasttrain.kernels import chunked
from fasttrain.kernels.common import HAVE_TRITON

# Why these tolerances: test_rmsprop_tf.py's docstring.
ATOL, RTOL = 2e-6, 1e-6
STEPS = 10
LRS = [0.1 * 0.8**i for i in range(STEPS)]  # the LR changes every step

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def _device_skip(update):
    """`update` taking the chunked path's no-host-read branch (found_inf committed by torch.where, as
    on CUDA) on CPU tensors too."""

    def call(*args, **kwargs):
        with mock.patch.object(chunked, "_host_reads_free", lambda device: False):
            update(*args, **kwargs)

    return call


def runs_interpreted(node) -> bool:
    """Whether the test `node` runs its kernels in Triton's interpreter: a CPU test does; a test on
    CUDA (its `device` parameter, or a `gpu` test with no such parameter) runs them compiled."""
    callspec = getattr(node, "callspec", None)
    device = callspec.params.get("device", "cpu") if callspec is not None else "cpu"
    return device == "cpu" and node.get_closest_marker("gpu") is None


@pytest.fixture(autouse=True)
def _triton_interpreter(request, monkeypatch):
    # CPU tensors run under Triton's interpreter, CUDA tensors compiled. The kernels pick compile vs
    # interpret at launch time (kernels/common.lazy_jit), so this works whatever imported triton first.
    # (A gpu test without a `device` parameter ran its CUDA tensors in the interpreter before, which
    # failed on the H200: bench/results/2026-11-28-h200-fourth-run/.)
    if runs_interpreted(request.node):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# --- independent float64 transcriptions of TensorFlow's kernels (training_ops.cc, moving_averages.py)


def tf_ema(s, decay, num_updates):
    if num_updates is not None:
        decay = min(decay, (1.0 + num_updates) / (10.0 + num_updates))
    s["ema"] -= (s["ema"] - s["w"]) * (1 - decay)


# --- helpers


def _random(n, generator, device, scale=1.0):
    return (torch.randn(n, generator=generator) * scale).to(device)


def _compare(torch_state, numpy_state):
    for key, expected in numpy_state.items():
        actual = torch_state[key].double().cpu().numpy()
        np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL, err_msg=f"buffer {key}")
