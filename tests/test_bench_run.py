"""bench.run and bench.report: the CPU smoke run end to end, and the report's arithmetic.

The smoke run is executed once (`python -m bench.run --smoke --out TMP`, as CI runs it); the tests
recompute every derived figure from the raw measurements in results.json (seconds per window, the
measured matmul rate and copy bandwidth) and from hand-computed values. No speed is asserted.
"""

import io
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bench import report
from bench.common import run_limited
from bench.input_rows import crop_resize_batch, decode_rate, write_dataset
from bench.mfu import NOMINAL_GFLOP, counted_training_flops
from bench.row_steps import RowSpec
from bench.run import main
from bench.throughput import MeasureOptions, measure_row
from fasttrain.models import create_model

ROOT = Path(__file__).resolve().parents[1]
SMOKE_CONFIGS = [(4, 32), (8, 64)]  # (batch, px) of resnet18 at width 16


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a speed check
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def _rows(results, **match):
    return [r for r in results["rows"] if all(r["spec"][k] == v for k, v in match.items())]


def test_smoke_run_measures_every_row_and_writes_the_report(smoke):
    out, results = smoke
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    env = results["environment"]
    assert env["command"].startswith("python -m bench.run --smoke") and env["device"] == "cpu"
    for batch, size in SMOKE_CONFIGS:
        rows = {r["spec"]["row"]: r for r in _rows(results, batch=batch, image_size=size, input="synthetic")}
        assert sorted(rows) == ["a", "b", "c", "d"]
        for name in "abc":
            assert rows[name]["status"] == "ok", rows[name].get("traceback")
            assert len(rows[name]["seconds"]) == 3 and rows[name]["steps_per_repeat"] == 1
        assert rows["a"]["setting"]["optimizer"].startswith("FusedMomentum")
        assert rows["c"]["setting"] == dict(
            precision="fp32", channels_last=False, cuda_graph=False,
            optimizer="torch.optim.SGD(foreach=False)", cudnn_benchmark=False,
        )  # fmt: skip
        # (d) is not part of the smoke run: no number may stand in its place.
        assert rows["d"]["status"] == "not run" and "images_per_s" not in rows["d"]
    fed = _rows(results, row="a", input="torch") + _rows(results, row="b", input="torch")
    fed += _rows(results, row="a", input="dali")  # present where DALI imports (CI installs it)
    assert [r["status"] for r in fed] == ["ok"] * len(fed) and len(fed) >= 2, [r.get("error") for r in fed]
    # The Markdown table has one line per row, showing the JSON's median.
    md = (out / "results.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| resnet18 (width 16) |")]
    assert len(table) == len(results["rows"])
    for r in results["rows"]:
        if r["status"] == "ok":
            s = r["spec"]
            head = f"| resnet18 (width 16) | {s['batch']} | {s['image_size']} | {s['input']} | ({s['row']}) |"
            (line,) = [x for x in table if x.startswith(head)]
            assert f"| {report.fmt_rate(r['images_per_s']['median'])} |" in line


def test_smoke_figures_come_from_the_measured_numbers(smoke):
    _, results = smoke
    matmul = results["rates"]["matmul"]["tflop_per_s"] * 1e12
    copy = results["rates"]["copy"]["gb_per_s"]
    key = lambda s: (s["model"], s["batch"], s["image_size"], s["input"])  # noqa: E731
    b_rows = {key(r["spec"]): r for r in _rows(results, row="b") if r["status"] == "ok"}
    params = sum(p.numel() for p in create_model("resnet18", 1000, base_channels=16).parameters())
    for r in [r for r in results["rows"] if r["status"] == "ok"]:
        per_window = [r["steps_per_repeat"] * r["spec"]["batch"] / s for s in r["seconds"]]
        ips = r["images_per_s"]
        assert ips["median"] == pytest.approx(statistics.median(per_window), rel=1e-12)
        assert (ips["min"], ips["max"]) == pytest.approx((min(per_window), max(per_window)), rel=1e-12)
        d, b = r["derived"], b_rows.get(key(r["spec"]))  # no (b) row reads through DALI
        expected = None if b is None else pytest.approx(ips["median"] / b["images_per_s"]["median"])
        assert d["ratio_to_b"] == expected and d["ratio_to_d"] is None and d["ratio_to_e"] is None
        flops = results["flops"][f"resnet18/w16@{r['spec']['image_size']}"]
        assert flops["nominal"] is None and flops["used"] == flops["counted"] > 0
        assert d["mfu"] == pytest.approx(ips["median"] * flops["used"] / matmul, rel=1e-12)
        if "optimizer" in r:  # the first configuration's rows only; momentum + EMA moves 28 B/param
            o = r["optimizer"]
            assert o["num_params"] == params and o["bytes_per_param"] == 28
            assert o["effective_gb_per_s"] == pytest.approx(28 * params / (o["ms"] / 1e3) / 1e9)
            assert d["optimizer_fraction_of_copy"] == pytest.approx(o["effective_gb_per_s"] / copy)
    (a,) = _rows(results, row="a", batch=8, input="synthetic")
    assert any(p["status"] == "ok" for p in results["pipelines"])
    for p in [p for p in results["pipelines"] if p["status"] == "ok"]:
        expected = p["images_per_s"]["median"] / a["images_per_s"]["median"]
        assert p["derived"]["headroom"] == pytest.approx(expected, rel=1e-12)


