"""Launcher-side helpers shared by the optimizer kernels (nothing here runs inside a kernel).

- `triton` / `tl`: the Triton modules, or placeholders where Triton does not import (macOS, Windows),
  so that the kernel modules still import and their torch references still run.
- `lazy_jit`: `triton.jit` applied at the first launch, once per interpreter mode (see its docstring);
  its `resident_per_sm` and `resident_programs`: how many programs of a compiled kernel an SM holds.
- `split_scalar`: a hyperparameter that is either a Python float or a 0-d device tensor, as op args.
- `ema_one_minus_decay`: the EMA weight `1 - d` as a 0-d device tensor (TensorFlow's
  ExponentialMovingAverage with `num_updates`), computed once per optimizer step for every group:

      n = step + 1                                   (steps applied, including this one)
      d = min(decay, (1 + n) / (10 + n))             (warm-up on; plain `decay` when off)
      returns 1 - d                                  (all in float32, as TensorFlow computes it)
"""

import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # Triton is optional off Linux: the torch references still work.
    HAVE_TRITON = False
    triton = None

    class tl:  # noqa: N801 - stands in for triton.language in kernel signatures only
        constexpr = None


# Launch geometry. On a GPU: 1024 elements per program, 4 warps (8 fp32 per thread: two 16-byte
# accesses per stream), the usual shape for a bandwidth-bound elementwise kernel. Under the
# interpreter every program is a Python-level loop iteration over NumPy arrays, so one huge block is
# fastest (1,000,003 elements in ~50 ms instead of ~1,000 programs).
GPU_BLOCK_SIZE = 1024
GPU_NUM_WARPS = 4
INTERPRETER_MAX_BLOCK_SIZE = 1 << 20


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET is set: Triton then runs kernels on CPU tensors in NumPy."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # Triton >= 3.4 reads the variable through its knobs
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class lazy_jit:  # noqa: N801 - used as a decorator, like triton.jit
    """`triton.jit` applied at launch time, once per interpreter mode.

    Triton decides between compiling and interpreting when a function is decorated. Decorating at
    import would freeze the mode at whichever moment the module was first imported (in a pytest run,
    possibly before a test sets TRITON_INTERPRET=1); deciding per launch makes the mode follow the
    environment. Kernels decorated this way must not call other @triton.jit functions.
    """

    def __init__(self, fn):
        self.fn = fn
        self._by_mode = {}

    def _jit(self):
        mode = interpreter_enabled()
        if mode not in self._by_mode:
            self._by_mode[mode] = triton.jit(self.fn)
        return self._by_mode[mode]

    def __getitem__(self, grid):
        return self._jit()[grid]

    def resident_per_sm(self, *args, **meta) -> int:
        """How many programs of this kernel, compiled for a GPU launch with `args` and `meta` (the same
        specialization: dtypes, 16-byte alignment, integers divisible by 16), one SM holds at once."""
        compiled = self._jit().warmup(*args, grid=(1,), **meta)  # compiles (or finds) it; no launch
        compiled = compiled.result() if hasattr(compiled, "result") else compiled  # Triton's async compile
        compiled._init_handles()  # loads it: the registers a thread are known from here
        props = torch.cuda.get_device_properties(args[0].device)
        return resident_programs(
            compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared, props
        )


