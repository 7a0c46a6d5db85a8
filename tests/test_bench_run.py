"""bench/run.py: the CPU smoke run end to end, and the report's arithmetic against hand-computed values.

The smoke run is executed once (`python bench/run.py --smoke --out TMP`, as CI runs it); the tests
then recompute every derived figure from the raw measurements in results.json (seconds per window,
the measured matmul rate and copy bandwidth) and check the Markdown shows them. No speed is asserted.
"""

import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import report  # noqa: E402  (bench/report.py)
import run as bench_run  # noqa: E402  (bench/run.py)

SMOKE_CONFIGS = [("resnet18", 4, 32), ("resnet18", 8, 64)]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a speed check
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def _rows(results, **match):
    return [r for r in results["rows"] if all(r["spec"][k] == v for k, v in match.items())]


def _key(spec):
    return (spec["model"], spec["batch"], spec["image_size"], spec["input"])


def test_files_and_environment(smoke):
    out, results = smoke
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "results.md").stat().st_size > 0 and (out / "run.log").stat().st_size > 0
    env = results["environment"]
    for key in ("date", "command", "torch", "triton", "dali", "cpu", "python", "device"):
        assert key in env, key
    assert "--smoke" in env["command"] and results["smoke"] is True and env["device"] == "cpu"


def test_every_smoke_row_is_there(smoke):
    _, results = smoke
    for model, batch, size in SMOKE_CONFIGS:
        rows = {
            r["spec"]["row"]: r
            for r in _rows(results, model=model, batch=batch, image_size=size, input="synthetic")
        }
        assert sorted(rows) == ["a", "b", "c", "d"]
        for name in "abc":
            assert rows[name]["status"] == "ok", rows[name].get("traceback")
            assert rows[name]["spec"]["base_channels"] == 16
            assert len(rows[name]["seconds"]) == 3 and rows[name]["steps_per_repeat"] == 1
        assert rows["a"]["setting"]["optimizer"].startswith("FusedMomentum")
        assert rows["b"]["setting"]["optimizer"] == "torch.optim.SGD(foreach=True)"
        assert rows["c"]["setting"] == dict(
            precision="fp32", channels_last=False, cuda_graph=False,
            optimizer="torch.optim.SGD(foreach=False)", cudnn_benchmark=False,
        )  # fmt: skip
        # (d) is not part of the smoke run: no number may stand in its place.
        assert rows["d"]["status"] == "not run" and "images_per_s" not in rows["d"]


def test_images_per_s_are_the_timed_windows(smoke):
    _, results = smoke
    for r in results["rows"]:
        if r["status"] != "ok":
            continue
        per_window = [r["steps_per_repeat"] * r["spec"]["batch"] / s for s in r["seconds"]]
        ips = r["images_per_s"]
        assert ips["median"] == pytest.approx(statistics.median(per_window), rel=1e-12)
        assert (ips["min"], ips["max"]) == pytest.approx((min(per_window), max(per_window)), rel=1e-12)


def test_ratios_and_mfu_come_from_measured_numbers(smoke):
    _, results = smoke
    matmul = results["rates"]["matmul"]["tflop_per_s"] * 1e12
    b_rows = {_key(r["spec"]): r for r in results["rows"] if r["spec"]["row"] == "b" and r["status"] == "ok"}
    checked = 0
    for r in results["rows"]:
        d = r["derived"]
        if r["status"] != "ok":
            assert d == {"ratio_to_b": None, "ratio_to_d": None, "ratio_to_e": None, "mfu": None}
            continue
        ips = r["images_per_s"]["median"]
        b = b_rows.get(_key(r["spec"]))
        if b is None:  # a DALI-fed (a) row: no (b) row reads through DALI
            assert d["ratio_to_b"] is None
        else:
            assert d["ratio_to_b"] == pytest.approx(ips / b["images_per_s"]["median"], rel=1e-12)
        assert d["ratio_to_d"] is None and d["ratio_to_e"] is None  # (d) and (e) did not run
        flops = results["flops"][f"resnet18/w16@{r['spec']['image_size']}"]
        assert flops["nominal"] is None and flops["used"] == flops["counted"] > 0
        assert d["mfu"] == pytest.approx(ips * flops["used"] / matmul, rel=1e-12)
        checked += 1
    assert checked >= 7  # 6 synthetic rows and at least the torch-fed (a) row


