"""The trainer's own lifetimes and host syncs, on the CPU: what it releases, when, and on which exit
paths; where several ranks read their stop flag.

train() runs in this process (two spawned gloo ranks for the stop check). A captured CUDA graph cannot
exist without a GPU; a TrainStep that marks itself captured after its first step stands for one, and
records when the trainer releases it. The training top-1 of a log line is the mean of its steps', in the
log line, metrics.jsonl and TensorBoard. Through the CLI: a loss that is no longer finite stops the run
in one line naming the checkpoint a rerun resumes from, whose weights are all finite.
"""

from __future__ import annotations

import json
import os
import subprocess
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from launch_helpers import ENV, command, free_port, loopback_env

import fasttrain.eval_pass
import fasttrain.run
import fasttrain.train
from fasttrain.config import make_config
from fasttrain.data.synthetic import make_synthetic
from fasttrain.nonfinite import TrainingStopped
from fasttrain.step import TrainStep
from fasttrain.train import train


def _cfg(tmp_path, **overrides):
    """A ResNet-18 8 channels wide at 32 px, batch 4: a few hundredths of a second a step."""
    values = dict(model="resnet18", base_channels=8, image_size=32, batch_size=4, num_classes=4)
    values.update(data_backend="synthetic", device="cpu", max_steps=4, log_every=1, eval_at_end=False)
    values.update(train_dir=str(tmp_path / "run"), num_workers=0)
    return make_config(**{**values, **overrides})


@pytest.fixture
def lifetimes(monkeypatch):
    """.events in order: ('release_graph', what it released) and 'cleanup' (leaving the group);
    .step: the TrainStep class the trainer builds."""
    events = []

    class RecordingStep(TrainStep):
        nonfinite_at = None  # the step after which the loss turns non-finite

        def __call__(self, batches):
            super().__call__(batches)
            self.graph = "captured"  # stands for the CUDA graph captured after the warm-up
            if self.nonfinite_at is not None and int(self.step_count) >= self.nonfinite_at:
                self.nonfinite_streak.fill_(1)  # as a skipped step leaves the streak and the count
                self.scaler.skipped_steps.add_(1)

        def release_graph(self):
            events.append(("release_graph", self.graph))
            self.graph = None

    real_cleanup = fasttrain.train.cleanup

    def recording_cleanup():
        events.append("cleanup")
        real_cleanup()

    monkeypatch.setattr(fasttrain.run, "TrainStep", RecordingStep)  # build_run makes the step
    monkeypatch.setattr(fasttrain.train, "cleanup", recording_cleanup)
    return SimpleNamespace(events=events, step=RecordingStep)


def test_one_skipped_step_between_log_rows_stops_an_fp32_run(tmp_path, monkeypatch):
    # The seed asserts on a NaN loss at every step. The trainer looked only at the streak at its log
    # step, which the next good step resets: one non-finite step between rows let the run go on.
    class OneBadStep(TrainStep):
        def __call__(self, batches):
            super().__call__(batches)
            if int(self.step_count) == 2:  # step 2 skipped, as a non-finite loss makes it
                self.nonfinite_streak.fill_(1)
                self.scaler.skipped_steps.add_(1)

    monkeypatch.setattr(fasttrain.run, "TrainStep", OneBadStep)
    cfg = _cfg(tmp_path, precision="fp32", log_every=4, max_steps=8, checkpoint_every=100)
    with pytest.raises(TrainingStopped, match="the loss was not finite at 1 of steps 1-4") as raised:
        train(cfg)
    # The advice fits the run: lower the learning rate; not "use precision=fp32" to an fp32 run.
    assert "; lower initial_learning_rate: no checkpoint was written before them" in str(raised.value)
    assert "fp32" not in str(raised.value)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4] and rows[0]["skipped_steps"] == 1


def test_a_stop_after_a_skipped_step_saves_then_says_why_it_stops(tmp_path, monkeypatch):
    # SIGTERM at step 3 of an fp32 run whose step 2 was skipped: the stop's checkpoint is written, then
    # the non-finite loss stops the run. The row's check ran before the save, so the run ended without
    # its checkpoint. That checkpoint follows a non-finite step (and finite ones that may have blown the
    # weights up): it is kept, set aside, and the same command does not resume from it.
    import signal

    class BadThenStopped(TrainStep):
        def __call__(self, batches):
            super().__call__(batches)
            if int(self.step_count) == 2:
                self.nonfinite_streak.fill_(1)
                self.scaler.skipped_steps.add_(1)
            if int(self.step_count) == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler sets its stop flag

    monkeypatch.setattr(fasttrain.run, "TrainStep", BadThenStopped)
    cfg = _cfg(tmp_path, precision="fp32", log_every=4, max_steps=8, checkpoint_every=100)
    saved = tmp_path / "run" / "ckpt-3.pt"
    with pytest.raises(TrainingStopped, match="at 1 of steps 1-3 .*set aside, as \\*.nonfinite: ckpt-3.pt;"):
        train(cfg)
    assert not saved.exists() and saved.with_name("ckpt-3.pt.nonfinite").is_file()
    assert saved.with_name("ckpt-3.pt.sha256.nonfinite").is_file()


