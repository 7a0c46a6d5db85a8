"""Flag mistakes that used to train the wrong thing silently or end in a traceback: refused in one line.

Each case here was reproduced before its check existed: --resnet_size 50 --model resnet101 trained a
ResNet-50, --seed -1 stopped in NumPy's SeedSequence, --optimizer_impl triton on the CPU in a
RuntimeError from the optimizer, Inception v3 below 299 px in avg_pool2d inside the aux head.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from fasttrain.config import INCEPTION_MIN_IMAGE_SIZE, ConfigError
from fasttrain.flags import parse_args
from fasttrain.models import create_model


def _refused(argv, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_args(argv)


def test_resnet_size_and_a_different_model_conflict():
    _refused(["--resnet_size", "50", "--model", "resnet101"], "--resnet_size=50 and --model=resnet101")
    _refused(["--model=inception_v3", "--resnet_size=18"], "conflict")
    # Agreeing, or one of them from the recipe, is fine: the flag overrides the recipe.
    assert parse_args(["--resnet_size=50", "--model=resnet50"]).model == "resnet50"
    assert parse_args(["--recipe=resnet101_v1.5", "--resnet_size=50"]).model == "resnet50"
    assert parse_args(["--recipe=resnet101", "--resnet_size=50"]).model == "resnet50_v2"
    assert parse_args(["--recipe=resnet101", "--model=resnet152"]).model == "resnet152"
    assert parse_args(["--resnet_size=50", "--model=resnet50_v2"]).model == "resnet50_v2"
    _refused(
        ["--resnet_size=50", "--model=resnet101_v2"], "--resnet_size=50 and --model=resnet101_v2 conflict"
    )


def test_resnet_size_200_is_a_v2_model_only():
    assert parse_args(["--recipe=resnet50", "--resnet_size=200"]).model == "resnet200_v2"
    _refused(["--recipe=resnet50_v1.5", "--resnet_size=200"], "--resnet_size=200 is a v2 model only")
    _refused(["--resnet_size=201"], "--resnet_size=201 is not one of 18, 34, 50, 101, 152, 200")


def test_a_seed_alias_and_its_field_with_different_values_conflict():
    _refused(["--train_dir=a", "--output_dir=b"], "--train_dir=a and --output_dir=b")
    _refused(
        ["--epochs_per_eval=2", "--eval_every_epochs=1"], "--epochs_per_eval=2 and --eval_every_epochs=1"
    )
    _refused(["--learning-rate=0.2", "--initial_learning_rate=0.1"], "conflict")
    _refused(["--batch-norm-decay=0.9", "--bn_momentum=0.5"], "--batch-norm-decay=0.9 and --bn_momentum=0.5")
    assert parse_args(["--batch_size=8", "--batch_size=16"]).batch_size == 16  # a repeat: the last wins


def test_a_node_batch_and_a_process_batch_conflict():
    # One node's batch is divided into the per-process one: both given, which was meant?
    _refused(["--train_batch_size=64", "--batch_size=32"], "--train_batch_size=64 (one node's batch")
    _refused(["--train-batch-size=64", "--batch_size=64"], "and --batch_size=64 (one process's) conflict")
    # A per-process batch alone replaces the recipe's node batch.
    cfg = parse_args(["--recipe=resnet50", "--batch_size=32"])
    assert (cfg.batch_size, cfg.node_batch_size) == (32, 0)


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_seed_must_be_a_32_bit_non_negative_integer(seed):
    _refused([f"--seed={seed}"], "--seed must")
    assert parse_args([f"--seed={2**32 - 1}"]).seed == 2**32 - 1


def test_triton_optimizer_on_the_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _refused(["--optimizer_impl=triton", "--device=cpu"], "--optimizer_impl=triton needs a CUDA device")
    if not torch.cuda.is_available():
        _refused(["--optimizer_impl=triton"], "this run is on the CPU")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # how the tests run the kernels on the CPU
    assert parse_args(["--optimizer_impl=triton", "--device=cpu"]).optimizer_impl == "triton"


@pytest.mark.parametrize("size", [64, 75, INCEPTION_MIN_IMAGE_SIZE - 1])
def test_inception_below_its_minimum_image_size_is_refused(size):
    _refused(["--recipe=inception_v3", f"--image_size={size}"], "at least 299")
    _refused(["--model=inception_v3", f"--image_size={size}"], f"got {size}")


@pytest.mark.parametrize(
    "argv, words",
    [
        # Trained, then a ZeroDivisionError in the resize at the first evaluation.
        (["--image_size=1"], "--image_size must be at least 8, got 1"),
        # A TypeError from torch DDP's Reducer on every rank.
        (["--grad_sync=ddp", "--bucket_cap_mb=1e300"], "--bucket_cap_mb must be at most 1,048,576 MiB"),
    ],
)
def test_values_that_failed_later_with_a_traceback_are_refused_at_once(argv, words):
    _refused(argv, words)


def test_inception_given_as_the_model_takes_its_own_width():
    # The demo recipe's ResNet width (16) came along, and the error named a --base_channels never typed.
    cfg = parse_args(["--model=inception_v3", "--image_size=299"])
    assert (cfg.model_name, cfg.base_channels) == ("inception_v3", 64)
    given = parse_args(["--model=inception_v3", "--image_size=299", "--base_channels=16"])
    assert given.base_channels == 16  # typed: kept, and create_model names it


def test_the_inception_minimum_is_where_the_model_stops_working():
    # The bound checked against the model itself (train mode, aux head on, as the trainer builds it),
    # on the meta device: shapes and their checks without the arithmetic (1 s instead of 40 s).
    with torch.device("meta"):
        model = create_model("inception_v3", 5).train()
    small, enough = INCEPTION_MIN_IMAGE_SIZE - 1, INCEPTION_MIN_IMAGE_SIZE
    with pytest.raises(RuntimeError):
        model(torch.zeros(2, 3, small, small, device="meta"))
    logits, aux = model(torch.zeros(2, 3, enough, enough, device="meta"))
    assert logits.shape == aux.shape == (2, 5)
    assert parse_args(["--recipe=inception_v3", f"--image_size={INCEPTION_MIN_IMAGE_SIZE}"])


def test_the_cli_prints_one_line_and_exits_2(tmp_path):
    out = subprocess.run(
        # Synthetic batches and one step: without the check this trains (briefly) instead of refusing.
        [sys.executable, "-m", "fasttrain", "--resnet_size", "50", "--model", "resnet101"]
        + ["--data_backend=synthetic", "--max_steps=1", "--eval_at_end=false", "--image_size=32"],
        env={**os.environ, "FASTTRAIN_CACHE": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "conflict" in out.stderr and "Traceback" not in out.stderr


def test_more_micro_batches_than_an_epoch_holds_is_refused(tmp_path):
    # A step's micro-batches come from one epoch: with 6 batches an epoch and 7 to a step, the trainer
    # went from epoch to epoch making no step, at full CPU, and SIGINT and SIGTERM could not stop it.
    from fasttrain.data.synthetic import make_synthetic

    data = tmp_path / "data"
    make_synthetic(data, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)  # 48 records
    out = subprocess.run(
        [sys.executable, "-m", "fasttrain", f"--data_dir={data}", "--num_classes=4", "--batch_size=8"]
        + ["--grad_accum_steps=7", "--max_steps=1", "--image_size=32", "--num_workers=0", "--device=cpu"]
        + [f"--train_dir={tmp_path / 'run'}"],
        env={**os.environ, "FASTTRAIN_CACHE": str(tmp_path)},
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and "an epoch holds 6 batches per rank, fewer than " in out.stderr
    assert "--grad_accum_steps 7: no step can be made" in out.stderr


# --- a flag missing its value ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, flag",
    [
        # Both took the next flag as the value: the first created ./--max_steps=3/ and trained 300 steps,
        # the second ended in "unexpected argument 'X'".
        (["--train_dir", "--max_steps=3"], "--train_dir"),
        (["--data_dir", "--train_dir", "X"], "--data_dir"),
        (["--recipe", "--max_steps=3"], "--recipe"),
        (["--max_steps=3", "--lr_boundary_epochs", "--seed=1"], "--lr_boundary_epochs"),
        (["--output_dir", "--train-batch-size=32"], "--output_dir"),  # a seed's spelling too
    ],
)
def test_a_flag_followed_by_another_flag_needs_a_value(argv, flag):
    _refused(argv, f"{flag} needs a value")


def test_values_that_look_like_flags_are_still_possible():
    assert parse_args(["--train_dir=--odd"]).train_dir == "--odd"  # spelled with =
    assert parse_args(["--train_dir", "-odd"]).train_dir == "-odd"  # one dash is not a flag
    _refused(["--seed", "-1"], "--seed must")  # a negative number is a value, refused as such
    # Booleans and the seeds' noted flags take no value: the next flag stays a flag.
    cfg = parse_args(["--deterministic", "--max_steps=3", "--log_dir", "--seed=2"])
    assert (cfg.deterministic, cfg.max_steps, cfg.seed) == (True, 3, 2)


def test_the_cli_refuses_a_missing_value_before_making_anything(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "fasttrain", "--train_dir", "--max_steps=3"],
        env={**os.environ, "FASTTRAIN_CACHE": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and "--train_dir needs a value" in out.stderr, out.stderr
    assert list(tmp_path.iterdir()) == []  # no ./--max_steps=3/, no demo data set


# --- a flag this configuration never reads ---------------------------------------------------------


def test_a_flag_without_effect_here_gets_a_note(capsys):
    # These trained a ResNet-18 with momentum and the exponential schedule without a word: the user
    # asked for something that did not happen.
    parse_args(
        ["--aux_loss_weight=0.4", "--inception_bn_gamma", "--rmsprop_decay=0.5", "--lr_boundary_epochs=1,2"]
    )
    assert capsys.readouterr().err.splitlines() == [
        "fasttrain: note: --rmsprop_decay has no effect: the optimizer is momentum",
        "fasttrain: note: --lr_boundary_epochs has no effect: lr_schedule is exponential",
        "fasttrain: note: --aux_loss_weight has no effect: resnet18 has no aux head",
        "fasttrain: note: --inception_bn_gamma has no effect: the model is resnet18",
    ]
    # Where they apply, and where a recipe (not the command line) sets them: nothing to say.
    parse_args(
        ["--recipe=inception_v3", "--aux_loss_weight=0.4", "--rmsprop_decay=0.5", "--num_epochs_per_decay=2"]
    )
    parse_args(["--recipe=resnet50", "--lr_schedule=piecewise", "--lr_boundary_epochs=1,2"])
    parse_args(["--recipe=resnet50"])
    assert capsys.readouterr().err == ""


def test_train_epochs_sets_the_length_a_recipe_s_max_steps_would_have(capsys):
    # The demo recipe sets max_steps 300, the Inception seed's 10,000,000: --train_epochs alone was
    # overruled by them without a word (0.2 epochs of 10 steps trained 300 steps).
    from fasttrain.flags import parse_command_line

    for recipe in ("demo", "inception_v3"):
        cfg, _ = parse_command_line([f"--recipe={recipe}", "--train_epochs=0.2"])
        assert (cfg.max_steps, cfg.train_epochs) == (0, 0.2)
    assert capsys.readouterr().err == ""
    cfg, _ = parse_command_line(["--train_epochs=2", "--max_steps=10"])  # both given: max_steps, said
    assert cfg.max_steps == 10
    assert "--train_epochs has no effect: max_steps 10 sets the run's length" in capsys.readouterr().err


def test_more_flags_without_effect_get_a_note(capsys):
    parse_args(["--recipe=resnet50", "--model=resnet18_v2", "--zero_init_residual"])
    parse_args(["--no-tensorboard", "--histogram_every=100"])
    parse_args(["--recipe=resnet50", "--color_distort"])  # the DALI backend distorted them all the same
    assert capsys.readouterr().err.splitlines() == [
        "fasttrain: note: --zero_init_residual has no effect: resnet18_v2's blocks end in no BN to zero "
        "(v1.5 ResNets' do)",
        "fasttrain: note: --histogram_every has no effect: tensorboard is off (histograms go to TensorBoard)",
        "fasttrain: note: --color_distort has no effect: preprocess is vgg (the distortion is Inception "
        "preprocessing's)",
    ]


# --- TF's (absl's) spelling of a boolean's false ----------------------------------------------------


def test_tf_noflag_booleans_are_false(capsys, monkeypatch):
    # inception_train.py's DEFINE_boolean flags, as TF spells them false: --nofine_tune was "unknown flag
    # --nofine_tune; did you mean --fine_tune?", and following that advice turned fine-tuning on.
    monkeypatch.delenv("RANK", raising=False)
    pretrained = ["--recipe=inception_v3", "--pretrained_model_checkpoint_path=p"]
    assert parse_args([*pretrained, "--fine_tune", "--nofine_tune"]).fine_tune is False
    assert parse_args([*pretrained, "--nofine_tune", "--fine_tune"]).fine_tune is True  # the last wins
    assert parse_args(["--nocompile"]).compile is False
    assert parse_args(["--no_decay_bn"]).no_decay_bn is True  # a field of its own, not --decay_bn's false
    capsys.readouterr()
    # A noted flag's false gets the note its true gets, and takes no value (the next word is not eaten).
    cfg = parse_args(["--recipe=inception_v3", "--nolog_device_placement", "--max_steps", "7"])
    assert cfg.max_steps == 7
    assert capsys.readouterr().err.splitlines() == [
        "fasttrain: note: --nolog_device_placement is accepted for the seeds' command lines: one process "
        "per device (torchrun's LOCAL_RANK) holds the whole model; there is no placement to log"
    ]
    _refused(["--nofine_tune=true"], "--nofine_tune takes no value")
    _refused(["--nomax_steps"], "--max_steps takes a value")
    _refused(["--nofoo"], "unknown flag --nofoo")


# --- the distributed Inception seed's flags ----------------------------------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--job_name=worker", "--task_id=0", "--ps_hosts=a:2222", "--worker_hosts=b:2222"], "torchrun"),
        (["--ps_hosts", "a:2222"], "launch with torchrun --nnodes=N --nproc_per_node=G"),
        (["--num_replicas_to_aggregate=-1"], "all-reduces the gradients of all processes"),
        (["--save_interval_secs=600"], "--checkpoint_every steps"),
        (["--save_summaries_secs=180"], "--log_every steps"),
    ],
)
def test_the_distributed_seeds_flags_say_what_to_give_instead(argv, words, capsys, monkeypatch):
    # inception_distributed_train.py's: each was "unknown flag --job_name (python -m fasttrain --help
    # lists the flags)", pointing nowhere.
    from fasttrain.__main__ import main

    monkeypatch.delenv("RANK", raising=False)
    assert main(["--recipe=inception_v3", *argv, "--train_dir=/t"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"fasttrain: error: {argv[0].partition('=')[0]}") or "--job_name/" in line, line
    assert words in line and "unknown flag" not in line, line


def test_a_flag_error_is_printed_once_per_node_and_ctrl_c_at_start_up_is_one_line(monkeypatch, capsys):
    # Under torchrun every rank printed the same error (8 lines for one mistake on an 8-GPU node); and
    # Ctrl-C while torch was still being imported ended in a KeyboardInterrupt traceback.
    import fasttrain.flags
    from fasttrain.__main__ import main

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(["--max_step=3"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["--max_step=3"]) == 2
    assert capsys.readouterr().err.count("--max_step") >= 1

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(fasttrain.flags, "parse_command_line", interrupted)
    assert main(["--max_steps=3"]) == 130
    assert capsys.readouterr().err == (
        "fasttrain: interrupted before training began; nothing was written to resume from\n"
    )
