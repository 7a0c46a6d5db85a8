"""python -m fasttrain.evaluate: where its results go and when --watch ends, each case reproduced
before its check existed: --metrics_out naming the run's config.json or a checkpoint had a JSON line
appended to it (the run could no longer be read, or resumed); an unwritable --metrics_out or run
directory ended in a traceback after the whole evaluation; --watch -1 in a traceback after the first
evaluation; --watch on a run that --train_epochs ends never stopped; a run whose last checkpoint could
not be evaluated ended --watch with exit 0; a row appended after a line torn by a killed trainer was
glued onto it (the plot then lost it); under 2 ranks, a checkpoint only one rank could load left the
other in the evaluation's all-reduce for ever."""

import json
import shutil
import subprocess
import sys
import time

import pytest
from launch_helpers import kill_tree
from test_evaluate import _cfg

from fasttrain.data.synthetic import make_synthetic
from fasttrain.eval_settings import parse
from fasttrain.evaluate import main
from fasttrain.train import train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


@pytest.fixture(scope="module")
def epochs_run(data, tmp_path_factory):
    """A run that --train_epochs ends: 48 records at batch 4, a quarter epoch = 3 steps (ckpt-2, ckpt-3)."""
    run_dir = tmp_path_factory.mktemp("epochs")
    train(_cfg(data, run_dir, max_steps=0, train_epochs=0.25, eval_at_end=False))
    assert sorted(p.name for p in run_dir.glob("ckpt-*.pt")) == ["ckpt-2.pt", "ckpt-3.pt"]
    return run_dir


def _cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "fasttrain.evaluate", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_watch_ends_at_the_last_step_its_checkpoints_record(epochs_run):
    out = _cli(epochs_run, "--watch", "0.1", timeout=120)  # before: polled until killed
    assert out.returncode == 0, out.stderr
    assert "ckpt-3.pt: step 3" in out.stdout


def test_watch_whose_last_checkpoint_cannot_be_evaluated_fails(data, tmp_path):
    # A --max_steps run: its last step is known without the checkpoint. (Where --train_epochs ends the
    # run, its last step comes with the checkpoints: with the newest unreadable, --watch waits on.)
    run_dir = tmp_path / "run"
    train(_cfg(data, run_dir, max_steps=3, eval_at_end=False))
    last = run_dir / "ckpt-3.pt"
    last.write_bytes(last.read_bytes()[:-100])  # its checksum no longer matches
    out = _cli(run_dir, "--watch", "0.1", timeout=120)
    assert out.returncode == 1 and "waiting for the next checkpoint" in out.stderr, out.stderr
    assert "does not match its checksum" in out.stderr.splitlines()[-1]


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_watch_interval_that_is_no_number_of_seconds_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["somewhere", "--watch", value])
    assert exit_info.value.code == 2 and "--watch: must be a number of seconds" in capsys.readouterr().err


def _evaluated_steps(run_dir):
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if r.get("source") == "evaluate"]


