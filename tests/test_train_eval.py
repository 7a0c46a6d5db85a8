"""train() with --eval_every_epochs: evaluations between steps, raw and EMA, reported everywhere, and a run
with them trains bit for bit like one without (CPU, --deterministic)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from fasttrain import eval_pass
from fasttrain.config import make_config
from fasttrain.data.synthetic import make_synthetic
from fasttrain.monitor import run_summary
from fasttrain.train import train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)  # 12 steps/epoch
    return root


def _run(data, run_dir, **overrides):
    values = dict(model="resnet18", base_channels=8, image_size=32, batch_size=4, num_classes=4)
    values.update(data_backend="torch", data_dir=str(data), device="cpu", num_workers=0, deterministic=True)
    values.update(max_steps=14, log_every=1, checkpoint_every=7, eval_at_end=False, ema_decay=0.9)
    values.update(max_eval_batches=2, optimizer="rmsprop", optimizer_impl="torch", train_dir=str(run_dir))
    return train(make_config(**{**values, **overrides}))


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_evaluations_leave_training_bit_identical(data, tmp_path, capsys):
    # 14 steps cross the epoch boundary at 12; evaluations at steps 3, 6, 9, 12 (a quarter epoch),
    # the checkpoint at 7 in between. Both runs get a log line every step, so only evaluations differ.
    plain, evaluated = tmp_path / "plain", tmp_path / "evaluated"
    _run(data, plain)
    _run(data, evaluated, eval_every_epochs=0.25)
    evals = [r for r in _records(evaluated) if r.get("split") == "validation"]
    assert [r["step"] for r in evals] == [3, 6, 9, 12]
    for r in evals:
        assert {"top1", "top5", "ema_top1", "ema_top5"} <= r.keys() and r["count"] == 8
    assert "step 3: validation top-1 " in capsys.readouterr().out
    losses = lambda d: [(r["step"], r["loss"], r["train_top1"]) for r in _records(d) if "loss" in r]
    assert losses(evaluated) == losses(plain)
    for step in (7, 14):
        ours = torch.load(evaluated / f"ckpt-{step}.pt", weights_only=True)
        theirs = torch.load(plain / f"ckpt-{step}.pt", weights_only=True)
        for key in ("model", "optimizer", "ema", "bn_ema", "train_step", "data", "rng"):
            _same(ours[key], theirs[key], f"ckpt-{step} {key}")
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(evaluated))
    acc.Reload()
    for key in ("top1", "ema_top5"):
        got = [(e.step, e.value) for e in acc.Scalars(f"eval/{key}")]
        assert got == [(r["step"], pytest.approx(r[key])) for r in evals]


def test_no_second_evaluation_at_the_end(data, tmp_path):
    run_dir = tmp_path / "run"
    _run(data, run_dir, max_steps=6, eval_every_epochs=0.25, eval_at_end=True)
    assert [r["step"] for r in _records(run_dir) if r.get("split") == "validation"] == [3, 6]


# --- what a run prints at its end, and while it evaluates ----------------------------------------------

_SUMMARY = (
    r"done: step {step}, {steps} steps? this run \({images} images\) in [\d.]+ s, [\d.]+ images/s; "
    r"[\d.]+ s with set-up and evaluation; "
)


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_every_run_ends_with_a_one_line_summary(data, tmp_path, capsys):
    # Time, images/s and the final top-1, whether the run evaluates at the end, evaluated before, or not.
    _run(data, tmp_path / "a", max_steps=2, eval_at_end=True)
    line = _last_line(capsys)
    assert re.fullmatch(
        _SUMMARY.format(step=2, steps=2, images=8) + r"validation top-1 [\d.]+ \(EMA [\d.]+\), .*", line
    )
    assert "chance is 0.250" in line
    _run(data, tmp_path / "b", max_steps=4, eval_every_epochs=0.25)  # evaluated at step 3, not at the end
    line = _last_line(capsys)
    assert re.fullmatch(
        _SUMMARY.format(step=4, steps=4, images=16) + r"last evaluated at step 3: validation top-1 .*", line
    )
    _run(data, tmp_path / "c", max_steps=2)
    line = _last_line(capsys)
    assert re.fullmatch(
        _SUMMARY.format(step=2, steps=2, images=8) + r"not evaluated \(--eval_at_end=false\)", line
    )
    _run(data, tmp_path / "c", max_steps=3)  # resumed: the steps of this run
    assert re.fullmatch(_SUMMARY.format(step=3, steps=1, images=4) + r"not evaluated .*", _last_line(capsys))
    _run(data, tmp_path / "c", max_steps=3)  # finished, and no evaluation asked: it said "evaluating it"
    out = capsys.readouterr().out
    assert "finished run at step 3 (max_steps 3): nothing to do (--eval_at_end=false), not training" in out
    assert f"(e.g. --train_dir={tmp_path / 'c'}-2)" in out  # this stop's edit had left {run_dir} unfilled


def test_the_summarys_durations():
    assert (
        run_summary(0, 0, 0.0, 3.04)
        == "0 steps this run (0 images) in 0.0 s; 3.0 s with set-up and evaluation"
    )
    assert run_summary(10, 320, 125.0, 7300.0).endswith(
        "in 2 min 5 s, 2.6 images/s; 2 h 01 min with set-up and evaluation"
    )


def test_evaluation_shows_progress(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(eval_pass, "PROGRESS_EVERY_S", 0.0)  # a line a batch (every 10 s by default)
    _run(data, tmp_path / "run", max_steps=1, eval_at_end=True)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("evaluating")]
    assert [line.split(",")[0] for line in lines] == [
        "evaluating the raw weights: 1/2 batches (50%)",
        "evaluating the raw weights: 2/2 batches (100%)",
        "evaluating the EMA weights: 1/2 batches (50%)",
        "evaluating the EMA weights: 2/2 batches (100%)",
    ]
    assert all(re.search(r", [\d.]+ images/s, [\d.]+ s left$", line) for line in lines), lines


@pytest.fixture
def signal_mid_evaluation(monkeypatch):
    """The validation loader sends this process SIGTERM once its first batch is out (as a scheduler's
    preemption arriving mid-evaluation); the trainer's StopRequest handler takes it."""
    import os
    import signal

    import fasttrain.train

    real = fasttrain.train.build_loader

    class Signalling:
        def __init__(self, loader):
            self.loader = loader

        def __len__(self):
            return len(self.loader)

        def __iter__(self):
            for k, batch in enumerate(self.loader):
                yield batch
                if k == 0:
                    os.kill(os.getpid(), signal.SIGTERM)

    def build_loader(cfg, split, **kwargs):
        loader = real(cfg, split, **kwargs)
        return Signalling(loader) if split == "validation" else loader

    monkeypatch.setattr(fasttrain.train, "build_loader", build_loader)


