"""The BatchNorm kernels (kernels/batch_norm.py, batch_norm_backward.py) compiled for a GPU, and their
launch geometry there, without one.

Triton's interpreter (how tests/test_bn_kernels.py runs them) accepts code the GPU compiler rejects
(types, layouts, ops it has no lowering for), and says nothing of registers. So each kernel, in the
variants the product launches, is compiled ahead of time for sm_90 (an H100/H200) with Triton's own
compiler and ptxas, at the GPU launch geometry (GPU_TILE, GPU_NUM_WARPS, no FMA contraction), and its
resource use read from the cubin: it must compile, spill nothing, and stay within 96 registers a thread
(at 8 warps that leaves at least two programs resident per SM; tiles of 8192 elements took 144-255
registers and spilled), and read and write the bf16 activations only as 16-byte vectors (given the
16-byte alignment and channel counts divisible by 16 that ResNet's and Inception's BNs launch with).
The compiles run in a process of their own: Triton decides between compiling and interpreting when it
is first imported, and this test session imported it for the interpreter.
Skipped where Triton's NVIDIA backend or its cuobjdump is missing.

The reducing kernels' program count on a GPU (one wave: every program resident at once) is checked
with the GPU's properties and the compiled kernel's occupancy stood in.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from fasttrain.kernels import batch_norm_layout as layout

MAX_REGISTERS = 96
_INTS = ("M", "C", "rows_per_prog")


def _variants():
    """(name, kernel, signature, constexprs) of every variant the product launches on a GPU in bf16."""
    import triton.language as tl
    from fasttrain.kernels import batch_norm as B
    from fasttrain.kernels import batch_norm_backward as BB
    from fasttrain.kernels import batch_norm_layout as L

    f32, act = "*fp32", "*bf16"
    vectors = dict.fromkeys(("mean_ptr", "invstd_ptr", "w_ptr", "b_ptr"), f32)
    tile = dict(ACC=tl.float32, BLOCK_C=64, BLOCK_M=L.GPU_TILE // 64)
    sig = {"x_ptr": act, "part_ptr": f32, "M": "i32", "C": "i32", "rows_per_prog": "i32"}
    yield "statistics", B._stats_kernel, sig, tile
    sig = dict.fromkeys(("part_ptr", "mean_ptr", "invstd_ptr", "rmean_ptr", "rvar_ptr", "var_ptr"), f32)
    sig.update(P="i32", M="i32", C="i32", rows_per_prog="i32", momentum="fp32", eps="fp32")
    for update, var in ((True, False), (False, True)):  # nn.BatchNorm2d's; the slim batch norm's
        merge = dict(UPDATE_RUNNING=update, WRITE_VAR=var, ACC=tl.float32, BLOCK_P=L.MERGE_TILE, BLOCK_C=1)
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
    from fasttrain.kernels import batch_norm_layout as L
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    options = {"num_warps": L.GPU_NUM_WARPS, "enable_fp_fusion": False}
    for name, kernel, signature, constexprs in _variants():
        fn = triton.jit(kernel.fn)
        # What a launch's runtime specialization sees for ResNet's and Inception's BNs: pointers
        # aligned to 16 bytes (torch's allocations), C, M (N*H*W at batch 256) and rows_per_prog (a
        # multiple of BLOCK_M) divisible by 16.
        aligned = [a for a in fn.arg_names if a in signature and (signature[a][0] == "*" or a in _INTS)]
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = compiled.asm["ptx"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            cmd = [os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin.name]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        line = next(x for x in out.splitlines() if "REG:" in x)
        fields = (f.split(":") for f in line.split() if ":" in f)
        access = {  # global loads and stores of one bf16 (not vectorized) and of 16-byte vectors
            "scalar_bf16": len(re.findall(r"(?:ld|st)\.global[.\w]*\.[bu]16\b", ptx)),
            "ld_v4": ptx.count("ld.global.v4"),
            "st_v4": ptx.count("st.global.v4"),
        }
        resources = {k: int(v) for k, v in fields if v.isdigit()}
        print(json.dumps({"name": name, **resources, **access}), flush=True)


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
        # Every bf16 activation read or written as 16-byte vectors (8 a thread): without the launch's
        # alignment these kernels compile to 8-32 scalar 2-byte accesses each.
        assert row["scalar_bf16"] == 0, f"scalar bf16 accesses: {row}"
        if not row["name"].startswith("merge"):
            assert row["ld_v4"] >= 1, row


if __name__ == "__main__":
    _report()


class _Counted:
    """Stands in for a lazy_jit kernel: `resident` programs an SM holds; counts the questions."""

    def __init__(self, resident):
        self.resident, self.asked = resident, 0

    def resident_per_sm(self, *args, **meta):
        self.asked += 1
        return self.resident


@pytest.mark.parametrize("shape", [(256, 64, 112, 112), (256, 256, 56, 56), (256, 2048, 7, 7), (2, 64, 3, 3)])
@pytest.mark.parametrize("resident", [3, 6])
def test_reducing_kernels_run_in_one_wave_on_a_gpu(monkeypatch, shape, resident):
    sms = 132  # an H100 SXM
    props = type("Props", (), {"multi_processor_count": sms})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(layout, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(layout, "_RESIDENT", {})
    n, c, h, w = shape
    x = torch.empty(shape, device="meta").contiguous(memory_format=torch.channels_last)
    k = layout._Layout(x)
    fake = type("X", (), {"device": torch.device("cuda", 0), "dtype": torch.bfloat16})()
    kernel = _Counted(resident)
    block_m = k.tile_meta["BLOCK_M"]
    for _ in range(2):
        P, rows = layout._programs(kernel, k, (fake, k.M, k.C, block_m), k.tile_meta)
        assert rows % block_m == 0 and P * rows >= k.M > (P - 1) * rows  # every row, no empty program
        assert P * k.cblocks <= resident * sms  # all resident at once
        tiles = -(-k.M // block_m)
        # As many as fit (a wave at least 90% full), unless there are fewer tiles than that.
        assert P * k.cblocks >= min(0.9 * resident * sms, tiles * k.cblocks * 0.5), (P, k.cblocks)
    assert kernel.asked == 1  # counted once per kernel variant, not on every call
    monkeypatch.setattr(layout, "PROGRAMS_PER_SM", 8)
    P, _ = layout._programs(kernel, k, (fake, k.M, k.C, block_m), k.tile_meta)
    assert P * k.cblocks <= 8 * sms and kernel.asked == 1
