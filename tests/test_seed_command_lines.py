"""The seeds' command lines, without --recipe, train the seeds' programs (fasttrain.flags.seed_recipe),
and the demo's own command lines still train the demo.

The ResNet seed's README (ucloud/uai-sdk examples/tensorflow/train/imagenet): "The simplest CMD applied
to run is /data/imagenet_main.py --train-batch-size=32 --resnet_size=101", to which the UAI platform
adds --data_dir, --output_dir, --work_dir, --log_dir and --num_gpus. The Inception seed's README
(tensorflow/models research/inception): `imagenet_train --num_gpus=1 --batch_size=32
--train_dir=/tmp/imagenet_train --data_dir=/tmp/imagenet_data`, `--num_gpus=2 --batch_size=64
--train_dir=/tmp/imagenet_train`, and its fine-tuning line (flowers_train).
"""

import dataclasses
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from launch_helpers import command, trainer_args
from test_cli import run_cli

from fasttrain.config import Config, ConfigError
from fasttrain.data.synthetic import make_synthetic
from fasttrain.flags import (
    BOTH_SEEDS_FLAGS,
    INCEPTION_SEED_FLAGS,
    RESNET_SEED_FLAGS,
    parse_args,
    parse_command_line,
)
from fasttrain.run_config import resolve_node_batch

README = Path(__file__).resolve().parents[1] / "README.md"

RESNET_SIMPLEST = ["--train-batch-size=32", "--resnet_size=101"]
UAI = ["--data_dir=/data/data", "--output_dir=/data/output", "--work_dir=/data", "--log_dir=/data/data/"]
INCEPTION_TRAIN = ["--num_gpus=1", "--batch_size=32", "--train_dir=/tmp/imagenet_train"]
INCEPTION_FLOWERS = [  # flowers_train, the README's fine-tuning command line
    "--train_dir=/tmp/flowers_train/",
    "--data_dir=/tmp/flowers-data/",
    "--pretrained_model_checkpoint_path=/m/inception-v3/model.ckpt-157585",
    "--fine_tune=True",
    "--initial_learning_rate=0.001",
    "--input_queue_memory_factor=1",
]


@pytest.mark.parametrize(
    "argv, recipe, model",
    [
        (RESNET_SIMPLEST, "resnet101", "resnet101_v2"),
        (RESNET_SIMPLEST + UAI + ["--num_gpus=1"], "resnet101", "resnet101_v2"),
        (UAI + ["--num_gpus=1"], "resnet50", "resnet50_v2"),  # the platform's flags alone: size 50
        (["--train-batch-size=64"], "resnet50", "resnet50_v2"),  # imagenet_main.py's default size, 50
        (["--resnet_size=152", "--epochs_per_eval=2"], "resnet50", "resnet152_v2"),  # v2 at any size
        (["--batch-norm-decay=0.99", "--data_dir=/d"], "resnet50", "resnet50_v2"),
        (["--num_gpus=4", "--output_dir=/o", "--data_dir=/d"], "resnet50", "resnet50_v2"),
        (INCEPTION_TRAIN + ["--data_dir=/tmp/imagenet_data"], "inception_v3", "inception_v3"),
        (
            ["--num_gpus=2", "--batch_size=64", "--train_dir=/tmp/imagenet_train"],
            "inception_v3",
            "inception_v3",
        ),
        (INCEPTION_FLOWERS, "inception_v3", "inception_v3"),
        (["--num_readers=4", "--data_dir=/d"], "inception_v3", "inception_v3"),
    ],
)
def test_a_seeds_own_flags_select_its_recipe(argv, recipe, model):
    cfg, line = parse_command_line(argv)
    assert (cfg.recipe, cfg.model) == (recipe, model)
    seed = "the ResNet seed's program" if recipe.startswith("resnet") else "the Inception seed's program"
    assert line.startswith(f"fasttrain: recipe {recipe}: {seed}") and "no --recipe given" in line, line