def test_watch_evaluates_every_checkpoint_written_between_two_polls(data, tmp_path):
    # Each poll took the newest checkpoint alone: ckpt-4 and ckpt-6, both written while the watcher
    # slept, gave one evaluation (step 6), and step 4's never came.
    import threading

    run_dir, parked = tmp_path / "run", tmp_path / "parked"
    train(_cfg(data, run_dir, max_steps=6, eval_at_end=False))
    parked.mkdir()
    for name in ("ckpt-4.pt", "ckpt-4.pt.sha256", "ckpt-6.pt", "ckpt-6.pt.sha256"):
        (run_dir / name).rename(parked / name)
    codes = []
    watcher = threading.Thread(target=lambda: codes.append(main([str(run_dir), "--watch", "0.3"])))
    watcher.start()
    deadline = time.monotonic() + 120
    while not _evaluated_steps(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    for name in ("ckpt-4.pt.sha256", "ckpt-4.pt", "ckpt-6.pt.sha256", "ckpt-6.pt"):  # as the trainer writes
        (parked / name).rename(run_dir / name)
    watcher.join(timeout=120)
    assert codes == [0] and _evaluated_steps(run_dir) == [2, 4, 6]


def test_watch_on_a_tensorflow_train_directory_follows_its_checkpoint_file(data, tmp_path):
    # The seed's eval loops over its --checkpoint_dir; on a TF train directory --watch evaluated the
    # newest checkpoint once and exited 0.
    import threading

    from fasttrain.tf.convert import main as convert

    run_dir, tf_dir = tmp_path / "run", tmp_path / "tf"
    train(_cfg(data, run_dir, max_steps=4, eval_at_end=False))
    assert convert(["to-tf", str(run_dir / "ckpt-2.pt"), "--out", str(tf_dir / "model.ckpt-2")]) == 0
    cmd = [sys.executable, "-m", "fasttrain.evaluate", str(tf_dir), "--recipe", "demo"]
    cmd += ["--data_dir", str(data), "--device", "cpu", "--watch", "0.3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()

    def wait_for(words: str) -> None:
        deadline = time.monotonic() + 120
        while not any(words in line for line in lines) and time.monotonic() < deadline:
            assert proc.poll() is None, "".join(lines)[-2000:]  # it must still be watching
            time.sleep(0.1)
        assert any(words in line for line in lines), "".join(lines)[-2000:]

    try:
        wait_for("model.ckpt-2: step 2, validation top-1")
        assert convert(["to-tf", str(run_dir / "ckpt-4.pt"), "--out", str(tf_dir / "model.ckpt-4")]) == 0
        wait_for("model.ckpt-4: step 4, validation top-1")
    finally:
        kill_tree(proc.pid)
        proc.wait()


def test_ctrl_c_ends_a_watch_between_evaluations_and_fails_one_cut_short(epochs_run, monkeypatch, capsys):
    # Ctrl-C anywhere returned 0: a one-shot evaluation cut short said nothing and reported success.
    from fasttrain import evaluate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "evaluate_run", interrupted)
    assert main([str(epochs_run), "--metrics_out", str(epochs_run / "x.jsonl")]) == 130
    assert "interrupted while evaluating; no result written" in capsys.readouterr().err
    monkeypatch.undo()

    def sleep(seconds):
        raise KeyboardInterrupt  # in --watch's wait for the next checkpoint

    monkeypatch.setattr(evaluate.time, "sleep", sleep)
    out = epochs_run / "watched.jsonl"
    assert main([str(epochs_run), "--watch", "100", "--metrics_out", str(out)]) == 0
    assert [json.loads(line)["step"] for line in out.read_text().splitlines()] == [3]


def test_a_tf_directory_without_recipe_and_a_missing_checkpoint_are_named_as_they_are(
    epochs_run, tmp_path, capsys
):
    # A TF train directory without --recipe was told to "name a --train_dir"; a --checkpoint that is not
    # there came after a note calling it another run's checkpoint.
    tf_dir = tmp_path / "tf"
    tf_dir.mkdir()
    (tf_dir / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-1"\n')
    assert main([str(tf_dir)]) == 2
    err = capsys.readouterr().err
    assert "is a TensorFlow train directory, which has no config.json: name its recipe with --recipe" in err
    missing = tmp_path / "nowhere.pt"
    assert main([str(epochs_run), "--checkpoint", str(missing)]) == 1
    captured = capsys.readouterr()
    assert "note:" not in captured.out + captured.err and str(missing) in captured.err


def test_results_go_only_where_they_can_and_should(epochs_run, tmp_path, capsys):
    config = (epochs_run / "config.json").read_bytes()
    checkpoint = (epochs_run / "ckpt-2.pt").read_bytes()
    for target, words in (
        (epochs_run / "config.json", "is not a .jsonl file"),
        (epochs_run / "ckpt-2.pt", "is not a .jsonl file"),
        (tmp_path / "missing" / "m.jsonl", "cannot write --metrics_out"),
        (tmp_path, "is not a .jsonl file"),
    ):
        assert main([str(epochs_run), "--metrics_out", str(target)]) == 2, target
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and str(target) in err, err
    assert (epochs_run / "config.json").read_bytes() == config
    assert (epochs_run / "ckpt-2.pt").read_bytes() == checkpoint
    (tmp_path / "d.jsonl").mkdir()
    assert main([str(epochs_run), "--metrics_out", str(tmp_path / "d.jsonl")]) == 2
    assert "cannot write --metrics_out" in capsys.readouterr().err


def test_a_row_after_a_torn_line_starts_a_line_of_its_own(epochs_run, tmp_path):
    run_dir = shutil.copytree(epochs_run, tmp_path / "run")
    metrics = run_dir / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"time": 1.0, "step": 3, "lo')  # a trainer killed mid-row
    assert _cli(run_dir, "--checkpoint", run_dir / "ckpt-2.pt").returncode == 0
    lines = metrics.read_text().splitlines()
    assert metrics.read_text().startswith(whole) and len(lines) == len(whole.splitlines()) + 1
    assert json.loads(lines[-1])["source"] == "evaluate"  # every line JSON, the torn one gone


def test_a_synthetic_runs_evaluation_says_what_it_is_and_takes_data_dir(data, tmp_path):
    # --data_dir was ignored for a run on synthetic data: "validation top-1 0.500 ... on 400 images"
    # was one random batch, repeated.
    run_dir = tmp_path / "run"
    train(_cfg(data, run_dir, data_backend="synthetic", data_dir="", max_steps=2, eval_at_end=False))
    alone = _cli(run_dir)
    assert (
        alone.returncode == 0
        and "trained on synthetic data: its evaluation is of random batches" in alone.stdout
    )
    on_shards = _cli(run_dir, "--data_dir", data)
    assert on_shards.returncode == 0, on_shards.stderr
    assert "trained on synthetic data" not in on_shards.stdout and "on 8 images" in on_shards.stdout


# --- the seed's eval program's flags (inception_eval.py) ---------------------------------------------


def test_the_seeds_eval_flags_are_fasttrains_settings(capsys, monkeypatch):
    # Each was an argparse usage error; --checkpoint_dir /x bound /x to RUN_DIR, then was unrecognized.
    monkeypatch.delenv("RANK", raising=False)
    assert parse(["--checkpoint_dir", "/x"]).run_dir == "/x"
    assert parse(["/x", "--checkpoint_dir=/x/"]).run_dir == "/x"  # the same directory, twice
    # --eval_interval_secs polls as --watch does; --run_once (the seed's default was to loop) evaluates once.
    assert parse(["--checkpoint_dir=/x", "--eval_interval_secs", "300"]).watch == 300
    assert parse(["--checkpoint_dir=/x", "--eval_interval_secs=300", "--run_once"]).watch == 0
    args = parse(["/x", "--subset=validation", "--num_examples", "50000", "--eval_dir", "/e"])
    assert (args.run_dir, args.num_examples, args.watch) == ("/x", 50000, 0)
    (note,) = capsys.readouterr().out.splitlines()
    assert "--eval_dir /e is not written" in note and "/x/eval" in note and "--metrics_out" in note
    parse(["/x", "--eval_dir", "/e", "--metrics_out", "/r.jsonl"])  # it said /x/eval and metrics.jsonl
    (note,) = capsys.readouterr().out.splitlines()
    assert (
        note
        == "note: --eval_dir /e is not written: its rows go to /r.jsonl, and no TensorBoard files are written"
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["/x", "--checkpoint_dir=/y"], "RUN_DIR /x and --checkpoint_dir /y differ"),
        ([], "name the run to evaluate: RUN_DIR (or the seed's --checkpoint_dir DIR)"),
        (["/x", "--subset=train"], "'train': fasttrain.evaluate evaluates the validation split only"),
        (["/x", "--num_examples=0"], "--num_examples: must be a number of images"),
        (["/x", "--run_once", "--watch=5"], "--run_once evaluates once and --watch polls"),
        (["/x", "--watch=5", "--eval_interval_secs=6"], "--watch 5 and --eval_interval_secs 6 differ"),
    ],
)
def test_the_seeds_eval_flags_that_cannot_be_followed_are_usage_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2 and words in capsys.readouterr().err.splitlines()[-1]