def test_a_stop_signal_during_an_evaluation_stops_at_its_next_batch(
    data, tmp_path, capsys, signal_mid_evaluation
):
    # The evaluation ran to its end first (seconds to minutes on ImageNet: past docker stop's 10 s), and
    # during the final one the signal was taken and nothing done with it (exit 0, "done").
    result = _run(data, tmp_path / "mid", max_steps=8, eval_every_epochs=0.25, max_eval_batches=0)
    out = capsys.readouterr().out
    assert result == {"step": 3, "stopped": True}, out
    assert "step 3: evaluation cut short by SIGTERM" in out and "stopped by SIGTERM at step 3" in out
    assert (tmp_path / "mid" / "ckpt-3.pt").is_file()
    assert all(r.get("split") != "validation" for r in _records(tmp_path / "mid"))  # no partial result
    result = _run(data, tmp_path / "end", max_steps=2, eval_at_end=True, max_eval_batches=0)
    out = capsys.readouterr().out
    assert result == {"step": 2, "stopped": True}, out
    assert (
        "stopped by SIGTERM during the final evaluation; the run's last checkpoint" in out
        and "done:" not in out
    )


def test_a_resume_evaluates_the_step_whose_evaluation_a_stop_cut_short(
    data, tmp_path, capsys, monkeypatch, signal_mid_evaluation
):
    # The resumed run began after step 3 and evaluated only after the steps it made: step 3's
    # evaluation (that epoch's figure) never reached metrics.jsonl or TensorBoard, without a word.
    run_dir = tmp_path / "run"
    assert _run(data, run_dir, max_steps=4, eval_every_epochs=0.25, max_eval_batches=0)["stopped"]
    monkeypatch.undo()  # no more signals
    _run(data, run_dir, max_steps=4, eval_every_epochs=0.25, max_eval_batches=0)
    out = capsys.readouterr().out
    assert "step 3: its evaluation did not finish before the run stopped; evaluating it now" in out, out
    rows = [r for r in _records(run_dir) if r.get("split") == "validation"]
    _run(data, tmp_path / "whole", max_steps=4, eval_every_epochs=0.25, max_eval_batches=0)
    whole = [r for r in _records(tmp_path / "whole") if r.get("split") == "validation"]
    assert [r["step"] for r in rows] == [r["step"] for r in whole] == [3]
    for key in ("top1", "top5", "ema_top1", "ema_top5", "count"):  # what the whole run measured there
        assert rows[0][key] == whole[0][key], key
    _run(data, run_dir, max_steps=4, eval_every_epochs=0.25, max_eval_batches=0)  # finished: no second row
    assert [r["step"] for r in _records(run_dir) if r.get("split") == "validation"] == [3]