def test_derive_and_kernel_rows_against_hand_computed_values():
    def row(name, ips, status="ok"):
        spec = dict(
            row=name, model="resnet50", batch=256, image_size=224, base_channels=64, input="synthetic"
        )
        return dict(spec=spec, status=status, images_per_s=dict(median=ips))

    results = dict(
        rates=dict(matmul=dict(tflop_per_s=100.0), copy=dict(gb_per_s=1000.0)),
        flops={"resnet50@224": dict(used=24.5e9)},
        rows=[row("a", 3000.0), row("b", 2000.0), row("c", 500.0), row("d", 2400.0), row("d", 0, "failed"),
              row("e", 2500.0)],
        pipelines=[dict(spec=row("a", 0)["spec"] | {"input": "dali"}, status="ok",
                        images_per_s=dict(median=6000.0))],
    )  # fmt: skip
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
    (line,) = [x for x in report._graph_table(results) if x.startswith("| resnet50 |")]
    assert line == "| resnet50 | 256 | 224 | synthetic | 3,000 | 2,500 | 1.20x |"

    # bench_optim.py's pytest-benchmark JSON: the speed-up is over torch-foreach of the same pair.
    def bench(contender, ms, model="resnet50"):
        info = dict(optimizer="rmsprop", contender=contender, model=model, num_params=10, width_divisor=1)
        info.update(ms_per_update=ms, effective_gb_per_s=1.0, copy_gb_per_s=2.0, fraction_of_copy=0.5)
        return dict(extra_info=info)

    benchmarks = [
        bench("torch-foreach", 8.0),
        bench("fasttrain-chunked", 2.0),
        bench("fasttrain-chunked", 4.0, "x"),
    ]
    rows = report.kernel_rows(dict(benchmarks=benchmarks + [dict(extra_info={})]))  # a skipped test: {}
    assert [r["speedup_vs_torch_foreach"] for r in rows] == [1.0, 4.0, None]


def test_merge_keeps_what_a_later_run_did_not_measure(tmp_path):
    env = dict(gpu="NVIDIA H200", date="2026-11-22T00:00:00+00:00", command="python -m bench.run")
    spec = dict(model="resnet50", batch=256, image_size=224, base_channels=64, input="synthetic")
    base = dict(
        environment=env, smoke=False, row_titles={}, checks={}, pipelines=[], kernels=[],
        rates=dict(matmul=dict(n=8192, tflop_per_s=700.0), copy=dict(bytes=1, gb_per_s=4000.0)),
        flops={"resnet50@224": dict(used=24.5e9)},
    )  # fmt: skip
    ok = lambda row, ips: dict(  # noqa: E731
        spec=dict(spec, row=row), status="ok", images_per_s=dict(median=ips, min=ips, max=ips)
    )
    first = dict(base, rows=[ok("b", 2000.0), ok("d", 2400.0)])
    second = dict(base, rows=[ok("b", 2100.0), dict(spec=dict(spec, row="d"), status="not run")])
    for name, res in (("first", first), ("second", second)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    assert report.main([str(tmp_path / "first"), str(tmp_path / "second")]) == 0
    merged = json.loads((tmp_path / "first" / "results.json").read_text())
    # (b) replaced by the later run's; (d), "not run" there, keeps the earlier measurement.
    assert [(r["spec"]["row"], r["images_per_s"]["median"]) for r in merged["rows"]] == [
        ("d", 2400.0),
        ("b", 2100.0),
    ]
    assert merged["merged_runs"] == [env] and "| (d) | 2,400 |" in (tmp_path / "first/results.md").read_text()
    with pytest.raises(report.MergeError, match="another --out"):
        report.merge(first, dict(second, environment=dict(env, gpu="NVIDIA A100")))


def test_counted_flops_match_the_published_figures():
    # DESIGN.md's ~3x forward figures; the count covers convolutions and matmuls only.
    for model in ("resnet50", "inception_v3"):
        gflop, size = NOMINAL_GFLOP[model]
        assert counted_training_flops(model, size) / 1e9 == pytest.approx(gflop, rel=0.02)


def test_time_limit_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    result = run_limited([sys.executable, "-c", script], 3.0, tmp_path / "log.txt")
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


def test_at_its_time_limit_a_step_is_asked_to_stop_before_it_is_killed(tmp_path):
    # SIGINT first, in the limit's last second here (a tenth of it): what the step says on its way out
    # (pytest's failures so far, selfcheck's rows) reaches the log. A step that ignores SIGINT is
    # killed at the limit all the same.
    polite = (
        "import time\n"
        "try:\n"
        "    time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    print('the failures so far', flush=True)\n"
        "    time.sleep(60)\n"  # and then too slow: the kill at the limit ends it
    )
    deaf = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)\n"
    for name, script in (("polite", polite), ("deaf", deaf)):
        log = tmp_path / f"{name}.txt"
        result = run_limited([sys.executable, "-c", script], 5.0, log)
        assert result["timed_out"] and result["returncode"] == -signal.SIGKILL, name
        assert 5.0 <= result["seconds"] < 8.0, name
        assert ("the failures so far" in log.read_text()) == (name == "polite")