def test_the_seeds_eval_command_line_evaluates_num_examples_in_whole_batches(epochs_run, tmp_path, capsys):
    # inception_eval.py: num_iter = ceil(num_examples / batch_size) batches, total_sample_count =
    # num_iter * batch_size: 9 images at the run's batch of 4 are 3 batches, 12 images (the run's own
    # --max_eval_batches is 2: 8 images).
    out = tmp_path / "r.jsonl"
    argv = ["--checkpoint_dir", str(epochs_run), "--run_once", "--num_examples=9", "--subset=validation"]
    assert main([*argv, "--eval_dir", str(tmp_path / "e"), "--metrics_out", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["step"], row["count"], row["max_eval_batches"]) == (3, 12, 3)
    assert "on 12 images" in capsys.readouterr().out


def _watch_with_rank_1_unable_to_load(rank: int, port: int, run_dir: str, out: str):
    # Its own process group: evaluate_run joins it from torchrun's environment, as under torchrun.
    import os

    import torch
    from launch_helpers import loopback_env

    from fasttrain import evaluate
    from fasttrain.checkpoint import CheckpointError
    from fasttrain.distributed import cleanup
    from fasttrain.eval_settings import parse

    env = dict(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(port)
    )
    os.environ.update(loopback_env(), **env)
    torch.set_num_threads(1)
    load = evaluate._Evaluator.load

    def rank_1_cannot_read(self, path):
        if rank == 1 and path.name == "ckpt-3.pt":
            raise CheckpointError(f"checkpoint {path} does not exist")  # pruned, or another node's disk
        return load(self, path)

    evaluate._Evaluator.load = rank_1_cannot_read
    try:
        evaluate.evaluate_run(parse([run_dir, "--watch", "0.1", "--device", "cpu"]))
        outcome = "returned"
    except CheckpointError as exc:
        outcome = f"CheckpointError: {exc}"
    finally:
        cleanup()
    open(f"{out}.{rank}", "w").write(outcome)


def test_a_checkpoint_one_rank_cannot_load_is_skipped_by_every_rank(epochs_run, tmp_path):
    import torch.multiprocessing as mp
    from launch_helpers import free_port

    run_dir = shutil.copytree(epochs_run, tmp_path / "run")
    before = (run_dir / "metrics.jsonl").read_text()
    args = (free_port(), str(run_dir), str(tmp_path / "rank"))
    context = mp.spawn(_watch_with_rank_1_unable_to_load, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + 60
    while not context.join(timeout=1) and time.monotonic() < deadline:
        pass
    hung = [p.pid for p in context.processes if p.is_alive()]
    for pid in hung:
        kill_tree(pid)
    assert not hung, "a rank was still waiting after 60 s"
    # ckpt-3 is the run's last step (rank 0's total_steps): both stop, as one process would.
    assert (tmp_path / "rank.0").read_text().startswith("CheckpointError: rank 1: checkpoint ")
    assert (tmp_path / "rank.1").read_text().startswith("CheckpointError: checkpoint ")
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing evaluated


def test_the_evaluator_batches_as_the_trainer_does(data, tmp_path, capsys):
    # --max_eval_batches counts batches: the trainer evaluates in --eval_batch_size batches, the
    # evaluator took the training batch, so "the first 2 batches" were 16 images in one, 8 in the other.
    run_dir = tmp_path / "run"
    final = train(_cfg(data, run_dir, eval_batch_size=8, eval_at_end=True))
    assert main([str(run_dir)]) == 0
    row = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["source"] == "evaluate" and row["count"] == final["count"] == 16
    assert (row["top1"], row["ema_top1"]) == (final["top1"], final["ema_top1"])


def test_a_bad_setting_in_config_json_is_named_by_the_file_not_as_a_flag(tmp_path, capsys):
    # It said "--model='resnet99' is not one of ...": a flag nobody passed.
    config = json.loads(_cfg(tmp_path, tmp_path).to_json())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model": "resnet99"}))
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model" not in err, err
    assert f"{tmp_path / 'config.json'} does not load: model='resnet99' is not one of resnet18, " in err
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main([str(tmp_path), "--device", "tpu"]) == 2  # a flag given here is named as the flag
    assert "--device='tpu' is not one of auto, cuda, cpu" in capsys.readouterr().err
