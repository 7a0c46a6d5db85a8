"""The fast path of both updates for devices without Triton (the CPU; CUDA below compute capability
7.0, such as the P40). On the CPU, with fp32 contiguous buffers, it hands the update to the compiled
loop of kernels/cpu.py (one pass, the float32 equations' bits). Everywhere else (CUDA, or bf16/fp16
gradients on the CPU): in-place torch ops over cache-sized chunks of the flat buffers, below.

Same arguments and semantics as rmsprop_tf.rmsprop_tf_update_reference and
momentum.momentum_update_reference (the specifications; the equations are in those modules'
docstrings), plus `scratch`, from `new_scratch`. Results agree with the references to rounding (an
ulp or two; tests/test_rmsprop_tf.py): `add(alpha=)`, `addcdiv` and `lerp` may round a product and a sum
once where the reference rounds twice, a float lr multiplies g / sqrt(ms + eps) rather than g, and
`lerp` evaluates the EMA as `w - (w - ema) * d` once its weight `1 - d` is >= 0.5 (the first 8
warm-up steps).

Why chunks: the reference runs each of its ~10 ops over the whole buffer and allocates a temporary
per op, so on the CPU a full ResNet-50 (25.6M parameters, 100 MB per buffer) streams every buffer
through DRAM about ten times and faults in fresh pages each step. Here each op runs over one chunk
while the chunk's w, g, states and scratch rows (under 1 MiB) stay in the core's L2, so DRAM sees
roughly the one-pass floor (36 B/param for RMSProp + EMA, 28 for momentum + EMA). The scratch is
allocated once by the caller: no allocation per step.

Why threads on the CPU: a chunk of CPU_CHUNK elements is below torch's intra-op grain size, so each
op runs on the calling thread, and the chunks are split between one Python thread per torch thread
(torch ops release the GIL). Letting torch split every op over its OpenMP threads instead costs one
barrier per op (about 2,000 per ResNet-50 update); on a 2-core machine shared with other processes
(the trainer's own data workers, for one) a barrier waits whenever a core is taken: on ResNet-50,
momentum + EMA took a median 6.2 s with 128 Ki chunks split by torch and 0.11 s split this way
(medians of 9 interleaved rounds, load average ~6).

Skip on found_inf (nonzero or NaN: skip, as the kernels do):
- CPU: the host reads found_inf (free there) and returns before touching anything. It reads lr and
  grad_scale too, so they fold into the ops as Python floats (fewer passes per chunk).
- CUDA: no host read, so a CUDA graph can capture the update. Each chunk's new values go to scratch
  rows and `torch.where(found_inf == 0, new, old, out=old)` commits them, which keeps every old bit
  when the step is skipped (multiplying by a 0/1 factor could not: 0 * inf is NaN).
On CUDA one thread launches everything and the chunk is larger (CUDA_CHUNK): there the aim is a
bounded scratch and few launches, not cache residency. Not measured on a GPU (this project has none).
"""

import torch

from . import cpu
from .common import check_args, f32

# 32,000 elements (125 KiB per buffer): just below torch's intra-op grain size (32,768), so each op
# runs serially on the thread that calls it; 7 buffers of a chunk (w, g, states, ema, 2 scratch
# rows) take under 1 MiB of a core's 2 MiB L2.
CPU_CHUNK = 32_000
# 1 Mi elements: 4 MiB per scratch row, 25 chunks per ResNet-50 update (about 350 launches).
CUDA_CHUNK = 1 << 20
# Scratch rows: 2 for the in-place update (scaled gradient, denominator); 4 more for the new values
# of w, states and ema when found_inf is committed with torch.where on a device without host reads.
_ROWS = 6


