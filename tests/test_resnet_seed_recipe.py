"""The resnet50/resnet101 recipes are the ResNet seed's program (issue 27 item 3), and the seeds' command
lines are taken as they are spelled (issue 30 item 3); config.json is the resolved run (issue 30 item 5).

The expected values are read off the seed's code (ucloud/uai-sdk examples/tensorflow/train/imagenet/code/,
Dec 2017), not off fasttrain: imagenet_main.py's flag defaults and model_fn, imagenet.py's make_batch,
resnet_model.py's BN constants. None of these tests builds a v2 model except the one that says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

import fasttrain.train
from fasttrain.config import RECIPES, Config, ConfigError
from fasttrain.flags import parse_args
from fasttrain.models import MODEL_NAMES
from fasttrain.resume import changed_settings, shaping_changes
from fasttrain.run_config import processes_per_node, resolve_node_batch, upgrade_saved_config
from fasttrain.schedule import LRSchedule

NUM_TRAIN_IMAGES = 1281167  # imagenet_main.py _NUM_IMAGES['train']


def seed_boundaries(train_batch_size: int, num_workers: int) -> list[int]:
    # imagenet_main.py model_fn, transcribed: Python 3 division (the file imports division), a float
    batches_per_epoch = NUM_TRAIN_IMAGES / (train_batch_size * num_workers)
    return [int(batches_per_epoch * epoch) for epoch in [30, 60, 80, 90]]


def seed_learning_rate(step: int, boundaries: list[int], learning_rate: float = 0.1) -> float:
    # tf.train.piecewise_constant(global_step, boundaries, [lr * d for d in [1, 0.1, 0.01, 1e-3, 1e-4]]):
    # values[i] for boundaries[i-1] < step <= boundaries[i]
    values = [learning_rate * decay for decay in [1, 0.1, 0.01, 1e-3, 1e-4]]
    return values[sum(step > b for b in boundaries)]


# --- every row of the table -----------------------------------------------------------------


@pytest.mark.parametrize("size", [50, 101])
def test_the_recipe_is_the_seeds_program(size):
    cfg = parse_args([f"--recipe=resnet{size}"])
    assert cfg.model == f"resnet{size}_v2"  # imagenet_resnet_v2(resnet_size, 1000 + 1)
    assert (cfg.num_classes, cfg.label_offset) == (1001, 0)  # labels as stored, background 0 kept
    assert (cfg.preprocess, cfg.image_size) == ("vgg", 224)  # vgg_preprocessing, _DEFAULT_IMAGE_SIZE
    assert (cfg.optimizer, cfg.momentum, cfg.initial_learning_rate) == ("momentum", 0.9, 0.1)
    assert cfg.lr_batch_scaling is False  # staged_lr = learning_rate * decay, no batch factor
    assert (cfg.lr_schedule, cfg.lr_boundary_epochs, cfg.learning_rate_decay_factor) == (
        "piecewise",
        [30.0, 60.0, 80.0, 90.0],
        0.1,
    )
    # 1e-4 * sum(tf.nn.l2_loss(v)) over tf.trainable_variables(): no variable exempt
    assert (cfg.weight_decay, cfg.no_decay_bn_bias) == (1e-4, False)
    # _BATCH_NORM_DECAY 0.997 (torch momentum 1 - decay), _BATCH_NORM_EPSILON 1e-5 raised by fused BN
    assert cfg.bn_momentum == pytest.approx(0.003, abs=1e-15) and cfg.bn_eps == 1.001e-5
    assert cfg.zero_init_residual is False  # tf.layers.batch_normalization: gamma 1
    assert (cfg.max_steps, cfg.train_epochs, cfg.eval_every_epochs) == (0, 100.0, 1.0)
    assert (cfg.node_batch_size, cfg.eval_batch_size) == (128, 100)  # --train-batch-size, --eval-batch-size
    assert (cfg.input_order, cfg.shuffle_buffer) == ("one_stream", 1500)  # _SHUFFLE_BUFFER


@pytest.mark.parametrize("size", [18, 34, 50, 101, 152, 200])
def test_resnet_size_selects_within_the_seeds_v2_models(size):
    # imagenet_main.py: --resnet_size choices [18, 34, 50, 101, 152, 200], default 50
    for recipe in ("resnet50", "resnet101"):
        cfg = parse_args([f"--recipe={recipe}", f"--resnet_size={size}"])
        assert (cfg.model, cfg.resnet_size) == (f"resnet{size}_v2", size)
    if size != 200:  # the v1.5 recipes keep their family
        assert parse_args(["--recipe=resnet50_v1.5", f"--resnet_size={size}"]).model == f"resnet{size}"


def test_the_v15_recipes_keep_the_2018_program():
    for size in (50, 101):
        cfg = RECIPES[f"resnet{size}_v1.5"]
        assert (cfg.model, cfg.preprocess, cfg.num_classes, cfg.label_offset) == (
            f"resnet{size}",
            "resnet",
            1000,
            -1,
        )
        assert (cfg.lr_batch_scaling, cfg.train_epochs, cfg.batch_size, cfg.node_batch_size) == (
            True,
            90.0,
            32,
            0,
        )


# --- the batch: one node's, divided over its processes -------------------------------------------------


def test_the_seeds_boundaries_for_one_node_of_four_processes_at_128():
    cfg = resolve_node_batch(parse_args(["--recipe=resnet101", "--train-batch-size=128"]), 4)
    assert cfg.batch_size == 32  # int(batch_size / num_shards) per tower
    global_batch = cfg.batch_size * 4  # one node: the seed's train_batch_size * num_workers (1)
    schedule = LRSchedule(cfg, NUM_TRAIN_IMAGES / global_batch, global_batch)
    # 1,281,167 / 128 = 10009.1171875 batches per epoch; x 30, 60, 80, 90, truncated
    assert schedule.boundaries == seed_boundaries(128, 1) == [300273, 600547, 800729, 900820]
    for boundary in schedule.boundaries:
        for step in (boundary - 1, boundary, boundary + 1):
            # The seed multiplies 0.1 by the literals 0.01, 1e-3, 1e-4, fasttrain by 0.1 ** k: the two
            # float64 products may differ in the last bit (relative 2e-16), hence rel=1e-12.
            assert schedule.at(step) == pytest.approx(
                seed_learning_rate(step, schedule.boundaries), rel=1e-12
            )
    assert [schedule.at(0), schedule.at(900821)] == pytest.approx([0.1, 1e-5], rel=1e-12)
    # Two such nodes: the boundaries halve, as the seed's num_workers divides them.
    two_nodes = LRSchedule(cfg, NUM_TRAIN_IMAGES / (2 * global_batch), 2 * global_batch)
    assert two_nodes.boundaries == seed_boundaries(128, 2) == [150136, 300273, 400364, 450410]


def test_the_trainer_builds_the_schedule_from_the_node_batch(tmp_path, monkeypatch):
    # train() itself, one process: the float batches per epoch reach the schedule (an integer 10009
    # would put the first boundary at 300270), and config.json holds the batch as resolved. A v1.5
    # ResNet-18 and the 2018 input scaling stand in for the v2 model and vgg, which this test does not need.
    built = []

    def recording_schedule(*args, **kwargs):
        built.append(LRSchedule(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(fasttrain.train, "LRSchedule", recording_schedule)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = parse_args(
        ["--recipe=resnet101", "--train-batch-size=128", f"--epoch_size={NUM_TRAIN_IMAGES}", "--max_steps=1"]
        + ["--model=resnet18", "--preprocess=resnet", "--base_channels=8", "--image_size=16"]
        + ["--data_backend=synthetic", "--tensorboard=false"]
        + ["--device=cpu", "--eval_at_end=false", "--num_workers=0", f"--train_dir={tmp_path / 'run'}"]
    )
    fasttrain.train.train(cfg)
    assert built[0].boundaries == seed_boundaries(128, 1)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["node_batch_size"], saved["batch_size"], saved["model"]) == (128, 128, "resnet18")


@pytest.mark.parametrize(
    "processes, per_process, eval_per_process", [(1, 128, 100), (2, 64, 50), (4, 32, 25)]
)
def test_the_node_batch_is_divided_over_the_nodes_processes(processes, per_process, eval_per_process):
    cfg = resolve_node_batch(parse_args(["--recipe=resnet50"]), processes)
    assert (cfg.node_batch_size, cfg.batch_size, cfg.eval_batch_per_process) == (
        128,
        per_process,
        eval_per_process,
    )
    # 8 processes: the seed's eval batch of 100 does not divide (the seed refused it too); a given one does.
    eight = resolve_node_batch(parse_args(["--recipe=resnet50", "--eval-batch-size=96"]), 8)
    assert (eight.batch_size, eight.eval_batch_per_process) == (16, 12)


def test_a_batch_that_does_not_divide_is_one_clear_error(tmp_path):
    said = "--node_batch_size=130 (the ResNet seed's --train-batch-size, or --batch_size with --num_gpus)"
    with pytest.raises(ConfigError, match=re.escape(said)):
        resolve_node_batch(parse_args(["--recipe=resnet50", "--train-batch-size=130"]), 4)
    said = "--eval_batch_size=100 (the ResNet seed's --eval-batch-size)"
    with pytest.raises(ConfigError, match=re.escape(said)):
        resolve_node_batch(parse_args(["--recipe=resnet50", "--train-batch-size=129"]), 3)
    # Through the command line, as torchrun --nproc_per_node=3 sets it: one line, exit code 2.
    out = subprocess.run(
        [sys.executable, "-m", "fasttrain", "--recipe=resnet50", "--train-batch-size=128", "--model=resnet18"]
        + ["--data_backend=synthetic", "--max_steps=1", f"--train_dir={tmp_path / 'run'}"],
        env={**os.environ, "LOCAL_WORLD_SIZE": "3", "FASTTRAIN_CACHE": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "does not divide over its 3 processes (torchrun --nproc_per_node=3)" in out.stderr
    assert not (tmp_path / "run").exists()


def test_a_node_batch_without_the_nodes_process_count_is_one_clear_error(monkeypatch, tmp_path):
    # A launcher other than torchrun (WORLD_SIZE without LOCAL_WORLD_SIZE): every process trained the
    # whole node's batch of 128.
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fasttrain",
            "--recipe=resnet50",
            "--model=resnet18",
            "--data_backend=synthetic",
        ]
        + ["--max_steps=1", f"--train_dir={tmp_path / 'run'}"],
        env={**env, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "FASTTRAIN_CACHE": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "WORLD_SIZE=2 comes without LOCAL_WORLD_SIZE: set LOCAL_WORLD_SIZE" in out.stderr
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="set LOCAL_WORLD_SIZE to the node's process count"):
        processes_per_node(parse_args(["--recipe=resnet50"]).node_batch_size)
    assert processes_per_node(parse_args(["--recipe=resnet50", "--batch_size=48"]).node_batch_size) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert processes_per_node(128) == 4


def test_a_per_process_batch_replaces_the_recipes_node_batch():
    cfg = resolve_node_batch(parse_args(["--recipe=resnet50", "--batch_size=48"]), 4)
    assert (cfg.node_batch_size, cfg.batch_size) == (0, 48)


# --- the seeds' flags --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, field, value",
    [
        (["--train-batch-size=64"], "node_batch_size", 64),
        (["--train-batch-size", "64"], "node_batch_size", 64),
        (["--resnet_size=34"], "model", "resnet34_v2"),
        (["--data_dir=/data/imagenet"], "data_dir", "/data/imagenet"),
        (["--output_dir", "/out"], "train_dir", "/out"),
        (["--num_gpus=4"], "num_gpus", 4),
        (["--train-epochs=90"], "train_epochs", 90.0),
        (["--epochs_per_eval=2"], "eval_every_epochs", 2.0),
        (["--learning-rate=0.2"], "initial_learning_rate", 0.2),
        (["--momentum=0.8"], "momentum", 0.8),
        (["--weight-decay=2e-4"], "weight_decay", 2e-4),
        (["--batch-norm-decay=0.99"], "bn_momentum", 1 - 0.99),  # TF's decay, torch's momentum
        (["--batch-norm-epsilon=1e-3"], "bn_eps", 1e-3),
        (["--batch-norm-epsilon=1e-5"], "bn_eps", 1.001e-5),  # TF 1.4's fused floor
        (["--eval-batch-size=200"], "eval_batch_size", 200),
    ],
)
def test_every_seed_flag_parses_to_its_field(argv, field, value):
    assert getattr(parse_args(["--recipe=resnet101", *argv]), field) == value


def test_the_seeds_readme_command_line():
    # "The simplest CMD": /data/imagenet_main.py --train-batch-size=32 --resnet_size=101, with the UAI
    # SDK's own flags added by its platform.
    cfg = parse_args(
        ["--recipe=resnet50", "--train-batch-size=32", "--resnet_size=101", "--num_gpus=1"]
        + ["--data_dir=/data/data", "--output_dir=/data/output", "--work_dir=/data", "--log_dir=/data/data/"]
    )
    assert (cfg.model, cfg.node_batch_size, cfg.train_dir, cfg.data_dir) == (
        "resnet101_v2",
        32,
        "/data/output",
        "/data/data",
    )


_NOTED = [
    "--work_dir=/data/",
    "--log_dir",
    "/data/data/",
    "--num_preprocess_threads=4",
    "--num_readers",
    "4",
    "--input_queue_memory_factor=16",
    "--log_device_placement",
    "--data_format=channels_first",
]


def test_the_seeds_other_flags_are_noted_once_and_change_nothing(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    # Both seeds' flags: --recipe names the recipe (tests/test_seed_command_lines.py: without it, which?)
    cfg = parse_args(["--recipe=demo", *_NOTED, "--work_dir", "/again", "--max_steps=5"])  # noted once
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 7 and all(line.startswith("fasttrain: note: --") for line in err)
    for flag in ("work_dir", "log_dir", "num_preprocess_threads", "num_readers", "input_queue_memory_factor"):
        assert sum(f"--{flag} is accepted" in line for line in err) == 1
    # The default torch loader decodes in threads (--loader=threads), as the seed's flag names them.
    preprocess = next(line for line in err if "--num_preprocess_threads" in line)
    assert "--num_workers threads per rank" in preprocess and "--loader=processes" in preprocess, preprocess
    assert "processes" not in next(line for line in err if "--num_readers" in line).replace("--loader=", "")
    assert "--channels_last" in next(line for line in err if "--data_format" in line)
    assert cfg == dataclasses.replace(RECIPES["demo"], max_steps=5)  # no value taken as a setting


def test_notes_come_from_rank_0_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # torchrun's other processes parse the same flags
    parse_args(["--recipe=demo", *_NOTED])
    assert capsys.readouterr().err == ""


def test_a_raised_bn_epsilon_is_noted(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    parse_args(["--batch-norm-epsilon=1e-5", "--batch-norm-decay=0.997"])
    (line,) = capsys.readouterr().err.splitlines()
    assert "--batch-norm-epsilon=1e-05 sets --bn_eps=1.001e-05" in line


@pytest.mark.parametrize(
    "typed, suggested",
    [
        ("--max_step=5", "--max_steps"),
        ("--train-batch-sise=32", "--train_batch_size"),
        ("--num_gpu=2", "--num_gpus"),
        ("--learning_rat=0.1", "--learning_rate"),
        ("--num-preprocess-thread=4", "--num_preprocess_threads"),
        ("--MAX_STEPS=3", "--max_steps"),  # case alone: no suggestion before (difflib's ratio is 0)
        ("--Train-Batch-Size=32", "--train_batch_size"),
    ],
)
def test_an_unknown_flag_suggests_the_closest_known_one(typed, suggested):
    flag = typed.split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(f"unknown flag {flag}; did you mean {suggested}?")):
        parse_args([typed])


def test_a_far_unknown_flag_suggests_nothing():
    with pytest.raises(ConfigError) as err:
        parse_args(["--frobnicate=1"])
    assert "did you mean" not in str(err.value)


def test_help_lists_the_other_entry_points(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for command in ("selfcheck", ".data", ".evaluate", ".plot", ".convert"):
        assert f"python -m fasttrain{' ' if command == 'selfcheck' else ''}{command}" in out


# --- config.json is the resolved run -----------------------------------------------------------------


def test_config_json_holds_the_model_resnet_size_selected():
    saved = json.loads(parse_args(["--recipe=resnet101", "--resnet_size=50"]).to_json())
    assert (saved["model"], saved["resnet_size"]) == ("resnet50_v2", 50)
    assert Config(**saved).model == "resnet50_v2"


def test_an_old_config_json_loads_as_the_run_it_was():
    # Written before this version (no input_order): recipe resnet101 was the 2018 v1.5 program, and
    # "model" was saved as given, beside the resnet_size that chose the model which trained.
    old = {k: v for k, v in dataclasses.asdict(RECIPES["resnet101_v1.5"]).items()}
    for name in ("input_order", "node_batch_size", "eval_batch_size"):
        del old[name]
    old.update(recipe="resnet101", model="resnet101", resnet_size=50)
    upgraded = upgrade_saved_config(old)
    assert (upgraded["recipe"], upgraded["model"]) == ("resnet101_v1.5", "resnet50")
    same = parse_args(["--recipe=resnet101_v1.5", "--resnet_size=50"])
    assert Config(**upgraded) == same and changed_settings(old, same) == []
    # Resumed with today's resnet101 (the seed's v2), the refusal names the right models.
    changes = changed_settings(old, parse_args(["--recipe=resnet101", "--resnet_size=50"]))
    assert "model 'resnet50' -> 'resnet50_v2'" in shaping_changes(changes)


@pytest.mark.skipif("resnet18_v2" not in MODEL_NAMES, reason="the v2 models are not in create_model yet")
def test_a_trained_seed_run_saves_the_v2_model(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = parse_args(
        ["--recipe=resnet101", "--resnet_size=18", "--train-batch-size=8", "--max_steps=1"]
        + ["--base_channels=8", "--image_size=32", "--data_backend=synthetic", "--device=cpu"]
        + ["--eval_at_end=false", f"--train_dir={tmp_path / 'run'}"]
    )
    fasttrain.train.train(cfg)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["model"], saved["resnet_size"], saved["batch_size"]) == ("resnet18_v2", 18, 8)
