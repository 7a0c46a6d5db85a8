"""bench/step_profile.py: kernels grouped by name (names as CUDA profiles of a ResNet step print them),
and a profile of a real step on the CPU."""

import pytest
import torch

from bench.step_profile import breakdown_table, group_of, kernel_breakdown


@pytest.mark.parametrize(
    "name, group",
    [
        (
            "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64",
            "convolution",
        ),
        ("sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "convolution"),
        ("sm90_xmma_wgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "convolution"),
        (
            "void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true>",
            "convolution",
        ),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x128x64_warpgroupsize1x1x1", "matmul"),
        (
            "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>",
            "matmul",
        ),
        ("triton_red_fused__native_batch_norm_legit_functional_relu_0", "inductor (Triton)"),
        ("triton_poi_fused_add_relu_threshold_backward_3", "inductor (Triton)"),
        ("_rmsprop_tf_kernel", "optimizer (fasttrain Triton)"),
        ("_momentum_kernel", "optimizer (fasttrain Triton)"),
        ("void at::native::batch_norm_collect_statistics_channels_last_kernel<...>", "batch norm (ATen)"),
        ("Memcpy DtoD (Device -> Device)", "copy / fill"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "copy / fill"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float>>",
            "elementwise / reduction (ATen)",
        ),
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>",
            "elementwise / reduction (ATen)",
        ),
        ("void at::native::(anonymous namespace)::max_pool_backward_nhwc", "pooling"),
        ("something_else", "other"),
    ],
)
def test_kernels_are_grouped_by_name(name, group):
    assert group_of(name) == group


def test_a_cpu_step_is_profiled_and_tabled():
    conv = torch.nn.Conv2d(3, 8, 3)
    x = torch.randn(2, 3, 16, 16)
    run = lambda: conv(x).relu().sum().backward()
    run()
    breakdown = kernel_breakdown(run, steps=2, device=torch.device("cpu"))
    assert breakdown["steps"] == 2 and breakdown["ms_per_step"]["convolution"] > 0
    assert breakdown["total_ms_per_step"] == pytest.approx(sum(breakdown["ms_per_step"].values()))
    assert any(k["name"].startswith("aten::") and k["calls_per_step"] >= 1 for k in breakdown["top"])
    table = breakdown_table([("(f)", breakdown, 1.5), ("(d)", breakdown, None)])
    assert table[0] == "| group (ms per step) | (f) | (d) |"
    assert table[-1] == "| the timed step (its windows' median) | 1.50 | - |"