def test_optimizer_figures(smoke):
    from fasttrain.models import create_model

    _, results = smoke
    expected_params = sum(p.numel() for p in create_model("resnet18", 1000, base_channels=16).parameters())
    copy = results["rates"]["copy"]["gb_per_s"]
    timed = [r for r in results["rows"] if "optimizer" in r]
    assert sorted(r["spec"]["row"] for r in timed) == ["a", "b", "c"]  # first configuration only
    for r in timed:
        o = r["optimizer"]
        assert o["num_params"] == expected_params and o["bytes_per_param"] == 28  # momentum + EMA
        assert o["effective_gb_per_s"] == pytest.approx(
            28 * expected_params / (o["ms"] / 1e3) / 1e9, rel=1e-9
        )
        assert r["derived"]["optimizer_fraction_of_copy"] == pytest.approx(o["effective_gb_per_s"] / copy)


def test_pipeline_rows_and_headroom(smoke):
    _, results = smoke
    assert results["data"]["synthetic"] is True
    torch_pipe = [p for p in results["pipelines"] if p["spec"]["input"] == "torch"]
    assert len(torch_pipe) == 1 and torch_pipe[0]["status"] == "ok"
    (a,) = _rows(results, row="a", batch=8, input="synthetic")
    for p in results["pipelines"]:
        if p["status"] == "ok":
            expected = p["images_per_s"]["median"] / a["images_per_s"]["median"]
            assert p["derived"]["headroom"] == pytest.approx(expected, rel=1e-12)
    fed = _rows(results, row="a", input="torch") + _rows(results, row="b", input="torch")
    fed += _rows(results, row="a", input="dali")  # present where DALI imports (CI installs it)
    assert [r["status"] for r in fed] == ["ok"] * len(fed) and len(fed) >= 2, [r.get("error") for r in fed]


def test_markdown_shows_the_json(smoke):
    out, results = smoke
    md = (out / "results.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| resnet18 (width 16) |")]
    assert len(table) == len(results["rows"])
    for r in results["rows"]:
        s = r["spec"]
        (line,) = [
            x
            for x in table
            if x.startswith(
                f"| resnet18 (width 16) | {s['batch']} | {s['image_size']} | {s['input']} | ({s['row']}) |"
            )
        ]
        if r["status"] == "ok":
            assert f"| {report.fmt_rate(r['images_per_s']['median'])} |" in line
        else:
            assert r["status"] in line
    assert "## Context: published figures on other hardware (not measured here)" in md
    context = md.split("## Context")[1]
    assert context.count("(other hardware)") == len(report.CONTEXT)
    assert "| 78 |" in context and "| 204 |" in context  # the seeds' ResNet-101 on P40s


def test_derive_against_hand_computed_values():
    def row(name, ips, status="ok", input="synthetic"):
        spec = dict(row=name, model="resnet50", batch=256, image_size=224, base_channels=64, input=input)
        r = dict(spec=spec, status=status)
        if status == "ok":
            r["images_per_s"] = dict(median=ips)
        return r

    results = dict(
        rates=dict(matmul=dict(tflop_per_s=100.0), copy=dict(gb_per_s=1000.0)),
        flops={"resnet50@224": dict(used=24.5e9)},
        rows=[
            row("a", 3000.0),
            row("b", 2000.0),
            row("c", 500.0),
            row("d", 2400.0),
            row("d", 0, "failed"),
            row("e", 2500.0),
        ],  # fmt: skip
        pipelines=[
            dict(spec=row("a", 0)["spec"] | {"input": "dali"}, status="ok", images_per_s=dict(median=6000.0))
        ],
    )
    results["rows"][0]["optimizer"] = dict(effective_gb_per_s=400.0)
    report.derive(results)
    a, b, c, d, failed, e = (r["derived"] for r in results["rows"])
    assert a["ratio_to_b"] == pytest.approx(1.5) and a["ratio_to_d"] == pytest.approx(1.25)
    assert a["ratio_to_e"] == pytest.approx(1.2) and e["ratio_to_b"] == pytest.approx(1.25)
    assert c["ratio_to_b"] == pytest.approx(0.25) and b["ratio_to_b"] == pytest.approx(1.0)
    assert a["mfu"] == pytest.approx(3000 * 24.5e9 / 100e12)  # 0.735
    assert a["optimizer_fraction_of_copy"] == pytest.approx(0.4)
    assert failed == {"ratio_to_b": None, "ratio_to_d": None, "ratio_to_e": None, "mfu": None}
    assert results["pipelines"][0]["derived"]["headroom"] == pytest.approx(2.0)
    # The graph on/off table pairs (a) with (e) of the same configuration.
    (line,) = [x for x in report._graph_table(results) if x.startswith("| resnet50 |")]
    assert line == "| resnet50 | 256 | 224 | synthetic | 3,000 | 2,500 | 1.20x |"