def test_the_start_up_line_names_the_flags_that_chose():
    _, line = parse_command_line(RESNET_SIMPLEST + UAI)
    assert "selected by its flags --train-batch-size, --resnet_size, --work_dir, --log_dir (" in line
    _, line = parse_command_line(INCEPTION_TRAIN)
    assert "selected by its flags --num_gpus, --train_dir, --batch_size (" in line


def test_a_named_recipe_wins_and_says_nothing():
    cfg, line = parse_command_line(["--recipe=resnet101_v1.5", *RESNET_SIMPLEST])
    assert (cfg.recipe, cfg.model, line) == ("resnet101_v1.5", "resnet101", "")
    cfg, line = parse_command_line(["--recipe=demo", "--num_gpus=2", "--num_readers=4", "--work_dir=/w"])
    assert (cfg.recipe, line) == ("demo", "")


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--work_dir=/w", "--num_readers=4"],
            "--work_dir (the ResNet seed's) and --num_readers (the Inception",
        ),
        (["--num_gpus=1", "--data_dir=/d"], "--num_gpus is in both seeds' command lines and no other flag"),
        (
            ["--num_gpus=1", "--output_dir=/o", "--train_dir=/o"],
            "with --output_dir, --train_dir could be either",
        ),
        (["--log_device_placement"], "--log_device_placement is in both seeds' command lines"),
    ],
)
def test_flags_of_both_programs_name_the_recipe_to_add(argv, words):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert words in str(err.value), err.value
    assert "add --recipe resnet50 or resnet101 (the ResNet seed) or --recipe inception_v3" in str(err.value)


@pytest.mark.parametrize(
    "gpus, batch, processes, per_process", [(1, 32, 1, 32), (2, 64, 2, 32), (8, 256, 8, 32)]
)
def test_the_inception_seeds_batch_is_one_machines_split_over_its_gpus(gpus, batch, processes, per_process):
    # inception_train.py: split_batch_size = int(FLAGS.batch_size / FLAGS.num_gpus), one tower per GPU;
    # the README: "This model splits the batch of 64 images across 2 GPUs". fasttrain's processes are
    # the towers (torchrun --nproc_per_node), so the global batch stays the seed's.
    cfg = parse_args([f"--num_gpus={gpus}", f"--batch_size={batch}", "--train_dir=/t"])
    assert (cfg.node_batch_size, resolve_node_batch(cfg, processes).batch_size) == (batch, per_process)
    assert resolve_node_batch(cfg, 1).batch_size == batch  # one process trains the machine's batch
    # Without --num_gpus, --batch_size is fasttrain's per-process batch, on any recipe.
    cfg = parse_args(["--recipe=inception_v3", f"--batch_size={batch}"])
    assert (cfg.node_batch_size, resolve_node_batch(cfg, processes).batch_size) == (0, batch)