def test_a_checkpoint_written_among_non_finite_steps_is_set_aside_and_the_one_before_resumed(
    tmp_path, monkeypatch, capsys
):
    # Checkpoints every 2 steps, rows every 4; step 6 not finite. The run named ckpt-6 "the last good
    # checkpoint", written after it (an audit's run: a finite step with a huge learning rate had left
    # its weights at 3.5e19), and the same command resumed from it, into the same stop, again and again.
    class BadAtSix(TrainStep):
        def __call__(self, batches):
            super().__call__(batches)
            if int(self.step_count) == 6:
                self.nonfinite_streak.fill_(1)
                self.scaler.skipped_steps.add_(1)

    monkeypatch.setattr(fasttrain.run, "TrainStep", BadAtSix)
    cfg = _cfg(tmp_path, precision="fp32", log_every=4, max_steps=12, checkpoint_every=2)
    run_dir = tmp_path / "run"
    with pytest.raises(TrainingStopped) as raised:
        train(cfg)
    assert str(raised.value).endswith(
        f"set aside, as *.nonfinite: ckpt-6.pt; lower initial_learning_rate: the same command resumes from "
        f"{run_dir / 'ckpt-4.pt'}, written before them"
    ), str(raised.value)
    assert sorted(p.name for p in run_dir.glob("ckpt-*")) == [
        "ckpt-2.pt", "ckpt-2.pt.sha256", "ckpt-4.pt", "ckpt-4.pt.sha256", "ckpt-6.pt.nonfinite",
        "ckpt-6.pt.sha256.nonfinite",
    ]  # fmt: skip
    monkeypatch.undo()
    capsys.readouterr()
    assert train(cfg)["step"] == 12
    assert "resuming from step 4" in capsys.readouterr().out


def test_an_error_after_capture_releases_the_graph_before_leaving_the_group(tmp_path, lifetimes):
    # A non-finite loss stops the run with an exception after the graph exists: without the release
    # the NCCL communicator waits for the graph at exit (pytorch/pytorch#115388), a hung job.
    lifetimes.step.nonfinite_at = 2
    with pytest.raises(TrainingStopped, match="not finite"):
        train(_cfg(tmp_path))
    events = lifetimes.events
    assert events[:1] == [("release_graph", "captured")] and events[-1:] == ["cleanup"], events


def test_a_finished_run_releases_the_graph_before_leaving_the_group(tmp_path, lifetimes):
    assert train(_cfg(tmp_path)) == {"step": 4}
    events = lifetimes.events
    assert events[:1] == [("release_graph", "captured")] and events[-1:] == ["cleanup"], events


def test_the_training_pipeline_is_released_before_evaluation(tmp_path, monkeypatch):
    # The training loader's generator is suspended mid-epoch when the loop ends; evaluation builds its
    # own pipeline and must not hold both.
    pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed")
    from fasttrain.data.dali_pipeline import DaliLoader

    data = tmp_path / "data"
    make_synthetic(data, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)  # 12 batches
    pipelines, alive_at_eval = [], []
    build, evaluate = DaliLoader._build_pipeline, fasttrain.eval_pass.evaluate

    def recording_build(self, *args, **kwargs):
        pipe = build(self, *args, **kwargs)
        pipelines.append((self.split, weakref.ref(pipe)))
        return pipe

    def checking_evaluate(*args, **kwargs):
        alive_at_eval.append([split for split, pipe in pipelines if pipe() is not None])
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(DaliLoader, "_build_pipeline", recording_build)
    monkeypatch.setattr(fasttrain.eval_pass, "evaluate", checking_evaluate)
    overrides = dict(data_backend="dali", data_dir=str(data), label_offset=-1, max_steps=3)
    result = train(_cfg(tmp_path, **overrides, eval_at_end=True, max_eval_batches=1, ema_decay=0.0))
    assert result["count"] == 4 and [split for split, _ in pipelines] == ["train", "validation"]
    assert alive_at_eval == [[]], alive_at_eval


