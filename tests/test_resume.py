"""fasttrain.resume: which setting changes a resume reports (the CLI tests cover refusal and note),
and a change of the number of ranks, which no flag records; end to end, a run SIGKILLed and restarted
is bit-exact with an uninterrupted one (every logged loss, every checkpointed buffer), a run directory
whose only checkpoint is unusable stops the run instead of starting over, and a refused resume keeps
the run's config.json."""

import dataclasses
import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_helpers import ENV, command, reached_step, run_torchrun, trainer, trainer_args, trainer_env

from fasttrain.config import make_config
from fasttrain.data.synthetic import make_synthetic
from fasttrain.plot import read_metrics
from fasttrain.resume import changed_settings


def test_changed_settings_names_what_changes_the_numbers_only():
    saved = dataclasses.asdict(make_config(batch_size=8, seed=1, max_steps=100, log_every=10))
    now = make_config(batch_size=4, seed=1, max_steps=300, log_every=5, train_dir="elsewhere")
    assert changed_settings(saved, now) == ["batch_size 8 -> 4"]
    assert changed_settings(saved, make_config(batch_size=8, seed=2, max_steps=100)) == ["seed 1 -> 2"]
    assert changed_settings(None, now) == []  # a checkpoint without its config: nothing to compare
    assert changed_settings({"batch_size": 8}, now) == ["batch_size 8 -> 4"]  # keys it lacks are skipped


