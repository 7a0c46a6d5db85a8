"""MetricsLog.resume_at (fasttrain/monitor.py): a resume's rewrite of metrics.jsonl keeps each step
once, keeps a start-over's earlier rows beside, leaves the file whole when the rewrite fails, and keeps a
row another process appends meanwhile (moved from test_resume.py, which tests the trainer's resume)."""

import errno
import json
import os

from fasttrain.monitor import MetricsLog


def test_a_failed_rewrite_keeps_the_file_whole(tmp_path, monkeypatch):
    # The rewrite goes to a temporary file, fsynced, then renamed over metrics.jsonl: a crash (here, a
    # full disk at the fsync) before the rename leaves the old file as it was and no temporary.
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"time": 0.0, "step": s, "loss": 1.0}) + "\n" for s in range(1, 6))
    path.write_text(text)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    line = MetricsLog(path, enabled=True).resume_at(2)
    assert line == f"note: cannot rewrite {path} (No space left on device); rows past step 2 may repeat"
    assert path.read_text() == text and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    monkeypatch.undo()
    assert MetricsLog(path, enabled=True).resume_at(2).startswith("metrics.jsonl: dropped 3 line(s)")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert MetricsLog(path, enabled=True).resume_at(2) == ""  # nothing past 2: the file is not rewritten
    assert MetricsLog(path, enabled=False).resume_at(0) == ""  # other ranks write no metrics


def test_a_row_the_evaluator_appends_during_a_resumes_rewrite_is_kept(tmp_path, monkeypatch):
    # fasttrain.evaluate (another process) appends to the trainer's metrics.jsonl. A row it appended
    # after a resuming trainer had read the file and before it renamed the rewrite over it went with
    # the old file. Here the evaluator's append comes while the rewrite is being written.
    import threading
    import time

    import fasttrain.checkpoint

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"time": 0.0, "step": s, "loss": 1.0}) + "\n" for s in range(1, 6)))
    real_write_atomic = fasttrain.checkpoint.write_atomic
    evaluator = threading.Thread(
        target=lambda: MetricsLog(path, enabled=True).write(step=2, split="validation", source="evaluate")
    )

    def write_atomic_meanwhile(target, write):
        evaluator.start()
        time.sleep(0.5)  # the append, unless something holds it back, lands in the file being replaced
        real_write_atomic(target, write)

    monkeypatch.setattr(fasttrain.checkpoint, "write_atomic", write_atomic_meanwhile)
    assert MetricsLog(path, enabled=True).resume_at(2).startswith("metrics.jsonl: dropped 3 line(s)")
    evaluator.join(timeout=10)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r.get("source")) for r in rows] == [(1, None), (2, None), (2, "evaluate")]


def test_a_start_over_keeps_the_earlier_starts_rows_beside(tmp_path):
    # A directory whose run stopped before its first checkpoint, started again (perhaps with another
    # seed or learning rate): its rows were dropped, and with them all there was of that run.
    path = tmp_path / "metrics.jsonl"
    first = "".join(json.dumps({"time": 0.0, "step": s, "loss": 1.0}) + "\n" for s in range(1, 4))
    path.write_text(first)
    line = MetricsLog(path, enabled=True).resume_at(0)
    assert line == (
        "metrics.jsonl: this directory's earlier start saved no checkpoint; its 3 row(s) past step 0 are "
        "kept in metrics.jsonl.earlier-1, and this run logs from step 0"
    )
    assert path.read_text() == "" and (tmp_path / "metrics.jsonl.earlier-1").read_text() == first
    second = json.dumps({"time": 1.0, "step": 1, "loss": 2.0}) + "\n"
    path.write_text(second)
    assert "kept in metrics.jsonl.earlier-2" in MetricsLog(path, enabled=True).resume_at(0)
    assert (tmp_path / "metrics.jsonl.earlier-1").read_text() == first  # the first one untouched
    assert (tmp_path / "metrics.jsonl.earlier-2").read_text() == second
