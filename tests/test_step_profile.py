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
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "matmul"),  # cuBLAS: "other" before
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


def test_a_row_is_written_before_its_profile_starts(tmp_path, monkeypatch):
    # A profiler that hangs (CUPTI with CUDA graphs has, on older CUDA) must not take the timed row
    # with it: the row is in the results file before the profile begins.
    import json

    from bench import throughput

    result = tmp_path / "rows.jsonl"
    seen = []

    def hanging(run, steps, device):
        seen.append(result.read_text())  # what a kill at this moment would leave
        raise RuntimeError("profiler stuck")

    monkeypatch.setattr(throughput, "kernel_breakdown", hanging)
    spec = dict(row="a", model="resnet18", batch=2, image_size=32, base_channels=8, precision="fp32")
    opts = dict(warmup=1, repeats=3, steps=1, profile=1)
    code = throughput.main(["--spec", json.dumps(spec), "--opts", json.dumps(opts), "--result", str(result)])
    assert code == 0
    assert len(seen) == 1 and json.loads(seen[0])["status"] == "ok"
    rows = [json.loads(line) for line in result.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["images_per_s"]["median"] > 0
    profiles = [json.loads(line) for line in (tmp_path / "rows.profile.jsonl").read_text().splitlines()]
    assert len(profiles) == 1 and set(profiles[0]) == {"spec", "timed_ms_per_step", "profile_error"}
    assert profiles[0]["spec"] == rows[0]["spec"]
    assert (
        profiles[0]["profile_error"] == "RuntimeError: profiler stuck"
        and profiles[0]["timed_ms_per_step"] > 0
    )


def test_a_profile_that_never_ends_ends_the_process_with_its_row_kept(tmp_path):
    # The profiler stuck for good (sleeping here, in a process of its own): the watchdog ends the
    # process after --profile_limit, and the row written before the profile is there.
    import json
    import subprocess
    import sys
    import textwrap

    result = tmp_path / "rows.jsonl"
    spec = dict(row="a", model="resnet18", batch=2, image_size=32, base_channels=8, precision="fp32")
    opts = dict(warmup=1, repeats=3, steps=1, profile=1)
    code = textwrap.dedent(f"""
        import sys, time
        from bench import throughput
        throughput.kernel_breakdown = lambda run, steps, device: time.sleep(600)
        sys.exit(throughput.main(["--spec", {json.dumps(spec)!r}, "--opts", {json.dumps(opts)!r},
                                  "--result", {str(result)!r}, "--profile_limit", "2"]))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert run.returncode == 5, run.stderr[-2000:]
    assert "the profile ran past 2 s (its row is written)" in run.stderr
    rows = [json.loads(line) for line in result.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["status"] == "ok" and rows[0]["images_per_s"]["median"] > 0