def resident_programs(regs: int, warps: int, shared: int, props) -> int:
    """Programs (thread blocks) of `warps` warps, `regs` registers a thread and `shared` bytes of shared
    memory that one SM of a device with CUDA properties `props` holds at once, by CUDA's occupancy rules
    for sm_70..sm_90: registers go to warps in units of 256 from each of the SM's 4 quarters (a quarter
    of regs_per_multiprocessor, 64K on every such GPU); at most max_threads_per_multi_processor threads
    and 32 blocks; shared memory plus 1 KiB the runtime reserves per block. (48 registers at 8 warps: 5
    programs; 80: 3.)"""
    quarter = getattr(props, "regs_per_multiprocessor", 65536) // 4
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = 4 * (quarter // per_warp) // warps
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    by_shared = props.shared_memory_per_multiprocessor // (shared + 1024)
    return max(1, min(by_regs, by_threads, by_shared, 32))


def launches(numel: int) -> list[tuple[int, int, tuple[int], dict]]:
    """[(start, end, grid, launch options)] covering `numel` elements of an elementwise kernel.

    Triton specializes integer arguments divisible by 16 and pointers aligned to 16 bytes; only
    with both does a masked kernel get 16-byte vector loads and stores (checked in the PTX: 10
    ld.global.v4 instead of 40 scalar loads for RMSProp). So a length that is not a multiple of 16
    is split into a vectorized bulk and a tail launch of at most 15 elements.
    """
    bulk = numel - numel % 16
    pieces = [(lo, hi) for lo, hi in ((0, bulk), (bulk, numel)) if hi > lo]
    result = []
    for lo, hi in pieces:
        if interpreter_enabled():
            block, options = min(triton.next_power_of_2(hi - lo), INTERPRETER_MAX_BLOCK_SIZE), {}
        else:
            # No FMA contraction: the kernels then round exactly like the torch reference (a
            # bandwidth-bound kernel loses nothing by it).
            block, options = GPU_BLOCK_SIZE, {"num_warps": GPU_NUM_WARPS, "enable_fp_fusion": False}
        result.append((lo, hi, (triton.cdiv(hi - lo, block),), {"BLOCK_SIZE": block, **options}))
    return result


def why_triton_cannot_run(device: torch.device) -> str | None:
    """Why Triton's kernels cannot run on `device`, or None (the meta device traces them: None)."""
    if not HAVE_TRITON:
        return "Triton is not installed"
    if device.type == "cpu" and not interpreter_enabled():
        return "on the CPU Triton's kernels run only under TRITON_INTERPRET=1"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (7, 0):
        return "Triton needs a GPU of compute capability 7.0 or newer"
    if device.type not in ("cpu", "cuda", "meta"):
        return f"Triton does not run on {device.type}"
    return None


def check_triton_launch(name: str, w: torch.Tensor, instead: str = "impl='torch'") -> None:
    """Raise a clear error where the Triton kernel cannot run on `w`'s device, naming `instead`."""
    reason = why_triton_cannot_run(w.device)
    if reason:
        raise RuntimeError(f"{name}: {reason}; use {instead}.")


def check_args(name: str, w: torch.Tensor, found_inf, ema_weight, **buffers) -> None:
    """Raise ValueError unless `w` and every other buffer is 1-D, contiguous, fp32 (fp16 and bf16
    are accepted for the gradient `g`), on one device with one length; found_inf and ema_weight are
    None or 1-element tensors on that device, and ema_weight is given when the `ema` buffer is."""
    for key, t in {"w": w, **buffers}.items():
        if t is None:
            continue
        allowed = (torch.float32, torch.float16, torch.bfloat16) if key == "g" else (torch.float32,)
        if t.dtype not in allowed:
            raise ValueError(f"{name}: buffer {key!r} is {t.dtype}; expected one of {allowed}.")
        if t.dim() != 1 or t.numel() != w.numel() or not t.is_contiguous():
            raise ValueError(
                f"{name}: buffer {key!r} must be 1-D contiguous with {w.numel()} elements, "
                f"got shape {tuple(t.shape)} with strides {t.stride()}."
            )
        if t.device != w.device:
            raise ValueError(f"{name}: buffer {key!r} is on {t.device}, the weights on {w.device}.")
    if buffers.get("ema") is not None and ema_weight is None:
        raise ValueError(f"{name}: ema is given but ema_weight (1 - d) is not.")
    for key, t in (("found_inf", found_inf), ("ema_weight", ema_weight)):
        if t is not None and (t.numel() != 1 or t.device != w.device):
            raise ValueError(f"{name}: {key} must be a 1-element tensor on {w.device}.")


def split_scalar(name: str, value, like: torch.Tensor) -> tuple[torch.Tensor | None, float]:
    """(tensor, value) for a scalar given as a Python float or a 0-d (1-element) tensor on `like`'s
    device: the tensor (value unused) or None and the float, as the custom ops take them.

    A tensor is read by the kernel on the device (no host sync; a CUDA graph replay sees its current
    value); a float is passed by value (rounded to fp32).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.device != like.device:
            raise ValueError(
                f"{name} must be a float or a 1-element tensor on {like.device}, "
                f"got shape {tuple(value.shape)} on {value.device}."
            )
        return value, 0.0
    return None, float(value)


def f32(x: float) -> float:
    """`x` rounded to float32, as a kernel receives a Python float argument."""
    return torch.tensor(x, dtype=torch.float32).item()


def ema_one_minus_decay(step: torch.Tensor, decay: float, warmup: bool) -> torch.Tensor:
    """`1 - d` as a 0-d float32 tensor on `step`'s device (equations in the module docstring).

    `step` holds the number of steps applied before this one; nothing is read back to the host.
    """
    d = torch.full((), decay, dtype=torch.float32, device=step.device)
    if warmup:
        n = step.to(torch.float32) + 1.0
        d = torch.minimum(d, (1.0 + n) / (10.0 + n))
    return 1.0 - d
