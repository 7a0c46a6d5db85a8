"""python -m fasttrain.evaluate: a run's checkpoints evaluated apart from the trainer, as the trainer
evaluates them; --watch; one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from fasttrain.config import make_config
from fasttrain.data.synthetic import make_synthetic
from fasttrain.eval_pass import evaluate
from fasttrain.evaluate import main
from fasttrain.models import create_model
from fasttrain.precision import Precision
from fasttrain.train import train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


def _cfg(data, run_dir, **overrides):
    values = dict(model="resnet18", base_channels=8, image_size=32, batch_size=4, num_classes=4)
    values.update(data_backend="torch", data_dir=str(data), device="cpu", num_workers=0, deterministic=True)
    values.update(max_steps=4, log_every=2, checkpoint_every=2, ema_decay=0.9, max_eval_batches=2)
    return make_config(**{**values, "train_dir": str(run_dir), **overrides})


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    """A finished 4-step run with ckpt-2 and ckpt-4, evaluated at the end by the trainer."""
    run_dir = tmp_path_factory.mktemp("run")
    result = train(_cfg(data, run_dir))
    return run_dir, result


def _records(run_dir, source="evaluate"):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("source") == source]


def test_newest_checkpoint_gives_the_trainers_final_numbers(run, capsys):
    run_dir, final = run
    before = len(_records(run_dir))
    assert main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"ckpt-4.pt: step 4, validation top-1 {final['top1']:.3f} (EMA {final['ema_top1']:.3f})" in out
    record = _records(run_dir)[before]
    # the trainer's live weights and EMA against the same weights restored from the file
    for key in ("top1", "top5", "ema_top1", "ema_top5", "count"):
        assert record[key] == final[key], key
    assert record["step"] == 4 and record["count"] == 8
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(run_dir / "eval"))
    acc.Reload()
    assert (4, pytest.approx(final["ema_top1"])) in [(e.step, e.value) for e in acc.Scalars("eval/ema_top1")]


def test_a_given_checkpoint(run, capsys):
    run_dir, _ = run
    assert main([str(run_dir), "--checkpoint", str(run_dir / "ckpt-2.pt")]) == 0
    assert "ckpt-2.pt: step 2, validation top-1 " in capsys.readouterr().out
    assert _records(run_dir)[-1]["step"] == 2


def test_another_runs_checkpoint_leaves_this_runs_curves_alone(run, tmp_path, capsys):
    # Same config, another run (its own run.json): before run identities its result was appended to
    # this run's metrics.jsonl as if this run had reached that step.
    run_dir, _ = run
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    (other / "run.json").write_text(json.dumps({"run_id": "0" * 32}))
    assert json.loads((run_dir / "run.json").read_text())["run_id"] != "0" * 32  # the trainer wrote one
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    events_before = (
        sorted(p.name for p in (run_dir / "eval").glob("*")) if (run_dir / "eval").exists() else []
    )
    assert main([str(run_dir), "--checkpoint", str(other / "ckpt-2.pt")]) == 0
    out, err = capsys.readouterr()
    assert "ckpt-2.pt: step 2, validation top-1 " in out and not err  # stderr: for errors only
    assert "is not a checkpoint of the run in" in out and "pass --metrics_out FILE" in out
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before
    assert (sorted(p.name for p in (run_dir / "eval").glob("*")) if (run_dir / "eval").exists() else []) == (
        events_before
    )

    kept = tmp_path / "kept.jsonl"
    assert main([str(run_dir), "--checkpoint", str(other / "ckpt-2.pt"), "--metrics_out", str(kept)]) == 0
    assert "appended to" in capsys.readouterr().out
    [record] = [json.loads(line) for line in kept.read_text().splitlines()]
    assert record["step"] == 2 and record["checkpoint"] == str(other / "ckpt-2.pt")
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before


def test_watch_evaluates_each_new_checkpoint_until_the_last(run, tmp_path, capsys):
    run_dir = tmp_path / "watched"
    shutil.copytree(run[0], run_dir)
    parked = tmp_path / "parked"
    parked.mkdir()
    for name in ("ckpt-4.pt", "ckpt-4.pt.sha256"):
        (run_dir / name).rename(parked / name)
    before = len(_records(run_dir))
    codes = []
    watcher = threading.Thread(target=lambda: codes.append(main([str(run_dir), "--watch", "0.1"])))
    watcher.start()
    deadline = time.time() + 120
    while len(_records(run_dir)) == before and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # a few polls that find nothing new
    for name in ("ckpt-4.pt.sha256", "ckpt-4.pt"):  # as the trainer places them: sidecar first
        (parked / name).rename(run_dir / name)
    watcher.join(timeout=120)
    assert not watcher.is_alive() and codes == [0], "--watch should end after the run's final step"
    assert [r["step"] for r in _records(run_dir)[before:]] == [2, 4]


def _run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "fasttrain.evaluate", *map(str, args)], capture_output=True, text=True
    )


def test_errors_are_one_line(run, data, tmp_path):
    run_dir, _ = run
    outputs = []
    _cli = lambda *args: outputs.append(_run_cli(*args)) or outputs[-1]
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _cli(empty)
    assert out.returncode == 2 and "is not a fasttrain run directory (no config.json)" in out.stderr
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    shutil.copy(run_dir / "config.json", no_ckpt)
    out = _cli(no_ckpt)
    assert out.returncode == 1 and "holds no checkpoint" in out.stderr
    out = _cli(run_dir, "--checkpoint", tmp_path / "ckpt-9.pt")
    assert out.returncode == 1 and "ckpt-9.pt does not exist" in out.stderr
    other = tmp_path / "other"
    train(_cfg(data, other, num_classes=5, max_steps=2, eval_at_end=False))
    out = _cli(run_dir, "--checkpoint", other / "ckpt-2.pt")
    # The note says another run's checkpoint is evaluated with this run's config; the error, that this
    # config does not fit it, and how to evaluate it with its own (not "name one of its own ckpt files").
    assert f"note: {other / 'ckpt-2.pt'} is not a checkpoint of the run in {run_dir}" in out.stdout
    assert out.returncode == 1 and f"does not fit the model of {run_dir}'s config" in out.stderr
    assert "num_classes 4 -> 5" in out.stderr or "num_classes 5 -> 4" in out.stderr, out.stderr
    assert f"python -m fasttrain.evaluate {other} --checkpoint {other / 'ckpt-2.pt'}" in out.stderr
    assert "name one of its own" not in out.stderr
    # The run's --data_dir as given (relative) read from elsewhere: it said "data directory 'tiny' does
    # not exist", naming neither config.json nor the way out.
    moved = tmp_path / "moved"
    shutil.copytree(run_dir, moved)
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "data_dir": "tiny"}))
    out = _cli(moved)
    assert (
        out.returncode == 2
        and (
            f"the run's data directory 'tiny' (from {moved / 'config.json'}, relative to where the run was "
            "started) is not a directory here; pass --data_dir"
        )
        in out.stderr
    ), out.stderr
    for result in outputs:
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_checkpoints_carry_the_run_id_and_a_resume_names_another_runs(run, data, tmp_path, capsys):
    # The run's identity (run.json) is written into each checkpoint; resuming a directory whose run.json
    # names another run than the checkpoint's (a checkpoint copied in from elsewhere) says so.
    import torch

    run_dir, _ = run
    own = json.loads((run_dir / "run.json").read_text())["run_id"]
    assert torch.load(run_dir / "ckpt-4.pt", weights_only=True)["run_id"] == own
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    capsys.readouterr()
    train(_cfg(data, other))  # the same copy: the same run, nothing to say
    assert "was written by run" not in capsys.readouterr().out
    (other / "run.json").write_text(json.dumps({"run_id": "f" * 32}))
    train(_cfg(data, other))
    out = capsys.readouterr().out
    assert f"ckpt-4.pt was written by run {own[:8]}, not by the run in {other} (run.json: ffffffff)" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_evaluation_batches_are_queued_without_waiting_for_the_gpu():
    """The evaluation loop never makes the host wait for the GPU (one .tolist() after the last batch):
    its batches run under torch.cuda.set_sync_debug_mode('error'), which raises at a synchronizing
    call. Before the image count was kept on the host, each batch copied it to the GPU and waited."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = create_model("resnet18", 4, base_channels=8).to(device)
    gen = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 256, (4, 32, 32, 3), dtype=torch.uint8, generator=gen).pin_memory(),
            torch.randint(0, 4, (4,), generator=gen).pin_memory(),
        )
        for _ in range(3)
    ]

    class Strict:
        strict = False

        def __len__(self):
            return len(batches)

        def __iter__(self):
            torch.cuda.set_sync_debug_mode("error" if self.strict else 0)
            try:
                yield from batches
            finally:
                torch.cuda.set_sync_debug_mode(0)  # before the one sync at the end

    loader = Strict()
    fp32 = Precision("fp32", channels_last=False, cuda_graph=False)
    try:
        warm = evaluate(model, loader, precision=fp32, device=device, preprocess="inception")
        loader.strict = True
        strict = evaluate(model, loader, precision=fp32, device=device, preprocess="inception")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert strict == warm and strict["count"] == 12


