"""Both updates as one compiled loop on the CPU (numba), the CPU route of the `chunked` path.

The references (rmsprop_tf.rmsprop_tf_update_reference, momentum.momentum_update_reference) are
transcribed element by element, in their order of float32 operations with their float32 constants,
and compiled without fast-math: no reassociation, no fused multiply-add, IEEE sqrt and division. So
each element gets exactly the bits of those equations evaluated one IEEE float32 operation at a time
(tests/test_chunked.py compares with a NumPy transcription using `==`; the torch reference itself is
an ulp away on some elements, its vectorised CPU sqrt not being correctly rounded), in one pass that
reads w, g, the states and ema once and writes them once (36 B per parameter for RMSProp + EMA, 28
for momentum + EMA), where torch.optim's foreach ops stream each buffer several times.

The caller (kernels/chunked.py) has already read found_inf on the host and returns before calling
here when the step is skipped. The flat buffers are split into blocks that one thread per torch
thread takes in turn (`_split`), each compiled call releasing the GIL.

Scalars arrive as np.float32, computed from the Python floats exactly as the references' torch ops
round them (a float scalar in a float32 op is rounded to float32 first).
"""

import functools
import itertools
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch

_JIT = dict(nogil=True, cache=True, error_model="numpy")  # no fastmath: the reference's bits


@numba.njit(**_JIT)
def _rmsprop(w, g, ms, mom, ema, lo, hi, lr, one_minus_decay, momentum, eps, weight_decay, scale, ema_w):
    for i in range(lo, hi):
        gi = g[i] * scale + weight_decay * w[i]
        m = ms[i] + one_minus_decay * (gi * gi - ms[i])
        v = momentum * mom[i] + (gi * lr) / np.sqrt(m + eps)
        x = w[i] - v
        ms[i], mom[i], w[i] = m, v, x
        if ema.shape[0]:
            ema[i] = ema[i] - ema_w * (ema[i] - x)


@numba.njit(**_JIT)
def _momentum(w, g, acc, ema, lo, hi, lr, momentum, nesterov, weight_decay, scale, ema_w):
    for i in range(lo, hi):
        gi = g[i] * scale + weight_decay * w[i]
        a = momentum * acc[i] + gi
        x = w[i] - lr * (gi + momentum * a if nesterov else a)
        acc[i], w[i] = a, x
        if ema.shape[0]:
            ema[i] = ema[i] - ema_w * (ema[i] - x)


def supported(*buffers) -> bool:
    """True when every given buffer (None allowed) is a contiguous fp32 CPU tensor (fp16/bf16
    gradients go through the chunked torch ops, which widen them)."""
    return all(
        b is None or (b.device.type == "cpu" and b.dtype == torch.float32 and b.is_contiguous())
        for b in buffers
    )


@functools.cache
def thread_pool(workers: int) -> ThreadPoolExecutor:
    """The threads both CPU routes of the chunked path share (one per torch thread). Idle, they block on
    the executor's queue: unlike OpenMP's workers they never spin, so the forward pass after an
    optimizer step finds its cores free. (numba's own threading layer is not used: no parallel=True.)"""
    return ThreadPoolExecutor(workers, thread_name_prefix="fasttrain-chunked")


_NO_EMA = np.empty(0, np.float32)


def _arrays(*buffers):
    return [_NO_EMA if b is None else b.detach().numpy() for b in buffers]


def rmsprop_tf_update(
    w, g, ms, mom, ema, *, lr, decay, momentum, eps, weight_decay, grad_scale, ema_weight, workers
) -> None:
    """One RMSProp + EMA update on `workers` threads; lr, grad_scale, ema_weight: floats or None."""
    arrays = _arrays(w, g, ms, mom, ema)
    scalars = (
        np.float32(lr),
        np.float32(1.0 - decay),  # the reference's (1.0 - f32(decay)), a float rounded by the op
        np.float32(momentum),
        np.float32(eps),
        np.float32(weight_decay),
        np.float32(1.0 if grad_scale is None else grad_scale),
        np.float32(0.0 if ema_weight is None else ema_weight),
    )
    _split(workers, _rmsprop, arrays, scalars)


def momentum_update(
    w, g, acc, ema, *, lr, momentum, nesterov, weight_decay, grad_scale, ema_weight, workers
) -> None:
    """One momentum + EMA update on `workers` threads; lr, grad_scale, ema_weight: floats or None."""
    arrays = _arrays(w, g, acc, ema)
    scalars = (
        np.float32(lr),
        np.float32(momentum),
        bool(nesterov),
        np.float32(weight_decay),
        np.float32(1.0 if grad_scale is None else grad_scale),
        np.float32(0.0 if ema_weight is None else ema_weight),
    )
    _split(workers, _momentum, arrays, scalars)


# Elements per block (1 MiB per fp32 buffer): the threads take blocks from a shared counter rather
# than one fixed half each. After any torch op that ran in parallel, torch's OpenMP workers keep
# spinning on their cores for a while (libgomp's spin-wait), so a thread sharing a core with one runs
# at about half speed at first; with blocks the thread on the free core takes on more of the work.
# Measured on the 2-core CPU, ResNet-50 momentum + EMA right after a parallel torch op: 42.6 ms with
# fixed halves, 25.2 ms when no OpenMP worker spins.
# The trainer's passive OpenMP wait (fasttrain/threads.py) removes that spinning; the blocks still
# balance the work when another program holds one of the cores.
BLOCK = 1 << 18


def _split(workers: int, kernel, arrays, scalars) -> None:
    """kernel(*arrays, lo, hi, *scalars) over blocks of BLOCK elements, on `workers` threads (this
    one and workers - 1 from thread_pool), each taking the next block until none is left."""
    n = arrays[0].shape[0]
    blocks = itertools.count()  # next() on a count is atomic under the GIL

    def work():
        while (lo := next(blocks) * BLOCK) < n:
            kernel(*arrays, lo, min(lo + BLOCK, n), *scalars)

    helpers = min(workers, -(-n // BLOCK)) - 1
    pending = [thread_pool(workers).submit(work) for _ in range(helpers)]
    work()
    for future in pending:
        future.result()