def test_counted_flops_match_the_published_figures():
    from device_rates import NOMINAL_GFLOP, counted_training_flops

    # DESIGN.md's ~3x forward figures; the count covers convolutions and matmuls only.
    for model in ("resnet50", "inception_v3"):
        gflop, size = NOMINAL_GFLOP[model]
        assert counted_training_flops(model, size) / 1e9 == pytest.approx(gflop, rel=0.02)


def test_merge_keeps_measured_rows_a_later_run_did_not_measure():
    spec = dict(row="d", model="resnet50", batch=256, image_size=224, base_channels=64, input="synthetic")
    env = dict(gpu="NVIDIA H200")
    old = dict(environment=env, flops={}, checks={}, pipelines=[], rows=[dict(spec=spec, status="ok", v=1)])
    new_a = dict(spec | {"row": "a"})
    new = dict(
        environment=env, flops={}, checks={"kernels": {}}, pipelines=[],
        rows=[dict(spec=spec, status="not run"), dict(spec=new_a, status="ok", v=2)],
    )  # fmt: skip
    merged = bench_run.merge(old, new)
    rows = [(r["spec"]["row"], r["status"], r.get("v")) for r in merged["rows"]]
    assert rows == [("d", "ok", 1), ("a", "ok", 2)]
    assert "kernels" in merged["checks"] and merged["merged_runs"] == [env]
    with pytest.raises(bench_run.UsageError, match="another --out"):
        bench_run.merge(old, dict(new, environment=dict(gpu="NVIDIA A100")))


def test_time_limit_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    result = bench_run.run_limited([sys.executable, "-c", script], 3.0, tmp_path / "log.txt")
    assert result["timed_out"] and result["returncode"] != 0
    pid = int(pid_file.read_text())
    for _ in range(50):  # killed: gone, or a zombie where nothing reaps orphans (some containers)
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {pid} survived the time limit")