def new_scratch(device: torch.device) -> torch.Tensor:
    """The scratch both updates need on `device`, allocated once per optimizer: (workers, rows,
    chunk) fp32, with one worker per torch thread on the CPU and one elsewhere."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.empty((torch.get_num_threads(), _ROWS, CPU_CHUNK), dtype=torch.float32)
    return torch.empty((1, _ROWS, CUDA_CHUNK), dtype=torch.float32, device=device)


def rmsprop_tf_update_chunked(
    w: torch.Tensor,
    g: torch.Tensor,
    ms: torch.Tensor,
    mom: torch.Tensor,
    ema: torch.Tensor | None,
    *,
    lr,
    decay: float,
    momentum: float,
    eps: float,
    weight_decay: float = 0.0,
    grad_scale=None,
    found_inf: torch.Tensor | None = None,
    ema_weight: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """TF's RMSProp + L2 + EMA in place, chunk by chunk (see rmsprop_tf for the equations)."""
    check_args("rmsprop_tf", w, found_inf, ema_weight, g=g, ms=ms, mom=mom, ema=ema)
    decay, momentum, eps, weight_decay = f32(decay), f32(momentum), f32(eps), f32(weight_decay)
    lr, grad_scale = _on_host_if_free(w.device, lr, grad_scale)
    if _compiled_on_cpu(w, g, ms, mom, ema):
        if not _skipped(found_inf):
            cpu.rmsprop_tf_update(
                w, g, ms, mom, ema, lr=lr, decay=decay, momentum=momentum, eps=eps,
                weight_decay=weight_decay, grad_scale=grad_scale, ema_weight=_on_host(ema_weight),
                workers=_workers(scratch),
            )  # fmt: skip
        return

    def update(lo, hi, s, t, new_w, new_ms, new_mom, new_ema):
        _scaled_gradient(g[lo:hi], w[lo:hi], grad_scale, weight_decay, out=s)
        torch.mul(s, s, out=t)
        torch.lerp(ms[lo:hi], t, 1.0 - decay, out=new_ms)  # ms + (1 - decay) * (g * g - ms)
        torch.add(new_ms, eps, out=t).sqrt_()
        lr_value = lr  # a float lr is folded into addcdiv; a tensor one multiplies g first
        if isinstance(lr, torch.Tensor):
            s.mul_(lr)
            lr_value = 1.0
        torch.mul(mom[lo:hi], momentum, out=new_mom).addcdiv_(s, t, value=lr_value)  # mom + g*lr/root
        torch.sub(w[lo:hi], new_mom, out=new_w)
        if ema is not None:
            torch.lerp(ema[lo:hi], new_w, ema_weight, out=new_ema)

    _run_chunks(update, [w, ms, mom, ema], found_inf, scratch)


