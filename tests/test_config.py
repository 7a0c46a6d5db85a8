"""Flags map one-to-one onto Config fields; recipes carry the seeds' settings; bad input is refused."""

import json
import re
from pathlib import Path

import pytest

from fasttrain.config import Config, ConfigError, make_config, parse_args

_SPECIAL = {
    "device": "cpu",
    "label_offset": "0",
    "resnet_size": "50",
    "subset": "validation",
    "data_backend": "synthetic",
    "preprocess": "inception",
    "model": "resnet101",
    "optimizer": "rmsprop",
    "optimizer_impl": "torch",
    "lr_schedule": "piecewise",
    "precision": "bf16",
    "grad_sync": "ddp",
    "lr_boundary_epochs": "5,7",
    "histogram_every": "50",  # a multiple of the demo's log_every
}


def _other_value(name, value):
    """A valid value different from the default, as command-line text."""
    if name in _SPECIAL:
        return _SPECIAL[name]
    if value is None and name.startswith("bn_"):
        return "0.25"
    if isinstance(value, bool) or value is None:
        return "false" if value else "true"
    if isinstance(value, int):
        return str(value + 1)
    if isinstance(value, float):
        return str(value / 2 + 0.1)
    return value + "x"


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in Config.__dataclass_fields__
        if n not in ("recipe", "fine_tune", "pretrained_model_checkpoint_path")
    ],
)
def test_every_field_is_a_flag_in_both_spellings(name):
    default = getattr(make_config(), name)
    text = _other_value(name, default)
    underscore = getattr(parse_args([f"--{name}={text}"]), name)
    dashed = getattr(parse_args([f"--{name.replace('_', '-')}", text]), name)
    assert underscore == dashed != default


def test_seed_aliases_and_booleans():
    cfg = parse_args(
        [
            "--recipe",
            "resnet101",
            "--train-batch-size",
            "64",
            "--output_dir=/tmp/run",
            "--no-zero-init-residual",
            "--cuda_graph",
            "--deterministic=false",
        ]
    )
    assert (cfg.batch_size, cfg.train_dir, cfg.zero_init_residual, cfg.cuda_graph) == (
        64,
        "/tmp/run",
        False,
        True,
    )
    assert cfg.deterministic is False


def test_inception_recipe_is_the_seed():
    cfg = make_config(recipe="inception_v3")
    assert (cfg.optimizer, cfg.rmsprop_decay, cfg.momentum, cfg.rmsprop_epsilon) == ("rmsprop", 0.9, 0.9, 1.0)
    assert (cfg.initial_learning_rate, cfg.learning_rate_decay_factor, cfg.num_epochs_per_decay) == (
        0.1,
        0.16,
        30,
    )
    assert (cfg.batch_size, cfg.ema_decay, cfg.num_classes, cfg.label_offset) == (32, 0.9999, 1001, 0)
    assert (cfg.label_smoothing, cfg.aux_loss_weight, cfg.weight_decay, cfg.image_size) == (
        0.1,
        0.4,
        4e-5,
        299,
    )
    assert cfg.checkpoint_every == 5000


def test_resnet_recipe_is_the_seed():
    cfg = parse_args(["--recipe=resnet101"])
    assert cfg.model_name == "resnet101" and cfg.optimizer == "momentum" and cfg.lr_batch_scaling
    assert (cfg.lr_boundary_epochs, cfg.learning_rate_decay_factor, cfg.weight_decay) == (
        "30,60,80,90",
        0.1,
        1e-4,
    )
    assert (cfg.batch_size, cfg.image_size, cfg.bn_momentum, cfg.bn_eps) == (32, 224, 0.003, 1e-5)
    assert parse_args(["--recipe=resnet50", "--resnet_size=152"]).model_name == "resnet152"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--no-such-flag"], "unknown flag --no-such-flag"),
        (["--recipe", "resnet9000"], "unknown recipe"),
        (["--batch_size=abc"], "--batch_size takes int"),
        (["--batch_size=0"], "--batch_size must be positive"),
        (["--precision=fp8"], "--precision"),
        (["--label_offset=3"], "--label_offset"),
        (["--fine_tune"], "--pretrained_model_checkpoint_path"),
        (["--lr_boundary_epochs=30,10"], "--lr_boundary_epochs"),
        (["--batch_size"], "needs a value"),
        # These reached the optimizer or the bucketer and ended in a traceback (or, NaN, in training).
        (["--initial_learning_rate=-1"], "--initial_learning_rate must not be negative"),
        (["--initial_learning_rate=nan"], "--initial_learning_rate must not be negative, got nan"),
        (["--bucket_cap_mb=-1"], "--bucket_cap_mb must be positive"),
        (["--rmsprop_decay=1.5"], "--rmsprop_decay must be in [0, 1]"),
        (["--bn_momentum=-0.1"], "--bn_momentum must be in [0, 1]"),
        (["--bn_eps=0"], "--bn_eps must be positive"),
        (["--num_epochs_per_decay=0"], "--num_epochs_per_decay must be positive"),
        (["positional"], "unexpected argument"),
    ],
)
def test_bad_flags_name_the_flag(argv, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_args(argv)


def test_config_round_trips_through_json():
    cfg = parse_args(["--recipe=inception_v3", "--max_steps=7"])
    assert Config(**json.loads(cfg.to_json())) == cfg


def test_readme_flags_reference_lists_every_field():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    missing = [name for name in Config.__dataclass_fields__ if f"| `--{name}` |" not in readme]
    assert not missing, f"README's flags table lacks {missing}"


def test_help_goes_to_stdout_with_exit_0(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(["--help"])
    assert stop.value.code == 0 and "--bucket_cap_mb" in capsys.readouterr().out
