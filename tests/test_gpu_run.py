"""The GPU run script (bench/gpu_run.sh, bench/gpu_run.py) dry-run on the CPU at tiny sizes, so that it is
known to work before a GPU is at hand: every step runs and writes its results, a module needing a
package the GPU machine lacks (DALI, tfrecord: hidden here) skips instead of stopping collection,
--resume continues a run, a missing CUDA stops it at once in one line, and an item the budget cannot
hold is recorded as not run."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_run(out: Path, *flags: str, timeout: float = 900) -> subprocess.CompletedProcess:
    # No wheels: those bench/gpu_prepare.sh fetches are CPython 3.12's, for the GPU machine.
    env = dict(os.environ, FASTTRAIN_GPU_WHEELS=str(out.parent / "no-wheels"))
    return subprocess.run(
        ["bash", "bench/gpu_run.sh", str(out), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


@pytest.mark.slow
def test_dry_run_runs_every_step_and_keeps_its_results(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    flags = [
        "--dry-run",
        "--hide",
        "nvidia.dali,tfrecord",
        "--work",
        str(work),
        "--configs",
        "resnet18-fp32-4",
    ]
    run = _gpu_run(out, *flags)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    steps = results["steps"]
    expected = [
        "preflight",
        "selfcheck",
        "gpu_tests",
        "shards",
        "row checkpoints",
        "loader kernels",
        "e2e compile",
        "compile resnet18-fp32-4 d",
    ]
    expected += ["rows resnet18-fp32-4", "d resnet18-fp32-4", "kernels", "e2e", "inductor_bw resnet18-fp32-4"]
    assert {name: steps.get(name, {}).get("status") for name in expected} == dict.fromkeys(expected, "ok")
    # The checks start once the loaders' numba kernels are compiled (each would compile them cold at once:
    # the second GPU run's selfcheck and GPU tests ran out of time so), and the shards come after them.
    kernels = steps["loader kernels"]
    assert kernels["last_line"].startswith("warm-up: the parts in "), kernels  # fasttrain.data.warm's
    kernels_done = kernels["started_s"] + kernels["seconds"]
    for name in ("selfcheck", "gpu_tests", "shards"):
        assert steps[name]["started_s"] >= kernels_done - 0.2, (name, steps[name], kernels)
    # The GPU tests were collected with DALI and tfrecord failing to import, and all skipped here.
    gpu_tests = (out / "gpu_tests.txt").read_text()
    assert " skipped" in gpu_tests and "error" not in gpu_tests.splitlines()[-1].lower()
    # One row per column, each measured (3 windows), the compiled one too.
    rows = {r["spec"]["row"]: r for r in results["rows"]}
    assert sorted(rows) == ["a", "b", "d", "e", "f", "g", "h"]
    assert all(r["status"] == "ok" and len(r["seconds"]) == 3 for r in rows.values()), rows
    assert rows["d"]["spec"]["compile_mode"] == "default" and "compile" in rows["d"]["setting"]
    assert (
        rows["f"]["setting"]["compile"] == "9 regions, mode default"  # ResNet-18: its stem, 8 blocks
        and rows["a"]["setting"]["compile"] == "no"
        and rows["f"]["setting"]["stem_channels"] == 3  # --pad_stem is off unless asked for
        and rows["g"]["setting"]["compile"] == "9 regions, mode default"  # (f) on 4 input channels
        and rows["g"]["setting"]["stem_channels"] == 4
        and rows["a"]["setting"]["bn_kernels"] == "torch"
        # (h): fasttrain's BatchNorm kernels (Triton's interpreter here), without --compile
        and (rows["h"]["setting"]["bn_kernels"], rows["h"]["setting"]["compile"]) == ("triton", "no")
    )
    assert rows["a"]["optimizer"]["ms"] > 0
    # Each timed row profiled after its windows (its CPU operators here, grouped by kind), the profile
    # recorded apart from the row, which was written before the profiler started.
    profiles = {p["spec"]["row"]: p for p in results["profiles"]}
    assert sorted(profiles) == sorted(rows) and all("profile" not in r for r in rows.values())
    assert all(p["profile"]["ms_per_step"].get("convolution", 0) > 0 for p in profiles.values()), profiles
    assert all(p["timed_ms_per_step"] > 0 for p in profiles.values())
    assert results["compile_warm"]["resnet18-fp32-4 d"]["compile_seconds"] > 0
    infos = [b["extra_info"] for b in results["bench_optim"]["benchmarks"]]
    kernels, stems = [k for k in infos if "model" in k], [k for k in infos if "c3_over_c4" in k]
    assert {k["model"] for k in kernels} == {"resnet50"} and all("interleaved" in k for k in kernels)
    assert len(stems) == 1 and stems[0]["ms"]["c3"] > 0 and stems[0]["ms"]["c4"] > 0
    assert "4-channel stem would save" in (out / "summary.md").read_text()
    # inductor's bandwidth profiler ran its plumbing (on the CPU inductor writes C++: no Triton kernel).
    bw = results["inductor_bw"]["resnet18-fp32-4"]
    assert bw["spec"]["row"] == "d" and bw["kernels"] == [] and "not Triton" in bw["note"]
    assert bw["bn_pass_gb"] > 0 and bw["copy_gb_per_s"] > 0
    e2e = results["e2e"]
    runs = ("synthetic", "jpeg", "jpeg-processes", "loader-threads", "loader-processes")
    runs += ("loader-threads-unfused", "loader-threads-2", "loader-processes-2")
    assert all(e2e[name]["images_per_s"] > 0 for name in runs)
    # Both loaders at the count where --loader auto changes (2 in the dry run), as they said it.
    assert (e2e["loader-threads-2"]["loader"], e2e["loader-threads-2"]["workers"]) == ("threads", 2)
    assert (e2e["loader-processes-2"]["loader"], e2e["loader-processes-2"]["workers"]) == ("processes", 2)
    # The threads' fused decode + resize (fasttrain/data/jpeg/fused.py) beside its baseline.
    assert e2e["loader-threads"]["fused"] is True and e2e["loader-threads-unfused"]["fused"] is False
    # The dry run drains 12 batches; the clock runs from the 3rd's arrival to the 12th's: 9 batches.
    assert e2e["loader-threads"]["cpu_ms_per_image"] > 0 and e2e["loader-threads"]["batches_timed"] == 9
    assert e2e["jpeg"]["cpu_ms_per_image"] > 0 and e2e["jpeg"]["over_synthetic"] > 0
    # The trainer's own input measures (fasttrain/input_stall.py), from each run's metrics.jsonl.
    assert all(0 <= e2e[name]["input_stall"] <= 1 for name in ("synthetic", "jpeg", "jpeg-processes"))
    assert 0 < e2e["jpeg"]["loader_busy"] <= 1 and "loader_busy" not in e2e["synthetic"]
    assert "loader thread" in e2e["loader-threads"]["threads_said"]
    assert results["selfcheck"]["rows"], "selfcheck's rows are in the results"
    summary = (out / "summary.md").read_text()
    for heading in (
        "## Step speed",
        "| resnet18-fp32-4 |",
        "## Fused optimizer + EMA",
        "| the timed step (its windows' median) |",
        "x synthetic)",
        "input stall",
        "- loader-processes-2 (2 processes): ",  # the threshold pair, reported after the other loaders alone
        "## inductor's kernels against the copy's bandwidth, resnet18-fp32-4 (d)",
        "**BatchNorm + add + ReLU forward + backward, (2, 16, 4, 4) float32**",  # bench/bench_bn.py
    ):
        assert heading in summary
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"driver.log", "gpu_tests.txt", "e2e/jpeg.log", "rows.jsonl"} <= names
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back

    # A later part on the same machine: nothing finished runs again, the results carry over.
    again = _gpu_run(out, *flags, "--resume")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "rows resnet18-fp32-4: start" not in again.stdout and "e2e: start" not in again.stdout
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["part"] == 2 and len(resumed["rows"]) == 7 and resumed["steps"]["e2e"]["status"] == "ok"


def test_without_cuda_it_stops_at_the_preflight_in_one_line(tmp_path):
    run = _gpu_run(tmp_path / "out", "--work", str(tmp_path / "work"), timeout=300)
    assert run.returncode == 3
    assert run.stderr.strip().splitlines() == [
        "gpu_run: preflight failed, nothing else ran: RuntimeError: "
        f"torch {__import__('torch').__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    ]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(results["steps"]) == ["preflight"] and results["steps"]["preflight"]["status"] == "failed"


def test_an_item_the_budget_cannot_hold_is_recorded_as_not_run(tmp_path):
    run = _gpu_run(
        tmp_path / "out", "--dry-run", "--work", str(tmp_path / "work"), "--steps", "rows,kernels",
        "--columns", "a", "--configs", "resnet18-fp32-4", "--budget", "20", timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    steps = json.loads((tmp_path / "out" / "results.json").read_text())["steps"]
    assert steps["rows resnet18-fp32-4"] == {"status": "not run", "reason": "time budget"}
    assert steps["kernels"] == {"status": "not run", "reason": "time budget"}


def test_bad_flag_is_one_usage_line():
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu_run", "--out", "/tmp/x", "--columns", "a,z"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 2 and "--columns: 'z' is not one of a, f, g, e, b, d, d-max, d-ro" in run.stderr


def test_rows_first_puts_every_step_speed_row_before_kernels_and_e2e(tmp_path):
    from bench.gpu_plan import parse_args
    from bench.gpu_run import Driver

    def kinds(*flags):
        args = parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *flags])
        return [kind for kind, _ in Driver(args).queue()]

    assert kinds() == [
        "rows",
        "rows",
        "kernels",
        "e2e",
        "rows",
        "rows",
        "rows",
        "rows",
        "rows",
        "inductor_bw",
    ]
    assert kinds("--rows_first") == ["rows"] * 7 + ["kernels", "e2e", "inductor_bw"]


def test_gpu_tests_k_reruns_only_the_tests_it_names(tmp_path):
    # A later GPU session reruns what failed (the third run: Inception v3's graph replay) without the
    # other 58 tests' three minutes.
    from bench.gpu_plan import parse_args
    from bench.gpu_run import Driver

    def pytest_command(*flags):
        args = parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *flags])
        driver = Driver(args)
        ran = []
        driver.run = lambda name, cmd, limit, log=None: ran.append(cmd) or {}
        driver.gpu_tests()
        return ran[0]

    assert "-k" not in pytest_command()
    cmd = pytest_command("--gpu_tests_k", "inception_v3")
    assert cmd[cmd.index("-k") + 1] == "inception_v3" and "-m" in cmd and "tests/test_step.py" in cmd


def test_the_report_names_g_by_what_its_rows_ran():
    # (g) was (f) with --no-pad_stem until --pad_stem became off by default; the third GPU run's rows
    # (committed, measured on an H200) have (g) on 3 channels, so its report must say --no-pad_stem.
    from bench.gpu_report import speed_table

    third = json.loads((ROOT / "bench/results/2026-11-28-h200-third-run/part2/results.json").read_text())
    assert "(g) (f) with --no-pad_stem" in speed_table(third)[0]
    for row in third["rows"]:
        if row["spec"]["row"] == "g":
            row["setting"]["stem_channels"] = 4  # as a run from now on measures it
    assert "(g) (f) with --pad_stem" in speed_table(third)[0]


def test_the_report_files_a_reduce_overhead_row_under_its_own_column():
    # (d-ro): torch.compile with its own CUDA graphs, the fair peer where launches bound the step; a
    # row of any mode but "default" was filed under (d-max) (no CUDA graphs).
    from bench.gpu_report import column_of, speed_table

    def row(column, mode, rate):
        spec = dict(row=column, model="resnet50", precision="bf16", batch=32, compile_mode=mode)
        ips = dict(median=rate, min=rate, max=rate)
        return dict(spec=spec, status="ok", images_per_s=ips, warmup_seconds=1.0)

    rows = [row("f", "default", 4000.0), row("d", "reduce-overhead", 3200.0), row("d", "default", 1000.0)]
    assert [column_of(r) for r in rows] == ["f", "d-ro", "d"]
    table = speed_table(dict(rows=rows, settings=[dict(key="resnet50-bf16-32")]))
    head = [c.strip() for c in table[0].strip("|").split("|")]
    line = [c.strip() for c in table[2].strip("|").split("|")]
    assert dict(zip(head, line))["f / d-ro"] == "1.25x" and dict(zip(head, line))["f / d"] == "4.00x"


def test_f_max_is_fasttrain_in_max_autotune_beside_d_max():
    # (f-max): the trainer's step with --compile_mode max-autotune-no-cudagraphs, a row "f" of that
    # mode; it was filed under (f), and its process ran torch.compile's row, "f-max" being no row.
    from bench.gpu_plan import Setting, row_args
    from bench.gpu_report import column_of, speed_table

    spec = json.loads(
        row_args(Setting("resnet50", "bf16", 256, 224), "f-max", Path("r"), ["f-max"], False)[3]
    )
    assert spec["row"] == "f" and spec["compile_mode"] == "max-autotune-no-cudagraphs"

    def row(column, mode, rate):
        spec = dict(row=column, model="resnet50", precision="bf16", batch=256, compile_mode=mode)
        ips = dict(median=rate, min=rate, max=rate)
        return dict(spec=spec, status="ok", images_per_s=ips, warmup_seconds=1.0)

    mode = "max-autotune-no-cudagraphs"
    rows = [row("f", "default", 6800.0), row("f", mode, 7700.0), row("d", mode, 7000.0)]
    assert [column_of(r) for r in rows] == ["f", "f-max", "d-max"]
    table = speed_table(dict(rows=rows, settings=[dict(key="resnet50-bf16-256")]))
    cells = dict(zip(*[[c.strip() for c in table[i].strip("|").split("|")] for i in (0, 2)]))
    assert cells["f-max / d-max"] == "1.10x" and cells["f / d-max"] == "0.97x"
    assert cells["(f) fasttrain, graph + --compile (the CLI on CUDA)"].startswith("6,800")


def test_a_hidden_package_is_missing_as_an_absent_one_is(tmp_path):
    # pytest >= 9.2's importorskip skips a test module on ModuleNotFoundError only: the hidden packages
    # must fail to import as a package the GPU machine lacks does, or 5 modules stop the collection.
    from bench.hidden_packages import hide

    folder = hide(tmp_path / "hidden", ["nvidia.dali", "tfrecord"])[0]
    for name in ("nvidia.dali", "tfrecord"):
        run = subprocess.run(
            [sys.executable, "-c", f"import {name}"],
            env=dict(os.environ, PYTHONPATH=folder),
            capture_output=True,
            text=True,
        )
        assert f"ModuleNotFoundError: {name} is hidden" in run.stderr, run.stderr[-500:]