def momentum_update_chunked(
    w: torch.Tensor,
    g: torch.Tensor,
    acc: torch.Tensor,
    ema: torch.Tensor | None,
    *,
    lr,
    momentum: float,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    grad_scale=None,
    found_inf: torch.Tensor | None = None,
    ema_weight: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """TF's Momentum + L2 + EMA in place, chunk by chunk (see momentum for the equations)."""
    check_args("momentum", w, found_inf, ema_weight, g=g, acc=acc, ema=ema)
    momentum, weight_decay = f32(momentum), f32(weight_decay)
    lr, grad_scale = _on_host_if_free(w.device, lr, grad_scale)
    if _compiled_on_cpu(w, g, acc, ema):
        if not _skipped(found_inf):
            cpu.momentum_update(
                w, g, acc, ema, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                grad_scale=grad_scale, ema_weight=_on_host(ema_weight), workers=_workers(scratch),
            )  # fmt: skip
        return

    def update(lo, hi, s, t, new_w, new_acc, new_ema):
        _scaled_gradient(g[lo:hi], w[lo:hi], grad_scale, weight_decay, out=s)
        torch.add(s, acc[lo:hi], alpha=momentum, out=new_acc)  # momentum * acc + g
        step = new_acc
        if nesterov:
            step = torch.add(s, new_acc, alpha=momentum, out=t)  # g + momentum * acc
        if isinstance(lr, torch.Tensor):
            torch.sub(w[lo:hi], torch.mul(step, lr, out=s), out=new_w)
        else:
            torch.sub(w[lo:hi], step, alpha=lr, out=new_w)  # one op with a float lr
        if ema is not None:
            torch.lerp(ema[lo:hi], new_w, ema_weight, out=new_ema)

    _run_chunks(update, [w, acc, ema], found_inf, scratch)


def _host_reads_free(device: torch.device) -> bool:
    """True on the CPU, where reading found_inf costs nothing; elsewhere a read would sync with the
    device and break CUDA graph capture. (Tests patch this to run the device path on CPU tensors.)"""
    return device.type == "cpu"


def _on_host_if_free(device: torch.device, *scalars):
    """On the CPU, 0-d tensors among `scalars` as Python floats (a free host read there), so that
    ops can take them as alpha= or value= and a chunk needs fewer passes; elsewhere unchanged."""
    if not _host_reads_free(device):
        return scalars
    return tuple(float(x) if isinstance(x, torch.Tensor) else x for x in scalars)  # note: host reads


def _compiled_on_cpu(*buffers) -> bool:
    """True where kernels/cpu.py's compiled loop runs: host reads free, fp32 contiguous buffers."""
    return _host_reads_free(buffers[0].device) and cpu.supported(*buffers)


def _skipped(found_inf) -> bool:
    return found_inf is not None and bool(found_inf != 0)  # note: a host read (NaN counts: skip)


def _on_host(ema_weight) -> float | None:
    return None if ema_weight is None else float(ema_weight)  # note: a host read (free on the CPU)


def _workers(scratch) -> int:
    return torch.get_num_threads() if scratch is None else scratch.shape[0]


def _scaled_gradient(g, w, grad_scale, weight_decay: float, out: torch.Tensor) -> None:
    """out = g * grad_scale + weight_decay * w, computed in fp32 whatever g's dtype."""
    if isinstance(grad_scale, float) and grad_scale == 1.0:
        grad_scale = None  # g * 1.0 is g exactly (one process without loss scaling)
    if g.dtype != torch.float32:
        g = out.copy_(g)  # fp16/bf16 gradients: widen first, as the reference does
    if grad_scale is not None:
        g = torch.mul(g, grad_scale, out=out)
    if weight_decay != 0.0:  # (the reference adds 0 * w: the same unless w holds an inf or NaN)
        torch.add(g, w, alpha=weight_decay, out=out)
    elif g is not out:
        out.copy_(g)


def _run_chunks(update, buffers: list, found_inf, scratch) -> None:
    """Call `update(lo, hi, s, t, *destinations)` over every chunk of `buffers` (w first, then the
    states, then ema or None), the chunks split into one contiguous run per scratch worker.
    Destinations are the buffers' chunks themselves, or scratch rows committed with torch.where when
    found_inf must be applied without a host read."""
    w = buffers[0]
    if scratch is None:
        scratch = new_scratch(w.device)
    if found_inf is not None and _host_reads_free(w.device):
        if _skipped(found_inf):
            return
        found_inf = None
    ok = None if found_inf is None else found_inf == 0
    workers, chunk = scratch.shape[0], scratch.shape[2]
    starts = range(0, w.numel(), chunk)
    per_worker = -(-len(starts) // workers)
    runs = [starts[i : i + per_worker] for i in range(0, len(starts), per_worker)]
    # The first run on this thread, the others on the pool; result() re-raises a worker's error.
    pending = [
        cpu.thread_pool(workers).submit(_run, update, buffers, run, scratch[i], ok)
        for i, run in enumerate(runs)
        if i
    ]
    if runs:
        _run(update, buffers, runs[0], scratch[0], ok)
    for future in pending:
        future.result()


@torch.no_grad()  # grad mode is per thread: the pool's threads start with it on
def _run(update, buffers: list, starts: range, scratch: torch.Tensor, ok) -> None:
    numel = buffers[0].numel()
    for lo in starts:
        hi = min(lo + starts.step, numel)
        rows = [row[: hi - lo] for row in scratch]
        s, t = rows[0], rows[1]
        if ok is None:
            update(lo, hi, s, t, *(None if b is None else b[lo:hi] for b in buffers))
            continue
        new = [None if b is None else row for b, row in zip(buffers, rows[2:])]
        update(lo, hi, s, t, *new)
        for b, n in zip(buffers, new):
            if b is not None:
                torch.where(ok, n, b[lo:hi], out=b[lo:hi])