def test_an_evaluation_cut_by_max_eval_batches_says_so(run, capsys):
    """The result of part of the split is named as such, in the line and in the metrics row; one that
    covered the whole split (the limit not reached) is not."""
    run_dir, _ = run  # validation: 24 images in batches of 4, --max_eval_batches 2
    assert main([str(run_dir), "--checkpoint", str(run_dir / "ckpt-4.pt")]) == 0
    out = capsys.readouterr().out
    assert "on 8 images, the first 2 batches of each rank (--max_eval_batches)" in out
    assert _records(run_dir)[-1]["max_eval_batches"] == 2
    model = create_model("resnet18", num_classes=4, base_channels=8).eval()
    batches = [(torch.randint(0, 255, (4, 32, 32, 3), dtype=torch.uint8), torch.arange(4))] * 3
    fp32 = Precision("fp32", channels_last=False, cuda_graph=False)
    settings = dict(precision=fp32, device=torch.device("cpu"), preprocess="inception")
    assert evaluate(model, batches, **settings, max_batches=2)["max_eval_batches"] == 2
    assert "max_eval_batches" not in evaluate(model, batches, **settings, max_batches=3)
    assert "max_eval_batches" not in evaluate(model, batches, **settings)


def test_watch_ends_at_the_last_step_the_newest_checkpoint_records(run, tmp_path):
    """--watch read the run's last step from config.json once. A run resumed with a smaller --max_steps
    (config.json of the first start said 10; its checkpoints now say 4) kept the watch polling after
    the run's final checkpoint, until Ctrl-C."""
    run_dir = tmp_path / "resumed"
    shutil.copytree(run[0], run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "max_steps": 10}))
    codes = []
    watcher = threading.Thread(
        target=lambda: codes.append(main([str(run_dir), "--watch", "0.1"])), daemon=True
    )
    watcher.start()
    watcher.join(timeout=60)  # ckpt-4, evaluated in about 3 s, is the last
    assert not watcher.is_alive() and codes == [0], "--watch should end after the run's final step"