def _count_stop_checks(rank: int, world: int, port: int, cfg, out_dir) -> None:
    os.environ.update(loopback_env(), MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import fasttrain.monitor

    # For each flag all-reduce: the step of the log line before it (0 for none).
    logged, checked = [0], []
    all_reduce_flag, log_step = fasttrain.monitor.all_reduce_flag, fasttrain.train.log_step

    def recording_log_step(log, progress, step, *args):
        logged.append(step)
        return log_step(log, progress, step, *args)

    def recording_all_reduce_flag(flag, info):
        checked.append(logged[-1])
        return all_reduce_flag(flag, info)

    fasttrain.train.log_step = recording_log_step
    fasttrain.monitor.all_reduce_flag = recording_all_reduce_flag
    train(cfg)
    (out_dir / f"rank{rank}").write_text(" ".join(map(str, checked)))


def test_ranks_agree_on_a_stop_only_at_the_log_steps(tmp_path):
    # The stop check's flag all-reduce ends in a host read (a GPU sync): only where the trainer reads
    # the loss back anyway, every log_every steps, not at a fixed interval of its own.
    cfg = _cfg(tmp_path, max_steps=12, log_every=4, checkpoint_every=100)
    mp.spawn(_count_stop_checks, args=(2, free_port(), cfg, tmp_path), nprocs=2, join=True)
    for rank in range(2):
        # one check after each log line (steps 4, 8, 12), none in between
        assert (tmp_path / f"rank{rank}").read_text() == "4 8 12"


def test_train_top1_in_metrics_log_line_and_tensorboard(tmp_path, capsys):
    run_dir = tmp_path / "run"
    values = dict(model="resnet18", base_channels=8, image_size=32, batch_size=8, num_classes=4)
    values.update(data_backend="synthetic", device="cpu", max_steps=4, log_every=2, eval_at_end=False)
    cfg = make_config(**values, train_dir=str(run_dir), num_workers=0, deterministic=True)
    train(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    top1 = [r["train_top1"] for r in records]
    assert len(top1) == 2 and all(0.0 <= t <= 1.0 for t in top1)
    # the mean of two batches of 8: a multiple of 1/16
    assert all(abs(t * 16 - round(t * 16)) < 1e-5 for t in top1), top1
    out = capsys.readouterr().out
    assert f"train top-1 {top1[0]:.3f}" in out and f"train top-1 {top1[1]:.3f}" in out
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(run_dir))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("train/train_top1")]
    assert got == [(2, pytest.approx(top1[0])), (4, pytest.approx(top1[1]))]


# --- end to end through the CLI (tests/launch_helpers.py's `command`) ---------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


def test_nonfinite_loss_stops_with_last_good_checkpoint(data, tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        command(
            data,
            run_dir,
            "--max_steps=50",
            "--optimizer=momentum",
            "--initial_learning_rate=1e30",
            "--checkpoint_every=1",
        ),
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "the loss was not finite" in out.stderr
    assert out.stderr.strip().count("\n") == 0
    saved = sorted(int(p.name[5:-3]) for p in run_dir.glob("ckpt-*.pt"))
    assert saved, "no checkpoint before the loss went bad"
    state = torch.load(run_dir / f"ckpt-{saved[-1]}.pt", weights_only=True)
    assert f"ckpt-{saved[-1]}.pt" in out.stderr
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_a_run_file_that_cannot_be_written_is_one_error_or_one_note(tmp_path, capsys):
    # config.json (at start) and metrics.jsonl (each row) that could not be written, as on a full disk
    # (here: a directory stands where the file goes), ended the run in a traceback.
    from fasttrain.errors import FasttrainError

    cfg = _cfg(tmp_path)
    (tmp_path / "run" / "config.json").mkdir(parents=True)
    with pytest.raises(
        FasttrainError, match=r"cannot write .*config.json.* \(Is a directory\); free space in"
    ):
        train(cfg)
    (tmp_path / "run" / "config.json").rmdir()
    (tmp_path / "run" / "metrics.jsonl").mkdir()
    capsys.readouterr()
    train(cfg)  # the rows are lost, the run is not: it trains and saves
    err = capsys.readouterr().err
    assert err.count("cannot write") == 1 and "metrics.jsonl (Is a directory); its rows are not kept" in err
    assert (tmp_path / "run" / "ckpt-4.pt").is_file()


@pytest.mark.parametrize("exempt", [False, True])
def test_the_logged_loss_holds_the_seeds_l2_term(tmp_path, exempt):
    # Both seeds log cross-entropy + weight_decay * sum(tf.nn.l2_loss(w)); the trainer logged the
    # cross-entropy alone (2.2 lower for resnet50_v2 at initialisation, 3.4 for Inception v3).
    cfg = _cfg(tmp_path, weight_decay=0.01, no_decay_bn_bias=exempt, precision="fp32")
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "loss" in r][-1]
    assert last["step"] == 4
    state = torch.load(tmp_path / "run" / "ckpt-4.pt", weights_only=True)["model"]
    model = fasttrain.run.build_model(cfg)
    decayed = [n for n, p in model.named_parameters() if not (exempt and p.dim() == 1)]
    # float64 from the checkpoint of the same step (the weights after its update, as logged)
    expected = sum(0.5 * 0.01 * state[n].double().pow(2).sum().item() for n in decayed)
    assert last["l2_loss"] == pytest.approx(expected, rel=1e-5)  # fp32 dot over ~50k values
    assert last["loss"] == pytest.approx(last["cross_entropy"] + expected, rel=1e-5)
    assert last["loss_avg"] == pytest.approx(last["cross_entropy"] + expected, rel=1e-5)  # log_every 1


def test_sync_bn_in_one_process_says_it_has_no_effect(tmp_path, capsys):
    # A one-process CPU run took --sync_bn without a word, and its config.json says sync_bn: true.
    train(_cfg(tmp_path, sync_bn=True, max_steps=1))
    assert "note: --sync_bn has no effect in one process" in capsys.readouterr().out