def test_a_resume_on_fewer_ranks_says_the_global_batch_changed(tmp_path):
    # A 2-rank checkpoint resumed by one process: the global batch halves (8 -> 4), the steps per
    # epoch and each rank's data change; that continued without the note other such changes get.
    data, run_dir = tmp_path / "data", tmp_path / "run"
    make_synthetic(data, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    flags = ("--num_workers=0", "--checkpoint_every=2")
    (two,) = run_torchrun(["-m", "fasttrain", *trainer_args(data, run_dir, *flags, "--max_steps=2")])
    assert two.returncode == 0, two.stdout[-3000:]
    one = subprocess.run(
        trainer(data, run_dir, *flags, "--max_steps=3"), env=trainer_env(), capture_output=True, text=True
    )
    assert one.returncode == 0, one.stderr[-3000:]
    note = "note: settings changed since that checkpoint: world size 2 -> 1 (global batch 8 -> 4)"
    assert note in one.stdout, one.stdout


# --- end to end through the CLI (tests/launch_helpers.py's `command`) ---------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


def losses(run_dir: Path) -> dict[int, float]:
    """Per-step losses (metrics.jsonl holds each step once, checked by the tests that use this)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def metric_steps(run_dir: Path) -> list[int]:
    """The step of every row of metrics.jsonl, in file order (every line must be JSON, as pandas needs)."""
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_tensors(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tensors(x, y, f"{where}[{i}]")


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    out = subprocess.run(command(data, run_dir, "--max_steps=14"), env=ENV, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return run_dir


SELFKILL = Path(__file__).with_name("selfkill.py")


@pytest.mark.parametrize(
    ("where", "kill_at"),
    [("log", 3), ("save", 8), ("rename", 12), ("log", 13)],
    ids=["after-step-3", "mid-save-of-ckpt-8", "ckpt-12-sum-before-data", "after-step-13"],
)
def test_sigkill_and_restart_is_bit_exact(data, reference, tmp_path, where, kill_at):
    # 14 steps over 2 x 24 records at batch 4 crosses an epoch boundary (12 steps per epoch); a
    # checkpoint every 2 steps. The run SIGKILLs itself (tests/selfkill.py) at a chosen point: between
    # checkpoints, in the middle of a checkpoint's data file, between its checksum file and its data
    # file, and one step before the end.
    run_dir = tmp_path / "killed"
    killed = subprocess.run(
        [sys.executable, str(SELFKILL), where, str(kill_at), *command(data, run_dir, "--max_steps=14")[3:]],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    names = {p.name for p in run_dir.iterdir()}
    if where == "log":
        assert reached_step(run_dir) == kill_at
    elif where == "save":  # the partial file the kill left; the checkpoint before it is whole
        assert f".ckpt-{kill_at}.pt.tmp" in names and f"ckpt-{kill_at}.pt" not in names, names
        assert f"ckpt-{kill_at - 2}.pt" in names, names
    else:  # the checksum file landed, the data file did not
        assert f"ckpt-{kill_at}.pt.sha256" in names and f"ckpt-{kill_at}.pt" not in names, names
    again = subprocess.run(command(data, run_dir, "--max_steps=14"), env=ENV, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert losses(run_dir) == losses(reference)
    # Each step once: the killed run's steps after its last checkpoint were logged again by the resume.
    assert metric_steps(run_dir) == metric_steps(reference) == list(range(1, 15))
    ours = torch.load(run_dir / "ckpt-14.pt", weights_only=True)
    theirs = torch.load(reference / "ckpt-14.pt", weights_only=True)
    for key in ("model", "optimizer", "ema", "bn_ema", "train_step", "data"):
        assert_same_tensors(ours[key], theirs[key], key)


def test_no_usable_checkpoint_stops_instead_of_starting_over(data, tmp_path):
    # The run directory holds only a checkpoint that cannot be loaded (here: not a checkpoint at all).
    # Starting from step 0 would spend the compute again and later overwrite it: stop, name it, and
    # leave the directory as it was.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ckpt-6.pt").write_bytes(b"not a checkpoint")
    (run_dir / "config.json").write_text('{"note": "the earlier run"}\n')
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    out = subprocess.run(command(data, run_dir, "--max_steps=2"), env=ENV, capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "none is usable (ckpt-6.pt" in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
    assert "refusing to load" in out.stdout and "ckpt-6.pt" in out.stdout  # the reason, as a warning
    # run.lock: the record of the run directory's lock (fasttrain/lock.py), not a run's file
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.name != "run.lock"} == before


@pytest.mark.parametrize("data_entry", ["missing", [{"foo": 1}]])
def test_a_checkpoint_without_a_data_position_is_one_error(data, reference, tmp_path, data_entry):
    # A checkpoint fasttrain's trainer did not write, or one edited by hand: the resume ended in a
    # KeyError ('data', then 'epoch') after the weights had loaded.
    from fasttrain.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(reference / "ckpt-14.pt")
    if data_entry == "missing":
        del state["data"]
    else:
        state["data"] = data_entry
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, 14, state)  # with its checksum: a file the resume takes
    out = subprocess.run(command(data, run_dir, "--max_steps=16"), env=ENV, capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert f"{run_dir / 'ckpt-14.pt'} holds no usable data position to resume from" in out.stderr, out.stderr
    assert "--pretrained_model_checkpoint_path" in out.stderr and "Traceback" not in out.stderr


def test_a_checkpoint_that_does_not_fit_is_not_blamed_on_a_setting_that_cannot_cause_it(
    data, reference, tmp_path
):
    # A parameter renamed in the file, resumed with another learning rate: the message said the
    # learning rate was why ("(initial_learning_rate 0.1 -> 0.05): run with the settings..."), and with no
    # setting changed it gave torch's first line alone, which names no parameter.
    from fasttrain.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(reference / "ckpt-14.pt")
    name = next(k for k in state["model"] if k.endswith("conv1.weight"))
    state["model"][name + "_renamed"] = state["model"].pop(name)
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, 14, state)
    out = subprocess.run(
        command(data, run_dir, "--max_steps=16", "--initial_learning_rate=0.05"),
        env=ENV, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert f"{run_dir / 'ckpt-14.pt'} does not fit this run's model/optimizer (" in out.stderr, out.stderr
    assert f'Missing key(s) in state_dict: "{name}"' in out.stderr, out.stderr
    assert f'Unexpected key(s) in state_dict: "{name}_renamed"' in out.stderr, out.stderr
    assert "initial_learning_rate" not in out.stderr


@pytest.mark.parametrize("bn_ema", ["empty", "one-missing"])
def test_a_checkpoint_without_its_bn_averages_is_one_error(data, reference, tmp_path, bn_ema):
    # The run averages its BN statistics (--ema_decay): a checkpoint without that average resumed with
    # the averages as the new process built them (BN's initial 0 and 1), and went on averaging from there.
    from fasttrain.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(reference / "ckpt-14.pt")
    assert state["bn_ema"]  # the reference run's own checkpoint has it
    if bn_ema == "empty":
        state["bn_ema"] = {}
    else:
        del state["bn_ema"][next(iter(state["bn_ema"]))]
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, 14, state)
    out = subprocess.run(command(data, run_dir, "--max_steps=16"), env=ENV, capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    why = "holds no EMA of the BatchNorm statistics" if bn_ema == "empty" else "'bn_ema' lacks "
    assert f"{run_dir / 'ckpt-14.pt'} does not fit this run's model/optimizer" in out.stderr, out.stderr
    assert why in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_run_begun_from_a_checkpoint_dir_goes_on_from_its_own_checkpoints(data, tmp_path):
    # "run the same command to resume" went back to checkpoint_dir's newest: the steps since were done
    # again, their metrics rows dropped and their checkpoints overwritten.
    source, run_dir, other = tmp_path / "source", tmp_path / "run", tmp_path / "other"
    run = lambda *args: subprocess.run(command(data, *args), env=ENV, capture_output=True, text=True)  # noqa: E731
    assert run(source, "--max_steps=4").returncode == 0
    first = run(run_dir, f"--checkpoint_dir={source}", "--max_steps=6")
    assert first.returncode == 0 and f"resuming from step 4 ({source / 'ckpt-4.pt'})" in first.stdout, (
        first.stdout
    )
    again = run(run_dir, f"--checkpoint_dir={source}", "--max_steps=8")
    assert again.returncode == 0, again.stderr
    assert f"resuming from step 6 ({run_dir / 'ckpt-6.pt'})" in again.stdout, again.stdout
    assert f"holds this run's own checkpoints (it began from {source})" in again.stdout
    assert metric_steps(run_dir) == sorted(set(metric_steps(run_dir)))  # each step once
    # A directory holding another run's checkpoints (begun there): continuing source into it is refused.
    assert run(other, "--max_steps=2").returncode == 0
    refused = run(other, f"--checkpoint_dir={source}", "--max_steps=6")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert (
        f"--train_dir {other} holds checkpoints of another run (its run.json says it began there)"
        in refused.stderr
    )


def test_a_resume_on_other_data_says_so(data, tmp_path):
    # --data_dir is bookkeeping (the same shards may move), but other shards change the epoch position
    # and every schedule counted in epochs: the resume said only "resuming from step 4".
    other = tmp_path / "other-data"
    make_synthetic(other, train_shards=2, val_shards=1, per_shard=60, classes=4, seed=5)
    run_dir = tmp_path / "run"
    run = lambda d, *args: subprocess.run(command(d, run_dir, *args), env=ENV, capture_output=True, text=True)  # noqa: E731
    assert run(data, "--max_steps=4").returncode == 0
    same = run(data, "--max_steps=6")
    assert same.returncode == 0 and "note: settings changed" not in same.stdout, same.stdout
    moved = run(other, "--max_steps=8")
    assert moved.returncode == 0, moved.stderr
    assert (
        "note: settings changed since that checkpoint: training records per epoch 48 -> 120" in moved.stdout
    )


def test_refused_resume_keeps_the_runs_config(data, tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.run(command(data, run_dir, "--max_steps=2"), env=ENV, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    config = (run_dir / "config.json").read_text()
    refused = subprocess.run(
        command(data, run_dir, "--max_steps=4", "--optimizer=momentum"),
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1 and "(optimizer 'rmsprop' -> 'momentum')" in refused.stderr, refused.stderr
    assert (run_dir / "config.json").read_text() == config


def test_a_checkpoint_dir_that_does_not_fit_is_not_answered_with_a_new_train_dir(data, tmp_path):
    # The run continues another directory's run into its own --train_dir: a new --train_dir, which the
    # message used to suggest, changes nothing; the settings, or starting from the weights alone, do.
    source, run_dir = tmp_path / "source", tmp_path / "run"
    first = subprocess.run(command(data, source, "--max_steps=2"), env=ENV, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    refused = subprocess.run(
        command(data, run_dir, f"--checkpoint_dir={source}", "--max_steps=4", "--optimizer=momentum"),
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    line = refused.stderr
    assert (
        f"{source / 'ckpt-2.pt'} does not fit this run's model/optimizer (optimizer 'rmsprop' -> 'momentum')"
        in line
    )
    assert f"the settings it was written with ({source / 'config.json'})" in line, line
    assert "--pretrained_model_checkpoint_path" in line and "new --train_dir" not in line, line


# --- metrics.jsonl after a resume: each step once --------------------------------------------------


def test_a_resume_drops_the_rows_past_its_step_and_keeps_the_rest(data, tmp_path):
    # A run killed after logging step 5, whose last checkpoint is step 4, while writing step 6's row;
    # an evaluator's row for ckpt-4 came in between. The resume from 4 logs 5 and 6 again.
    run_dir = tmp_path / "run"
    first = subprocess.run(command(data, run_dir, "--max_steps=5"), env=ENV, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    for name in ("ckpt-5.pt", "ckpt-5.pt.sha256"):  # as if killed before step 5's checkpoint
        (run_dir / name).unlink()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"time": 1.0, "step": 4, "split": "validation", "source": "evaluate", "top1": 0.5}\n')
        f.write('{"time": 2.0, "step": 6, "loss": 1.')  # torn: the kill came mid-write
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    again = subprocess.run(command(data, run_dir, "--max_steps=6"), env=ENV, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "metrics.jsonl: dropped 2 line(s) past step 4, which this run logs again" in again.stdout
    after = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert after[:4] == before[:4] and after[4] == before[5]  # rows 1-4 and the evaluator's, byte for byte
    assert metric_steps(run_dir) == [1, 2, 3, 4, 4, 5, 6]
    train = [json.loads(line)["step"] for line in after if "loss" in json.loads(line)]
    assert train == [1, 2, 3, 4, 5, 6]
    records, evals = read_metrics(run_dir)  # fasttrain.plot's reader
    assert sorted(records) == [1, 2, 3, 4, 5, 6] and list(evals) == [4]
    if importlib.util.find_spec("pandas"):  # not a test dependency; every line being JSON is what it needs
        import pandas

        frame = pandas.read_json(run_dir / "metrics.jsonl", lines=True)
        assert frame[frame["loss"].notna()]["step"].is_unique


def test_a_resume_notes_that_it_does_not_read_the_pretrained_checkpoint(data, reference, tmp_path):
    # The seeds restore pretrained_model_checkpoint_path at step 0 only, and so does fasttrain; the
    # same command run again resumed without a word about the flag it then left unread.
    run_dir = tmp_path / "run"
    pretrained = f"--pretrained_model_checkpoint_path={reference / 'ckpt-14.pt'}"
    first = subprocess.run(
        command(data, run_dir, "--max_steps=2", pretrained), env=ENV, capture_output=True, text=True
    )
    assert first.returncode == 0 and "is not read" not in first.stdout, first.stderr[-2000:]
    again = subprocess.run(
        command(data, run_dir, "--max_steps=4", pretrained), env=ENV, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert (
        "pretrained_model_checkpoint_path" in again.stdout and "is not read: this run resumes" in again.stdout
    )


def test_a_resume_on_other_ranks_keeps_the_runs_count_of_skipped_records():
    # Every rank went on from rank 0's count: after the log began summing the ranks' counts (it had
    # shown rank 0's alone), 3 ranks resumed from counts [1, 2] would have said 3 x 1.
    from fasttrain.config import make_config
    from fasttrain.resume import _data_position

    class Loader:
        def __len__(self):
            return 10  # batches per epoch and rank

    state = {
        "data": [{"epoch": 0, "batch": 2, "skipped": 1}, {"epoch": 0, "batch": 2, "skipped": 2}],
        "world_size": 2,
        "config": {"batch_size": 4},
    }
    data, note = _data_position(state, make_config(batch_size=4, device="cpu"), 3, Loader())
    assert [d["skipped"] for d in data] == [3, 0, 0] and "data position" in note


def test_a_three_rank_resume_is_bit_exact(data, tmp_path):
    # On 3 ranks the first resumed step all-reduced its gradients in the flat buffer's first-step
    # layout (the uninterrupted run had re-laid it in the observed order after its first step), and
    # gloo's ring, summing 3 ranks' values in another order, rounded otherwise: the run parted at
    # 1e-8 and then grew apart. The checkpoint now keeps the layout (TrainStep's bucket_order).
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    flags = ("--optimizer=momentum", "--image_size=64", "--batch_size=4")
    for run_dir, steps in ((whole, 6), (resumed, 3), (resumed, 6)):
        target = ["-m", "fasttrain", *command(data, run_dir, *flags, f"--max_steps={steps}")[3:]]
        (out,) = run_torchrun(target, nproc=3, env=ENV)
        assert out.returncode == 0, out.stdout[-3000:]
    a = torch.load(whole / "ckpt-6.pt", weights_only=True)
    b = torch.load(resumed / "ckpt-6.pt", weights_only=True)
    assert a["train_step"]["bucket_order"] == b["train_step"]["bucket_order"]
    differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    assert not differ, differ
    assert losses(whole) == losses(resumed)
