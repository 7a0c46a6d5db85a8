"""Launch geometry of the BatchNorm kernels (kernels/batch_norm.py): tiles, the reducing kernels'
program count, the merge's shape, and the channels_last row view they index.

One call's `_Layout` holds the (M, C) view's sizes and tile constexprs, the same in forward and backward;
`_programs` picks how many programs a reducing kernel (statistics, the backward's sums) runs, and
`_Layout.merge` the merge's grid. bench/bench_bn.py times other values of the constants below.
"""

from __future__ import annotations

import warnings

import torch

from .common import interpreter_enabled, tl, triton

# Tile: BLOCK_M rows x BLOCK_C channels (contiguous along C). On a GPU GPU_TILE elements per tile (32
# rows of 64 channels) over 8 warps: 8 elements, one 16-byte bf16 vector, per thread and tensor. Compiled
# for sm_90 offline (tests/test_bn_kernels_compile.py; Triton 3.6 and 3.9) that takes 32-70 registers a
# thread; tiles of 8192 took 144-255 and spilled (the backward's sums), leaving one program per SM. The
# reducing kernels (statistics, the backward's sums) run as many programs as the GPU holds at once
# (PROGRAMS_PER_SM None: one wave, counted from the compiled kernel's registers; a number fixes it), each
# looping over its rows' tiles: at a fixed 8 per SM, Triton 3.6's 40-register statistics (6 fit) ran
# in two waves, the second a third full, and the 70-register sums (3 fit) in three. The merge takes
# all of a few channels' partials in one MERGE_TILE tile. Not yet timed on a GPU (bench/bench_bn.py).
# Under the interpreter every program is a Python loop iteration, so tiles are as large as the tensor
# allows.
GPU_TILE = 2048
GPU_NUM_WARPS = 8
PROGRAMS_PER_SM = None
MERGE_TILE = 2048
MERGE_BLOCK_P = 128  # the interpreter's merge: partials per loop iteration
# Under the interpreter: elements per tile and programs of the reducing kernels (tests set them small,
# so that several tiles per program, several programs and masked edges run on tiny tensors).
INTERPRETER_TILE = 1 << 16
INTERPRETER_PROGRAMS = 1


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """What the kernels compute in (and the vectors' dtype): float64 for float64 x, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _acc(x: torch.Tensor):
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def _geometry(x: torch.Tensor, M: int, C: int) -> tuple[int, int, dict]:
    """(BLOCK_M, BLOCK_C, launch options) for an (M, C) view."""
    if interpreter_enabled():
        block_c = triton.next_power_of_2(C)
        return max(1, min(triton.next_power_of_2(M), INTERPRETER_TILE // block_c)), block_c, {}
    block_c = min(64, triton.next_power_of_2(C))
    # No FMA contraction: the forward's z and the backward's recomputed one round alike.
    return GPU_TILE // block_c, block_c, {"num_warps": GPU_NUM_WARPS, "enable_fp_fusion": False}


_RESIDENT: dict = {}  # (kernel, device, dtypes, constexprs, integer specializations) -> programs an SM holds


def _programs(kernel, k: _Layout, args: tuple, meta: dict) -> tuple[int, int]:
    """(P, rows_per_prog) of a reducing kernel (grid (P, channel blocks)) about to be launched with
    `args` (its `part` and `rows_per_prog` stand-ins: the real ones follow from P) and `meta`:
    rows_per_prog a multiple of BLOCK_M, every program resident at once on a GPU."""
    tiles = triton.cdiv(k.M, meta["BLOCK_M"])
    x = args[0]
    if x.device.type == "cuda":
        per_sm = PROGRAMS_PER_SM
        if per_sm is None:
            ints = tuple((a % 16 == 0, a == 1) for a in args if isinstance(a, int))
            dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
            key = (kernel, x.device, dtypes, tuple((n, str(v)) for n, v in meta.items()), ints)
            if key not in _RESIDENT:
                try:
                    _RESIDENT[key] = kernel.resident_per_sm(*args, **meta)
                except Exception as err:  # Triton's warmup/_init_handles are private: a fixed count
                    warnings.warn(f"bn_act: programs per SM not counted ({err!r}); running 8", stacklevel=2)
                    _RESIDENT[key] = 8
            per_sm = _RESIDENT[key]
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        target = max(1, per_sm * sms // k.cblocks)
    else:
        target = INTERPRETER_PROGRAMS
    per_prog = triton.cdiv(tiles, min(tiles, target))
    return triton.cdiv(tiles, per_prog), per_prog * meta["BLOCK_M"]


def _format(t: torch.Tensor) -> torch.memory_format:
    """channels_last where t is laid out so (also where its shape makes both layouts one), else NCHW."""
    return (
        torch.channels_last if t.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t (N, C, H, W) as channels_last contiguous (a copy only when it is not)."""
    return t.contiguous(memory_format=torch.channels_last)


class _Layout:
    """Sizes and launch geometry of one call, the same in forward and backward."""

    def __init__(self, x: torch.Tensor):
        N, C, H, W = x.shape
        self.M, self.C = N * H * W, C
        block_m, block_c, options = _geometry(x, self.M, C)
        self.cblocks = triton.cdiv(C, block_c)
        self.tiles = (triton.cdiv(self.M, block_m), self.cblocks)
        self.tile_meta = dict(ACC=_acc(x), BLOCK_C=block_c, BLOCK_M=block_m, **options)
        self.vector = dict(dtype=_acc_dtype(x), device=x.device)

    def merge(self, P: int) -> tuple[tuple[int], dict]:
        """Grid and constexprs of the merge of P partials: on a GPU all of a few channels' partials in
        one tile (one load, no loop, several programs), MERGE_TILE elements; under the interpreter
        MERGE_BLOCK_P rows at a time."""
        meta = dict(self.tile_meta)
        block_c = meta.pop("BLOCK_C")
        meta.pop("BLOCK_M")
        if interpreter_enabled():
            merge_p, merge_c = MERGE_BLOCK_P, block_c
        else:
            merge_p = min(triton.next_power_of_2(P), MERGE_TILE)
            merge_c = min(block_c, max(1, MERGE_TILE // merge_p))
        grid = (triton.cdiv(self.C, merge_c),)
        return grid, dict(meta, BLOCK_C=merge_c, BLOCK_P=merge_p)
