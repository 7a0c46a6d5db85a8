"""The BatchNorm kernels (kernels/batch_norm.py, batch_norm_backward.py) compiled for a GPU, without one.

Triton's interpreter (how tests/test_bn_kernels.py runs them) accepts code the GPU compiler rejects
(types, layouts, ops it has no lowering for), and says nothing of registers. So each kernel, in the
variants the product launches, is compiled ahead of time for sm_90 (an H100/H200) with Triton's own
compiler and ptxas, at the GPU launch geometry (GPU_TILE, GPU_NUM_WARPS, no FMA contraction), and its
resource use read from the cubin: it must compile, spill nothing, and stay within 96 registers a thread
(at 8 warps that leaves at least two programs resident per SM; tiles of 8192 elements took 144-255
registers and spilled). The compiles run in a process of their own: Triton decides between compiling
and interpreting when it is first imported, and this test session imported it for the interpreter.
Skipped where Triton's NVIDIA backend or its cuobjdump is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MAX_REGISTERS = 96


def _variants():
    """(name, kernel, signature, constexprs) of every variant the product launches on a GPU in bf16."""
    import triton.language as tl
    from fasttrain.kernels import batch_norm as B
    from fasttrain.kernels import batch_norm_backward as BB

    f32, act = "*fp32", "*bf16"
    vectors = dict.fromkeys(("mean_ptr", "invstd_ptr", "w_ptr", "b_ptr"), f32)
    tile = dict(ACC=tl.float32, BLOCK_C=64, BLOCK_M=B.GPU_TILE // 64)
    sig = {"x_ptr": act, "part_ptr": f32, "M": "i32", "C": "i32", "rows_per_prog": "i32"}
    yield "statistics", B._stats_kernel, sig, tile
    sig = dict.fromkeys(("part_ptr", "mean_ptr", "invstd_ptr", "rmean_ptr", "rvar_ptr", "var_ptr"), f32)
    sig.update(P="i32", M="i32", C="i32", rows_per_prog="i32", momentum="fp32", eps="fp32")
    for update, var in ((True, False), (False, True)):  # nn.BatchNorm2d's; the slim batch norm's
        merge = dict(UPDATE_RUNNING=update, WRITE_VAR=var, ACC=tl.float32, BLOCK_P=B.MERGE_TILE, BLOCK_C=1)
        yield f"merge update={update}", B._merge_kernel, sig, merge
    apply = {"x_ptr": act, "res_ptr": act, "y_ptr": act, **vectors, "M": "i32", "C": "i32"}
    sums = {"dy_ptr": act, "x_ptr": act, "y_ptr": act, "g_ptr": act, "part_ptr": f32, **vectors}
    sums.update(M="i32", C="i32", rows_per_prog="i32")
    for res, w in ((True, True), (False, True), (False, False)):  # ResNet tail, BN + ReLU, slim BN
        flags = dict(HAS_RES=res, RELU=True, HAS_W=w, HAS_B=True)
        yield f"apply {flags}", B._apply_kernel, apply, {**flags, **tile}
        yield f"grad sums {flags}", BB._grad_sums_kernel, sums, {**flags, **tile}
    grad_x = {"g_ptr": act, "x_ptr": act, "dx_ptr": act, "sums_ptr": f32, **vectors, "M": "i32", "C": "i32"}
    for mask, w in ((True, True), (False, True), (True, False)):
        flags = dict(MASK_RELU=mask, HAS_W=w, HAS_B=True)
        yield f"grad x {flags}", BB._grad_x_kernel, grad_x, {**flags, **tile}


def _report() -> None:
    """Compile every variant for sm_90; one JSON line each: name and the cubin's resource use."""
    import tempfile

    import triton
    from fasttrain.kernels import batch_norm as B
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    options = {"num_warps": B.GPU_NUM_WARPS, "enable_fp_fusion": False}
    for name, kernel, signature, constexprs in _variants():
        source = ASTSource(fn=triton.jit(kernel.fn), signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            cmd = [os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin.name]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        line = next(x for x in out.splitlines() if "REG:" in x)
        fields = (f.split(":") for f in line.split() if ":" in f)
        print(json.dumps({"name": name, **{k: int(v) for k, v in fields if v.isdigit()}}), flush=True)


def test_every_kernel_compiles_for_sm90_without_spilling():
    triton = pytest.importorskip("triton")
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(tools, "cuobjdump")):
        pytest.skip("Triton's NVIDIA backend tools (ptxas, cuobjdump) are not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(rows) == len(list(_variants())), run.stdout
    for row in rows:
        assert row["STACK"] == 0 and row["LOCAL"] == 0, f"spills: {row}"
        assert row["REG"] <= MAX_REGISTERS, f"too many registers a thread: {row}"


if __name__ == "__main__":
    _report()