def test_a_split_batch_is_noted(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    parse_args(["--num_gpus=2", "--batch_size=64", "--train_dir=/t"])
    (line,) = capsys.readouterr().err.splitlines()
    assert (
        "--batch_size=64 with --num_gpus=2 is one machine's batch" in line and "--node_batch_size=64" in line
    )
    parse_args(["--num_gpus=1", "--batch_size=64", "--train_dir=/t"])  # one GPU: the same either way
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("recipe", [[], ["--recipe=inception_v3"]])
def test_num_gpus_alone_splits_the_seeds_default_batch(recipe, capsys, monkeypatch):
    # image_processing.py: DEFINE_integer('batch_size', 32, ...), one machine's, split over --num_gpus
    # towers (inception_train.py). torchrun --nproc_per_node=2 ... --num_gpus=2 trained 2 x 32 per step.
    monkeypatch.delenv("RANK", raising=False)
    cfg = parse_args([*recipe, "--num_gpus=2", "--train_dir=T", "--data_dir=D"])
    assert (cfg.recipe, cfg.node_batch_size) == ("inception_v3", 32)
    assert resolve_node_batch(cfg, 2).batch_size == 16  # the seed's global batch of 32, as it wrote it out
    (line,) = capsys.readouterr().err.splitlines()
    assert "--num_gpus=2 without --batch_size" in line and "--node_batch_size=32" in line
    # The ResNet recipes' batch is one node's already (--train-batch-size 128): left as it is.
    assert parse_args(["--recipe=resnet50", "--num_gpus=2"]).node_batch_size == 128


def _main_without_training(monkeypatch, tmp_path, **environ):
    """fasttrain.__main__.main on the Inception seed's --num_gpus=2, with the trainer replaced by nothing."""
    from fasttrain.__main__ import main
    from fasttrain.threads import OFF_VARIABLE

    monkeypatch.setattr("fasttrain.train.train", lambda cfg: None)
    monkeypatch.setenv(OFF_VARIABLE, "off")  # leave this process's torch threads alone
    for name in ("RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    return main(["--recipe=inception_v3", "--num_gpus=2", f"--train_dir={tmp_path}", "--device=cpu"])


def test_the_num_gpus_note_is_rank_0s_and_advises_torchrun_only_when_it_is_not_used(
    monkeypatch, tmp_path, capsys
):
    # Every rank printed it, and told a job that torchrun had launched with 2 processes to use torchrun.
    assert _main_without_training(monkeypatch, tmp_path, RANK="1", LOCAL_WORLD_SIZE="2") == 0
    assert capsys.readouterr().err == ""
    assert _main_without_training(monkeypatch, tmp_path, RANK="0", LOCAL_WORLD_SIZE="2") == 0
    note = [line for line in capsys.readouterr().err.splitlines() if "--num_gpus=2 is accepted" in line]
    assert len(note) == 1 and "torchrun --nproc_per_node=2" not in note[0], note
    assert _main_without_training(monkeypatch, tmp_path) == 0  # one process, without torchrun
    assert "launch with torchrun --nproc_per_node=2" in capsys.readouterr().err


# --- the demo's own command lines ---------------------------------------------------------------------

# Config fields that only the seeds' command lines have: alone, they select a seed's recipe.
_SEED_ONLY_FIELDS = ("num_gpus", "resnet_size")


def _readme_command_lines() -> list[list[str]]:
    """The flags of every `python -m fasttrain ...` / `torchrun ... -m fasttrain ...` in README.md (code
    blocks and inline code) that names no --recipe."""
    lines = []
    flags = r"((?: +--?[\w.=/<>,-]+(?: +(?!-)[\w./<>-]+)?)*)"  # flags, each maybe with a value word
    for match in re.finditer(r"-m fasttrain(?=[\s`]|$)" + flags, README.read_text(), re.MULTILINE):
        argv = shlex.split(match.group(1))
        if not any(a.startswith("--recipe") for a in argv) and argv not in lines:
            lines.append(argv)
    return lines


def test_the_readme_has_demo_command_lines_to_check():
    lines = _readme_command_lines()
    assert [] in lines and ["--train_dir", "runs/demo-4ranks"] in lines, lines


@pytest.mark.parametrize("argv", _readme_command_lines(), ids=lambda argv: " ".join(argv) or "(none)")
def test_the_readmes_command_lines_train_the_demo_unless_they_are_a_seeds(argv):
    cfg, line = parse_command_line(argv)
    seed_flags = (*RESNET_SEED_FLAGS, *INCEPTION_SEED_FLAGS, *BOTH_SEEDS_FLAGS)
    if any(a.split("=")[0][2:].replace("-", "_") in seed_flags for a in argv):
        assert cfg.recipe != "demo" and line, argv  # "Coming from TensorFlow": the seeds' lines as they are
    else:
        assert (cfg, line) == (parse_args(["--recipe=demo", *argv]), "")


def test_the_suites_command_lines_train_the_demo():
    for argv in (
        command("/d", "/r")[3:],
        trainer_args("/d", "/r"),
        ["--learning_rate=0.2", "--output_dir=o"],
    ):
        cfg, line = parse_command_line(argv)
        assert (cfg.recipe, line) == ("demo", ""), argv


@pytest.mark.parametrize(
    "name", [f.name for f in dataclasses.fields(Config) if f.name not in _SEED_ONLY_FIELDS]
)
def test_no_fasttrain_field_selects_a_seeds_recipe(name):
    # Every flag a fasttrain user types (a field's name) keeps the demo; the value only needs to parse.
    value = {"recipe": "demo", "data_backend": "torch", "subset": "train", "model": "resnet18"}.get(name)
    field = {f.name: f for f in dataclasses.fields(Config)}[name]
    if value is None:
        default = getattr(parse_args([]), name)
        value = ",".join(map(str, default)) if isinstance(default, list) else str(default)
    argv = [f"--{name}={value}"] if value != "" else [f"--{name}="]
    if name == "fine_tune":
        argv.append("--pretrained_model_checkpoint_path=p")
    assert field.name and parse_command_line(argv)[0].recipe == "demo"


# --- end to end: the seeds' README command lines through the CLI ------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


@pytest.mark.slow
def test_the_resnet_seeds_command_line_trains_resnet101_v2(data, tmp_path):
    out_dir = tmp_path / "output"
    seed_line = RESNET_SIMPLEST + [
        f"--data_dir={data}",
        f"--output_dir={out_dir}",
        f"--work_dir={tmp_path}",
        f"--log_dir={tmp_path}",
        "--num_gpus=1",
    ]
    # One step at 32 px (ResNet-101 at 224 px is minutes a step on 2 cores), no final evaluation: the
    # recipe's per-epoch one runs (an epoch of 48 records is one step of 32).
    out = run_cli(
        *seed_line, "--max_steps=1", "--image_size=32", "--no-eval_at_end", "--num_workers=0", cache=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fasttrain: recipe resnet101: the ResNet seed's program (imagenet_main.py)" in out.stdout, (
        out.stdout
    )
    assert "fasttrain: resnet101 | resnet101_v2 | 1 x cpu" in out.stdout, out.stdout
    saved = json.loads((out_dir / "config.json").read_text())
    assert (saved["recipe"], saved["model"], saved["node_batch_size"], saved["batch_size"]) == (
        "resnet101",
        "resnet101_v2",
        32,
        32,
    )
    assert (saved["num_classes"], saved["preprocess"], saved["optimizer"]) == (1001, "vgg", "momentum")
    shutil.rmtree(out_dir)  # a ResNet-101 checkpoint with momentum: 357 MB


@pytest.mark.slow
def test_the_inception_seeds_command_line_trains_inception_v3(data, tmp_path):
    train_dir = tmp_path / "imagenet_train"
    seed_line = ["--num_gpus=1", "--batch_size=32", f"--train_dir={train_dir}", f"--data_dir={data}"]
    # The seed's line, then the test's overrides (the last value wins): one step of 2 images at the
    # recipe's 299 px (32 images took 38 s and 4.5 GB on 2 cores).
    out = run_cli(
        *seed_line, "--max_steps=1", "--batch_size=2", "--no-eval_at_end", "--num_workers=0", cache=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fasttrain: recipe inception_v3: the Inception seed's program (inception_train.py)" in out.stdout
    assert "fasttrain: inception_v3 | inception_v3 | 1 x cpu" in out.stdout, out.stdout
    saved = json.loads((train_dir / "config.json").read_text())
    assert (saved["recipe"], saved["optimizer"], saved["ema_decay"], saved["num_classes"]) == (
        "inception_v3",
        "rmsprop",
        0.9999,
        1001,
    )
    shutil.rmtree(train_dir)  # an Inception v3 checkpoint with RMSProp slots and EMA: 544 MB