def test_an_evaluation_done_again_adds_no_second_tensorboard_point(run, tmp_path, capsys):
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run_dir = tmp_path / "twice"
    shutil.copytree(run[0], run_dir)
    shutil.rmtree(run_dir / "eval", ignore_errors=True)
    # The module's run may have evaluate rows from the tests before: this copy starts without them.
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(ln for ln in lines if '"source": "evaluate"' not in ln))
    before = len(_records(run_dir))
    for _ in range(2):
        assert main([str(run_dir), "--checkpoint", str(run_dir / "ckpt-2.pt")]) == 0
    assert [r["step"] for r in _records(run_dir)[before:]] == [2, 2]  # each evaluation has its row
    acc = ea.EventAccumulator(str(run_dir / "eval"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/top1")] == [2]  # before: [2, 2], the curve doubled back


def test_whose_checkpoint_it_is_goes_by_its_run_id_and_a_bad_one_writes_nothing(run, tmp_path, capsys):
    # A copy of the run's own checkpoint elsewhere (no run.json beside it), a garbage file and a directory
    # were each called "not a checkpoint of the run in RUN_DIR (another run.json)"; a corrupt checkpoint
    # in RUN_DIR failed after an empty TensorBoard file had been made in RUN_DIR/eval.
    run_dir = shutil.copytree(run[0], tmp_path / "run", ignore=shutil.ignore_patterns("eval"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(run_dir / "ckpt-2.pt", elsewhere / "ckpt-6.pt")
    (elsewhere / "junk.pt").write_bytes(b"not a checkpoint")
    (elsewhere / "dir.pt").mkdir()
    (run_dir / "ckpt-8.pt").write_bytes(b"not a checkpoint")  # the run's own: TensorBoard's file was made
    for path, words in (
        (elsewhere / "junk.pt", "refusing to load"),
        (elsewhere / "dir.pt", "is a directory"),
        (run_dir / "ckpt-8.pt", "refusing to load"),
    ):
        assert main([str(run_dir), "--checkpoint", str(path)]) == 1
        out, err = capsys.readouterr()
        assert "note:" not in out + err and err.count("\n") == 1 and words in err, (out, err)
    assert not (run_dir / "eval").exists()
    before = len(_records(run_dir))
    assert main([str(run_dir), "--checkpoint", str(elsewhere / "ckpt-6.pt")]) == 0
    assert "note:" not in capsys.readouterr().out  # its run_id is the run's: its result is the run's
    assert [r["checkpoint"] for r in _records(run_dir)[before:]] == [str(elsewhere / "ckpt-6.pt")]
    state = torch.load(elsewhere / "ckpt-6.pt", weights_only=True)
    torch.save({**state, "run_id": "e" * 32}, elsewhere / "ckpt-7.pt")  # another run's, by its run_id
    assert main([str(run_dir), "--checkpoint", str(elsewhere / "ckpt-7.pt")]) == 0
    own = json.loads((run_dir / "run.json").read_text())["run_id"]
    assert (
        f"note: {elsewhere / 'ckpt-7.pt'} is not a checkpoint of the run in {run_dir} (it was written by run "
        f"eeeeeeee; {run_dir}'s run.json is run {own[:8]})" in capsys.readouterr().out
    )
    assert len(_records(run_dir)) == before + 1