def test_a_finished_run_evaluated_again_keeps_one_row_per_step_and_its_config(data, tmp_path, capsys):
    # The same command again evaluates a finished run: it appended a second validation row at the
    # same step (and a second TensorBoard point), and --max_steps=1 rewrote its config.json.
    run_dir = tmp_path / "run"
    _run(data, run_dir, max_steps=2, eval_at_end=True)
    config = (run_dir / "config.json").read_text()
    _run(data, run_dir, max_steps=2, eval_at_end=True)
    _run(data, run_dir, max_steps=1, eval_at_end=True)
    assert "already holds a finished run at step 2" in capsys.readouterr().out
    rows = [r for r in _records(run_dir) if r.get("split") == "validation"]
    assert [r["step"] for r in rows] == [2]
    assert (run_dir / "config.json").read_text() == config


def _stop_on_rank_0_only(info, out):
    # Rank 0 is stopped at its second batch, rank 1 never: both must stop (an evaluation's stop is
    # agreed through the sums the ranks all-reduce), and neither may wait at a collective the other
    # has left (rank 1 would evaluate the EMA weights, all-reducing, while rank 0 had returned).
    from fasttrain.eval_pass import EvaluationInterrupted
    from fasttrain.models import create_model
    from fasttrain.precision import Precision

    torch.manual_seed(0)
    model = create_model("resnet18", 4, base_channels=8)
    batches = [(torch.zeros(2, 32, 32, 3, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64))] * 4
    asked = []

    def interrupted():
        asked.append(1)
        return info.rank == 0 and len(asked) >= 2

    fp32 = Precision("fp32", channels_last=False, cuda_graph=False)
    try:
        eval_pass.evaluate(
            model, batches, precision=fp32, device=torch.device("cpu"), preprocess="inception",
            world_size=2, interrupted=interrupted,
        )  # fmt: skip
    except EvaluationInterrupted:
        open(f"{out}.{info.rank}", "w").write(f"stopped after {len(asked)} checks")


def test_an_evaluations_stop_on_one_rank_stops_every_rank(tmp_path):
    from launch_helpers import spawn

    spawn(_stop_on_rank_0_only, 2, str(tmp_path / "rank"))
    assert (tmp_path / "rank.0").read_text() == "stopped after 2 checks"
    assert (tmp_path / "rank.1").read_text() == "stopped after 4 checks"  # its whole loop, then the agreement
