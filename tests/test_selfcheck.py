"""`python -m fasttrain selfcheck` in CPU mode: every row in the table and the JSON, GPU rows skipped
with their reason, the CPU rows passing, and a broken fast path reported as a failed row with its
reason and a non-zero exit code."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fasttrain import selfcheck
from fasttrain.__main__ import main as cli_main
from fasttrain.optim import FusedRMSPropTF
from fasttrain.selfcheck import checks as selfcheck_checks

ROOT = Path(__file__).resolve().parents[1]
GPU_ROWS = (
    "graph-replay",
    "compiled-graph",
    "padded-stem",
    "fp16-overflow",
    "no-host-sync",
    "dali-mixed",
    "throughput-graph",
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU mode")
def test_cpu_mode_runs_every_row_and_skips_the_gpu_rows_with_a_reason(tmp_path):
    out = tmp_path / "report" / "selfcheck.json"
    done = subprocess.run(
        [sys.executable, "-m", "fasttrain", "selfcheck", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == list(selfcheck_checks.CHECKS)
    assert report["passed"] is True
    for key in ("device", "driver", "cuda", "nccl", "torch", "triton", "dali"):
        assert report["environment"][key], key
    assert report["policy"] == {
        "precision": "fp32",
        "channels_last": False,
        "cuda_graph": False,
        "compile": False,
        "pad_stem": False,
        "optimizer": "chunked",
    }
    for name in GPU_ROWS:
        assert rows[name]["status"] == "skip" and "no CUDA device" in rows[name]["detail"], rows[name]
    for name in ("optimizer-chunked", "eager-step", "buckets-vs-ddp", "throughput-eager"):
        assert rows[name]["status"] == "pass", rows[name]
    for row in rows.values():
        assert row["status"] in selfcheck.STATUSES and row["detail"], row
        assert re.search(rf"^{row['name']} +{row['status']} ", done.stdout, re.M), row  # in the table
    assert "0 failed" in done.stdout


_CHUNKED = FusedRMSPropTF._updates["chunked"]


def _wrong_chunked(w, g, ms, mom, ema=None, **kwargs):
    # A slip of the kind the check exists for: the update lands, then one weight is off by 1e-3.
    _CHUNKED(w, g, ms, mom, ema, **kwargs)
    if not kwargs["found_inf"]:  # note: host read, fine on the CPU
        w[:1] += 1e-3


def test_a_broken_fast_path_is_a_failed_row_with_its_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(FusedRMSPropTF._updates, "chunked", _wrong_chunked)
    out = tmp_path / "selfcheck.json"
    code = cli_main(["selfcheck", "--checks", "optimizer-chunked,eager-step", "--out", str(out)])
    assert code == 1
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["optimizer-chunked"]["status"] == "fail"
    assert "rmsprop weights" in rows["optimizer-chunked"]["detail"]  # names the buffer that differs
    assert rows["eager-step"]["status"] == "pass"  # momentum: untouched
    printed = capsys.readouterr().out
    assert "1 passed, 1 failed, 0 skipped" in printed


def test_a_check_that_crashes_is_a_failed_row_naming_the_error(tmp_path, monkeypatch):
    def crash(ctx):
        raise RuntimeError("cuDNN error: CUDNN_STATUS_NOT_INITIALIZED")

    def skip(ctx):
        raise selfcheck.Skip("needs two GPUs")

    monkeypatch.setitem(selfcheck_checks.CHECKS, "eager-step", crash)
    monkeypatch.setitem(selfcheck_checks.CHECKS, "graph-replay", skip)
    out = tmp_path / "selfcheck.json"
    assert selfcheck.main(["--checks", "eager-step,graph-replay", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["passed"] is False
    crashed, skipped = report["rows"]
    assert crashed["status"] == "fail" and crashed["detail"].startswith(
        "RuntimeError: cuDNN error: CUDNN_STATUS_NOT_INITIALIZED (at test_selfcheck.py:"
    )
    assert skipped == {**skipped, "status": "skip", "detail": "needs two GPUs"}


def test_an_interrupted_selfcheck_keeps_the_rows_that_ran(tmp_path, monkeypatch, capsys):
    # Ctrl-C, or the GPU run's time limit (SIGINT before its kill): the rows that ran are in the table
    # and the JSON, the one running and the rest say so, and the exit code is 130, not a pass.
    def crash(ctx):
        raise RuntimeError("wrong result")

    def interrupted(ctx):
        raise KeyboardInterrupt

    monkeypatch.setitem(selfcheck_checks.CHECKS, "eager-step", crash)
    monkeypatch.setitem(selfcheck_checks.CHECKS, "graph-replay", interrupted)
    monkeypatch.setitem(selfcheck_checks.CHECKS, "compiled-graph", lambda ctx: "never reached")
    out = tmp_path / "selfcheck.json"
    checks = "eager-step,graph-replay,compiled-graph"
    assert selfcheck.main(["--checks", checks, "--out", str(out)]) == 130
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["interrupted"] == "graph-replay"
    rows = [(r["name"], r["status"], r["detail"].split(" (at")[0]) for r in report["rows"]]
    assert rows == [
        ("eager-step", "fail", "RuntimeError: wrong result"),
        ("graph-replay", "skip", "interrupted while it ran"),
        ("compiled-graph", "skip", "not run: interrupted"),
    ]
    captured = capsys.readouterr()
    assert "0 passed, 1 failed, 2 skipped" in captured.out
    assert "selfcheck: interrupted during graph-replay" in captured.err


def test_only_skips_is_not_a_failure(tmp_path, monkeypatch):
    def skip(ctx):
        raise selfcheck.Skip("needs a GPU")

    monkeypatch.setitem(selfcheck_checks.CHECKS, "graph-replay", skip)
    assert selfcheck.main(["--checks", "graph-replay", "--out", str(tmp_path / "s.json")]) == 0


def test_unknown_check_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        selfcheck.main(["--checks", "graph-replay,warp-drive"])
    assert exit_info.value.code == 2
    assert "unknown check(s) warp-drive" in capsys.readouterr().err


def test_an_out_that_cannot_be_written_is_refused_before_any_check(tmp_path, monkeypatch, capsys):
    # It ran every check, then said it could not write the report and exited 1 (a failed check's code).
    from fasttrain.selfcheck import checks

    ran = []
    monkeypatch.setattr(checks, "CHECKS", {**checks.CHECKS, "eager-step": lambda ctx: ran.append(1)})
    assert selfcheck.main(["--checks", "eager-step", "--out", "/proc/nope/x.json"]) == 2
    assert "cannot write /proc/nope/x.json" in capsys.readouterr().err and not ran
    assert selfcheck.main(["--checks", "eager-step", "--out", str(tmp_path)]) == 2  # a directory