def test_a_compile_that_cannot_finish_in_the_budget_is_not_started(tmp_path):
    # It would only be killed at the budget and read as a compile timing out.
    argv = ["--smoke", "--parts", "compile", "--rows", "d", "--compile_timeout", "600", "--time_budget", "60"]
    assert bench_run.main([*argv, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rows and all(r["status"] == "skipped" for r in rows)
    assert all("--compile_timeout 600 s" in r["error"] and "time budget" in r["error"] for r in rows)
    assert not list(tmp_path.glob("compile-*.log"))  # no compile subprocess was started


def test_parts_deadlines_add_up_so_unused_time_passes_on(tmp_path):
    suite = bench_run.Suite(
        bench_run.parse_args(["--smoke", "--time_budget", "100", "--out", str(tmp_path)]), []
    )
    first = suite.deadline("gpu_tests")
    second = suite.deadline("rows")
    share = bench_run.PART_SHARE
    assert first == pytest.approx(suite.start + 100 * share["gpu_tests"])
    assert second == pytest.approx(suite.start + 100 * (share["gpu_tests"] + share["rows"]))
    suite.log_file.close()


def test_bad_flag_is_one_line(capsys):
    assert bench_run.main(["--models", "resnet9"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--models" in err and "resnet9" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_on_cuda_use_graph_policy_and_kernels():
    from fasttrain.kernels.common import HAVE_TRITON
    from throughput import MeasureOptions, RowSpec, measure_row

    from fasttrain.precision import default_precision

    device = torch.device("cuda")
    opts = MeasureOptions(warmup=2, repeats=2, steps=3, optimizer=True, optimizer_calls=3)
    rows = {row: measure_row(RowSpec(row, "resnet18", 8, 64, 16), device, opts) for row in "abce"}
    for r in rows.values():
        assert r["status"] == "ok", r.get("traceback")
        assert r["peak_memory_gib"] > 0 and len(r["seconds"]) == 2
    a, b = rows["a"]["setting"], rows["b"]["setting"]
    assert a["cuda_graph"] and a["precision"] == b["precision"] == default_precision(device)
    assert rows["e"]["setting"] == dict(a, cuda_graph=False)  # (e) is (a) without the graph
    tensor_cores = torch.cuda.get_device_capability() >= (7, 0)
    assert a["channels_last"] == b["channels_last"] == tensor_cores
    if HAVE_TRITON and tensor_cores:
        assert a["optimizer"] == "FusedMomentum (impl triton)"


def test_kernel_microbenchmarks_run_and_their_table_shows_the_json(tmp_path):
    # bench/bench_optim.py itself on the CPU (its smoke size, the torch contenders; the Triton one is
    # timed on CUDA only), then the report's table built from its pytest-benchmark JSON.
    bench_json = tmp_path / "bench_optim.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "bench/bench_optim.py", "-q", "-p", "no:cacheprovider",
         "-k", "resnet50", f"--benchmark-json={bench_json}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "FASTTRAIN_BENCH_SMOKE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = report.kernel_rows(json.loads(bench_json.read_text()))
    by = {(r["optimizer"], r["contender"]): r for r in rows}
    expected = {
        ("rmsprop", "fasttrain-reference"),
        ("rmsprop", "fasttrain-chunked"),
        ("rmsprop", "torch-foreach"),
    }
    assert expected | {("momentum", "fasttrain-reference"), ("momentum", "torch-fused")} <= set(by)
    for (kind, _), r in by.items():
        assert r["model"] == "resnet50" and r["width_divisor"] == 16
        bytes_per_param = {"rmsprop": 36, "momentum": 28}[kind]
        gb_per_s = bytes_per_param * r["num_params"] / (r["ms_per_update"] / 1e3) / 1e9
        assert r["effective_gb_per_s"] == pytest.approx(gb_per_s, rel=1e-9)
        assert r["fraction_of_copy"] == pytest.approx(gb_per_s / r["copy_gb_per_s"], rel=1e-9)
        base = by[(kind, "torch-foreach")]["ms_per_update"]
        assert r["speedup_vs_torch_foreach"] == pytest.approx(base / r["ms_per_update"], rel=1e-12)
    lines = report._kernel_table({"kernels": rows})
    r = by[("rmsprop", "fasttrain-reference")]
    (line,) = [
        x for x in lines if x.startswith("| rmsprop+EMA | resnet50 (width / 16) | fasttrain-reference |")
    ]
    assert f"| {r['ms_per_update']:.3f} |" in line and line.endswith(
        f"| {report._ratio(r['speedup_vs_torch_foreach'])} |"
    )


def test_report_merges_a_later_run_into_a_folder(tmp_path):
    env = dict(gpu="NVIDIA H200", date="2026-11-22T00:00:00+00:00", command="python bench/run.py")
    spec = dict(model="resnet50", batch=256, image_size=224, base_channels=64, input="synthetic")
    base = dict(
        environment=env, smoke=False, row_titles={}, checks={}, pipelines=[], kernels=[],
        rates=dict(matmul=dict(n=8192, tflop_per_s=700.0), copy=dict(bytes=1, gb_per_s=4000.0)),
        flops={"resnet50@224": dict(used=24.5e9)},
    )  # fmt: skip
    first = dict(
        base,
        rows=[
            dict(
                spec=dict(spec, row="b"),
                status="ok",
                images_per_s=dict(median=2000.0, min=1900.0, max=2100.0),
            )
        ],
    )
    second = dict(
        base,
        rows=[
            dict(
                spec=dict(spec, row="d"),
                status="ok",
                images_per_s=dict(median=2500.0, min=2400.0, max=2600.0),
            )
        ],
    )
    for name, res in (("first", first), ("second", second)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    assert report.main([str(tmp_path / "first"), str(tmp_path / "second")]) == 0
    merged = json.loads((tmp_path / "first" / "results.json").read_text())
    assert sorted(r["spec"]["row"] for r in merged["rows"]) == ["b", "d"]
    assert "| (d) | 2,500 |" in (tmp_path / "first" / "results.md").read_text()
    other = dict(second, environment=dict(env, gpu="NVIDIA A100"))
    (tmp_path / "second" / "results.json").write_text(json.dumps(other))
    assert report.main([str(tmp_path / "first"), str(tmp_path / "second")]) == 2  # another GPU's rows


def test_gpu_decode_row_logic_with_a_cpu_decoder(tmp_path):
    # nvjpeg_rate's measurement (decode_rate) with PIL standing in for nvJPEG, which needs CUDA and
    # torchvision; the crop + resize it times is checked on images whose output is known.
    import numpy as np
    from input_rows import crop_resize_batch, decode_rate, nvjpeg_rate, write_dataset
    from PIL import Image
    from throughput import RowSpec

    write_dataset(tmp_path, records=12, unique=4, width=96, height=72, shards=2)

    def pil_decode(jpegs):
        arrays = [np.asarray(Image.open(io.BytesIO(j.numpy().tobytes())).convert("RGB")) for j in jpegs]
        return [torch.from_numpy(a.copy()).permute(2, 0, 1) for a in arrays]

    spec = RowSpec("a", "resnet18", 4, 32, 16, input="nvjpeg")
    cpu = torch.device("cpu")
    r = decode_rate(spec, cpu, str(tmp_path), pil_decode, warmup=1, repeats=2, batches=2)
    assert r["status"] == "ok", r
    assert r["batch_dtype"] == "uint8" and r["batches_per_repeat"] == 2 and r["images_per_s"]["min"] > 0
    too_big = RowSpec("a", "resnet18", 64, 32, 16, input="nvjpeg")
    failed = decode_rate(too_big, cpu, str(tmp_path), pil_decode, warmup=1, repeats=1, batches=1)
    assert failed["status"] == "failed" and "fewer than a batch" in failed["error"]
    if not torch.cuda.is_available():
        assert nvjpeg_rate(spec, cpu, str(tmp_path), 1, 1, 1)["status"] == "failed"

    rng = np.random.default_rng(0)
    flat = [torch.full((3, 72, 96), 77, dtype=torch.uint8), torch.full((3, 50, 40), 200, dtype=torch.uint8)]
    batch = crop_resize_batch(flat, [np.zeros((0, 4)), np.array([[0.1, 0.1, 0.9, 0.9]])], rng, 32)
    assert batch.shape == (2, 32, 32, 3) and batch.dtype == torch.uint8
    assert (batch[0] == 77).all() and (batch[1] == 200).all()
    # A ramp across the columns stays a non-decreasing ramp across the output's columns, in range.
    ramp = torch.arange(96, dtype=torch.uint8).expand(3, 72, 96).contiguous()
    (out,) = crop_resize_batch([ramp], [np.zeros((0, 4))], rng, 16)
    assert (out[:, 1:, :].int() - out[:, :-1, :].int() >= 0).all() and int(out.max()) <= 95
    assert torch.equal(out[0], out[-1])  # rows are equal: nothing varies vertically


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nvjpeg_decode_row_on_cuda(tmp_path):
    pytest.importorskip("torchvision.io", reason="GPU decoding is measured through torchvision's nvJPEG")
    from input_rows import nvjpeg_rate, write_dataset
    from throughput import RowSpec

    write_dataset(tmp_path, records=32, unique=8, width=500, height=375, shards=2)
    r = nvjpeg_rate(
        RowSpec("a", "resnet50", 8, 224, input="nvjpeg"), torch.device("cuda"), str(tmp_path), 1, 2, 2
    )
    assert r["status"] == "ok", r
    assert r["batch_device"] == "cuda" and r["batch_dtype"] == "uint8" and r["images_per_s"]["min"] > 0
