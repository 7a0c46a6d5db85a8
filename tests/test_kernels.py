"""Every fused optimizer kernel (kernels/), each implementation: a step with found_inf set (1, inf or
NaN) leaves every buffer bit-identical, and the same call with found_inf 0 does update; the launchers'
argument checks; Triton on the CPU without its interpreter is a clear error; each Triton kernel
compiles for V100, A100 and H100 (ptxas from the Triton wheel, no GPU) with 16-byte vector access and
no flush-to-zero, RMSProp with IEEE sqrt and division. The per-kernel update tests against TensorFlow's
equations: test_rmsprop_tf.py, test_momentum.py.
"""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from fasttrain.kernels import chunked, rmsprop_tf
from fasttrain.kernels import momentum as momentum_kernel
from fasttrain.kernels.common import resident_programs
from kernel_helpers import (
    _device_skip,
    _triton_interpreter,  # noqa: F401  (an autouse fixture)
    needs_triton,
)

# --- skip on overflow


def _kernel_calls():
    common = dict(grad_scale=torch.tensor(0.5), ema_weight=torch.tensor(0.01))
    rms = dict(lr=torch.tensor(0.1), decay=0.9, momentum=0.9, eps=1.0, weight_decay=4e-5, **common)
    mom = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, **common)
    return [
        pytest.param(rmsprop_tf.rmsprop_tf_update_reference, 4, rms, id="rmsprop-torch"),
        pytest.param(momentum_kernel.momentum_update_reference, 3, mom, id="momentum-torch"),
        pytest.param(chunked.rmsprop_tf_update_chunked, 4, rms, id="rmsprop-chunked"),
        pytest.param(chunked.momentum_update_chunked, 3, mom, id="momentum-chunked"),
        pytest.param(_device_skip(chunked.rmsprop_tf_update_chunked), 4, rms, id="rmsprop-chunked-device"),
        pytest.param(_device_skip(chunked.momentum_update_chunked), 3, mom, id="momentum-chunked-device"),
        pytest.param(rmsprop_tf.rmsprop_tf_update, 4, rms, id="rmsprop-triton", marks=needs_triton),
        pytest.param(momentum_kernel.momentum_update, 3, mom, id="momentum-triton", marks=needs_triton),
    ]


@pytest.mark.parametrize("update, n_state, kwargs", _kernel_calls())
@pytest.mark.parametrize("flag", [1.0, float("inf"), float("nan")])
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NumPy (interpreter) on inf - inf
def test_found_inf_leaves_every_buffer_bit_identical(update, n_state, kwargs, flag):
    gen = torch.Generator().manual_seed(2)
    # Non-finite gradients, as a real overflow step would have them.
    g = torch.randn(1000, generator=gen)
    g[::7] = float("inf")
    g[1] = float("nan")
    buffers = [torch.rand(1000, generator=gen) + 0.5 for _ in range(n_state)]
    for b in buffers:  # values a multiply-by-0/1 skip would not keep: -0 + 0 is +0, 0 * inf is NaN
        b[:3] = torch.tensor([-0.0, float("inf"), float("nan")])
    before = [b.clone() for b in buffers]
    update(buffers[0], g, *buffers[1:], found_inf=torch.tensor(flag), **kwargs)
    for b, old in zip(buffers, before):
        assert torch.equal(b.view(torch.int32), old.view(torch.int32))
    # The same call with found_inf == 0 does update (so the skip above was not vacuous).
    update(buffers[0], g.nan_to_num(posinf=1.0), *buffers[1:], found_inf=torch.tensor(0.0), **kwargs)
    assert all(not torch.equal(b[3:], old[3:]) for b, old in zip(buffers, before))


# --- launcher checks


def test_launcher_rejects_mismatched_buffers():
    w, g, ms, mom = (torch.zeros(10) for _ in range(4))
    kwargs = dict(lr=0.1, decay=0.9, momentum=0.9, eps=1.0)
    with pytest.raises(ValueError, match="'ms' must be 1-D contiguous with 10 elements"):
        rmsprop_tf.rmsprop_tf_update_reference(w, g, torch.zeros(11), mom, None, **kwargs)
    with pytest.raises(ValueError, match="'mom' is torch.float16"):
        rmsprop_tf.rmsprop_tf_update_reference(w, g, ms, mom.half(), None, **kwargs)
    with pytest.raises(ValueError, match="'w' must be 1-D contiguous"):
        rmsprop_tf.rmsprop_tf_update_reference(torch.zeros(20)[::2], g, ms, mom, None, **kwargs)
    with pytest.raises(ValueError, match="ema_weight"):
        rmsprop_tf.rmsprop_tf_update_reference(w, g, ms, mom, torch.zeros(10), **kwargs)


@needs_triton
def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    w, g, acc = (torch.zeros(10) for _ in range(3))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        momentum_kernel.momentum_update(w, g, acc, None, lr=0.1, momentum=0.9)


# --- programs resident per SM (kernels/common.resident_programs)

H100 = SimpleNamespace(  # torch.cuda.get_device_properties on an H100/H200 (sm_90)
    regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048,
    shared_memory_per_multiprocessor=233472,
)
A100 = SimpleNamespace(
    regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048,
    shared_memory_per_multiprocessor=167936,
)