def test_a_compile_that_cannot_finish_in_the_budget_is_not_started(tmp_path):
    # It would only be killed at the budget and read as a compile timing out.
    argv = ["--smoke", "--parts", "compile", "--rows", "d", "--compile_timeout", "600", "--time_budget", "60"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rows and all(r["status"] == "skipped" and "--compile_timeout 600 s" in r["error"] for r in rows)
    assert not list(tmp_path.glob("compile-*.log"))  # no compile subprocess was started


def test_gpu_decode_measurement_and_crop_resize_with_a_cpu_decoder(tmp_path):
    # nvjpeg_rate's measurement (decode_rate) with PIL standing in for nvJPEG (CUDA and torchvision).
    write_dataset(tmp_path, records=12, unique=4, width=96, height=72, shards=2)

    def pil_decode(jpegs):
        arrays = [np.asarray(Image.open(io.BytesIO(j.numpy().tobytes())).convert("RGB")) for j in jpegs]
        return [torch.from_numpy(a.copy()).permute(2, 0, 1) for a in arrays]

    cpu = torch.device("cpu")
    spec = RowSpec("a", "resnet18", 4, 32, 16, input="nvjpeg")
    r = decode_rate(spec, cpu, str(tmp_path), pil_decode, warmup=1, repeats=2, batches=2)
    assert r["status"] == "ok" and r["batch_dtype"] == "uint8" and r["images_per_s"]["min"] > 0, r
    too_big = RowSpec("a", "resnet18", 64, 32, 16, input="nvjpeg")
    failed = decode_rate(too_big, cpu, str(tmp_path), pil_decode, warmup=1, repeats=1, batches=1)
    assert failed["status"] == "failed" and "fewer than a batch" in failed["error"]
    # Flat images stay flat; a ramp across the columns stays a non-decreasing ramp, rows equal.
    rng = np.random.default_rng(0)
    flat = [torch.full((3, 72, 96), 77, dtype=torch.uint8), torch.full((3, 50, 40), 200, dtype=torch.uint8)]
    batch = crop_resize_batch(flat, [np.zeros((0, 4)), np.array([[0.1, 0.1, 0.9, 0.9]])], rng, 32)
    assert batch.shape == (2, 32, 32, 3) and (batch[0] == 77).all() and (batch[1] == 200).all()
    ramp = torch.arange(96, dtype=torch.uint8).expand(3, 72, 96).contiguous()
    (out,) = crop_resize_batch([ramp], [np.zeros((0, 4))], rng, 16)
    assert (out[:, 1:, :].int() - out[:, :-1, :].int() >= 0).all() and int(out.max()) <= 95
    assert torch.equal(out[0], out[-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_on_cuda_use_the_graph_the_policy_and_the_kernels():
    from fasttrain.kernels.common import HAVE_TRITON

    from fasttrain.precision import default_precision

    device = torch.device("cuda")
    opts = MeasureOptions(warmup=2, repeats=2, steps=3, optimizer=True, optimizer_calls=3)
    rows = {row: measure_row(RowSpec(row, "resnet18", 8, 64, 16), device, opts) for row in "abce"}
    for r in rows.values():
        assert r["status"] == "ok", r.get("traceback")
    a, b = rows["a"]["setting"], rows["b"]["setting"]
    assert a["cuda_graph"] and a["precision"] == b["precision"] == default_precision(device)
    assert rows["e"]["setting"] == dict(a, cuda_graph=False)  # (e) is (a) without the graph
    if HAVE_TRITON and torch.cuda.get_device_capability() >= (7, 0):
        assert a["optimizer"] == "FusedMomentum (impl triton)"


def test_results_go_outside_the_checkout_unless_told(tmp_path, monkeypatch):
    from bench.common import ROOT
    from bench.run import default_out_dir

    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path / "cache"))
    out = default_out_dir({"date": "2026-11-25T01:00:00", "gpu": "NVIDIA H200"})
    assert out == tmp_path / "cache" / "bench" / "2026-11-25-nvidia-h200"
    assert ROOT not in out.parents
