"""bench/inductor_bw.py: its reading of inductor's bandwidth report, written here by inductor's own
end_graph (the producer the GPU run meets), its per-step totals, and its one pass over the BatchNorm
outputs against a hand count of ResNet-50 v1.5's layers."""

import pytest
import torch
from torch._inductor.runtime import triton_heuristics

from bench.inductor_bw import parse_report, summarize_calls, summary_lines
from bench.row_steps import RowSpec


def _write_report(path, graphs):
    """What two steps of a compiled model append: each graph call's kernels, by inductor's end_graph."""
    for calls in graphs:
        triton_heuristics.start_graph()
        # (ms, GB, GB/s, name) as DebugAutotuner.run collects them
        triton_heuristics.collected_calls.extend((ms, gb, gb / (ms / 1e3), name) for ms, gb, name in calls)
        triton_heuristics.end_graph(str(path))
    triton_heuristics.collected_calls.clear()


def test_the_report_inductor_writes_is_read_kernel_by_kernel_and_per_step(tmp_path):
    report = tmp_path / "report.txt"
    forward = [
        (0.5, 1.5, "triton_red_fused__native_batch_norm_legit_functional_0"),
        (0.25, 1.0, "triton_poi_fused_relu_1"),
    ]
    backward = [(1.0, 2.5, "triton_red_fused_native_batch_norm_backward_0")]
    # Two steps: forward then backward, twice (a kernel's time is cached after its first call).
    _write_report(report, [forward, backward, forward, backward])
    calls = parse_report(report.read_text())
    assert len(calls) == 6 and {c["graph"] for c in calls} == {"test_inductor_bw.py"}  # end_graph's caller
    result = summarize_calls(calls, steps=2, bn_pass_gb=0.5, copy_gb_per_s=4000.0)
    by_name = {k["name"]: k for k in result["kernels"]}
    bwd = by_name["triton_red_fused_native_batch_norm_backward_0"]
    assert bwd["calls_per_step"] == 1 and bwd["ms_per_step"] == pytest.approx(1.0)
    assert bwd["gb_per_s"] == pytest.approx(2500.0) and bwd["kind"] == "reduction"
    assert by_name["triton_poi_fused_relu_1"]["kind"] == "pointwise"
    assert result["kernels"][0]["name"] == bwd["name"]  # the longest first
    totals = result["totals"]
    # Per step: 1.75 ms, 5.0 GB; 5.0 GB / 1.75 ms = 2857 GB/s; at 4000 GB/s the bytes take 1.25 ms;
    # 5.0 GB over one 0.5 GB pass is 10 passes.
    assert totals["ms_per_step"] == pytest.approx(1.75) and totals["gb_per_step"] == pytest.approx(5.0)
    assert totals["gb_per_s"] == pytest.approx(5.0 / 1.75e-3)
    assert totals["of_copy"] == pytest.approx(5.0 / 1.75e-3 / 4000.0)
    assert totals["ms_at_copy"] == pytest.approx(1.25) and totals["passes"] == pytest.approx(10.0)
    assert result["by_kind"]["reduction"]["gb_per_step"] == pytest.approx(4.0)
    text = "\n".join(summary_lines(result | dict(copy_gb_per_s=4000.0, bn_pass_gb=0.5)))
    assert "10.0 passes over the BatchNorm outputs" in text and "| reduction | 1.50 | 4.00 |" in text


def test_lines_it_does_not_know_are_skipped():
    text = "====================\nSUMMARY (x.py)\n1.00ms   \t 2.00 GB\t 2000.00GB/s\nnot a kernel line\n"
    assert parse_report(text) == []


def _resnet50_bn_elements_per_image() -> int:
    # ResNet-50 v1.5 at 224 px, counted by hand from the architecture: the stem's BN at 112 x 112, then
    # per stage (blocks, width, out channels, input side, output side); v1.5 strides the 3x3, so a
    # stage's first bn1 is at the input side; the first block's downsample BN is at the output side.
    total = 64 * 112 * 112
    for blocks, width, out, side_in, side in ((3, 64, 256, 56, 56), (4, 128, 512, 56, 28),
                                              (6, 256, 1024, 28, 14), (3, 512, 2048, 14, 7)):  # fmt: skip
        total += width * side_in**2 + width * side**2 + 2 * out * side**2  # first block
        total += (blocks - 1) * (2 * width + out) * side**2
    return total


def test_one_pass_over_the_batch_norm_outputs_is_resnet50s_hand_count():
    from bench.inductor_bw import bn_pass_gb

    spec = RowSpec("d", "resnet50", batch=256, image_size=224)
    expected = _resnet50_bn_elements_per_image() * 256 * 2 / 1e9  # bf16
    assert bn_pass_gb(spec, torch.device("cpu"), element_bytes=2) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(5.69, abs=0.01)  # the module docstring's figure