@pytest.mark.parametrize(
    "regs, warps, shared, props, expected",
    [
        # What NVIDIA's CUDA Occupancy Calculator gives for compute capability 9.0 / 8.0.
        (40, 8, 1024, H100, 6),  # registers: 1280 a warp, 51 warps of 64K -> 6 blocks of 8
        (43, 8, 1024, H100, 5),  # 1376 rounds up to 1536 a warp
        (63, 8, 1024, H100, 4),
        (70, 8, 0, H100, 3),
        (255, 8, 0, H100, 1),
        (32, 8, 0, H100, 8),  # threads: 2048 / 256
        (32, 4, 0, H100, 16),
        (16, 2, 0, H100, 32),  # blocks: at most 32 an SM
        (32, 8, 100 * 1024, H100, 2),  # shared memory: 228 KiB / (100 KiB + 1 KiB reserved)
        (32, 8, 100 * 1024, A100, 1),  # 164 KiB
    ],
)
def test_resident_programs_follows_cuda_occupancy_rules(regs, warps, shared, props, expected):
    assert resident_programs(regs, warps, shared, props) == expected


# --- compiled mode, without a GPU

# ptxas or Triton's backend refusing a target (a Triton built against a CUDA without that arch).
_UNSUPPORTED_ARCH = re.compile(r"(sm_\d+|arch|target).{0,80}(not (defined|supported)|unsupported)", re.I)

_COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import fasttrain
from fasttrain.kernels import momentum, rmsprop_tf

kernel, arch = sys.argv[1], int(sys.argv[2])
scalars = {"lr_ptr": "*fp32", "lr_value": "fp32", "scale_ptr": "*fp32", "scale_value": "fp32",
           "found_inf_ptr": "*fp32", "ema_weight_ptr": "*fp32", "numel": "i32",
           "momentum": "fp32", "weight_decay": "fp32", "decay": "fp32", "eps": "fp32"}
if kernel == "rmsprop_tf":
    lazy, streams = rmsprop_tf._rmsprop_tf_kernel, ["w_ptr", "ms_ptr", "mom_ptr", "ema_ptr"]
    extra = {"IEEE_PTX": True}  # what rmsprop_tf_update passes on an NVIDIA GPU
else:
    lazy, streams = momentum._momentum_kernel, ["w_ptr", "acc_ptr", "ema_ptr"]
    extra = {"NESTEROV": True}
fn = triton.jit(lazy.fn)
names = fn.arg_names
signature = {**scalars, "g_ptr": "*bf16", **{s: "*fp32" for s in streams}}
results = []
for launch in ("bulk", "tail"):
    for has_ema in (True, False):
        flags = dict(LR_FROM_PTR=True, SCALE_FROM_PTR=True, CHECK_INF=True, HAS_EMA=has_ema,
                     BLOCK_SIZE=1024, **extra)
        # What the launcher's runtime specialization sees (kernels/common.launches): 16-byte
        # aligned pointers in both launches (the tail starts at a multiple of 16 elements), a length
        # divisible by 16 only in the bulk.
        aligned = ["g_ptr", *streams, *(["numel"] if launch == "bulk" else [])]
        source = ASTSource(
            fn=fn,
            signature={n: signature.get(n, "constexpr") for n in names},
            constexprs={(names.index(k),): v for k, v in flags.items()},
            attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned},
        )
        options = {"enable_fp_fusion": False, "num_warps": 4}
        ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]
        results.append({
            "launch": launch, "ema": has_ema,
            "streams": len(streams) - (0 if has_ema else 1),
            "ld_v4": ptx.count("ld.global.v4"), "st_v4": ptx.count("st.global.v4"),
            # Round-to-nearest, no flush-to-zero anywhere (Triton <= 3.5 wrote sqrt.rn.ftz.f32).
            "ieee_sqrt_div": "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx,
            "ftz": ".ftz" in ptx,
            "target": f".target sm_{arch}" in ptx,
        })
print(json.dumps(results))
"""

# The GPUs the precision policy covers with Triton (DESIGN.md): V100, A100, H100/H200.
ARCHS = [70, 80, 90]


@needs_triton
@pytest.mark.parametrize("kernel", ["rmsprop_tf", "momentum"])
@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile_for_gpu_with_vector_access_and_exact_math(kernel, arch):
    # The interpreter accepts code the compiler rejects, so compile for each target (ptxas ships in
    # the Triton wheel: no GPU needed), the bulk and the tail launch, with and without EMA. In a
    # subprocess: Triton fixes interpret-vs-compile for its own library when first imported, and
    # the CPU test session imports it under TRITON_INTERPRET=1.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, kernel, str(arch)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.returncode != 0 and "ASTSource" in run.stderr and "TypeError" in run.stderr:
        pytest.skip(f"triton.compiler.ASTSource, a private API, differs in this Triton: {run.stderr[-300:]}")
    if run.returncode != 0 and _UNSUPPORTED_ARCH.search(run.stderr):
        pytest.skip(f"this Triton cannot target sm_{arch}: {run.stderr.strip().splitlines()[-1][-300:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == 4
    for result in results:
        assert result["target"], result
        assert not result["ftz"], result  # no flush-to-zero: subnormals survive as in torch
        if kernel == "rmsprop_tf":
            assert result["ieee_sqrt_div"], result  # round-to-nearest sqrt and division
        if result["launch"] == "bulk":
            # 1024 elements / 128 threads = 8 fp32 per thread: two 16-byte accesses per fp32 stream.
            fp32_streams = result["streams"]
            assert result["ld_v4"] >= 2 * fp32_streams and result["st_v4"] >= 2 * fp32_streams, result
