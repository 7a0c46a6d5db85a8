"""Flags map one-to-one onto Config fields; recipes carry the seeds' settings; bad input is refused."""

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest

from fasttrain.config import RECIPES, Config, ConfigError, make_config
from fasttrain.flags import flags_table, parse_args
from fasttrain.resume import changed_settings, shaping_changes
from fasttrain.run_config import upgrade_saved_config

README = Path(__file__).resolve().parents[1] / "README.md"

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
    "bn_kernels": "triton",
    "compile_mode": "max-autotune-no-cudagraphs",
    "lr_boundary_epochs": "5,7",
    "histogram_every": "50",  # a multiple of the demo's log_every
    "input_order": "one_stream",
    "loader": "processes",
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
    # --recipe named: a seed's own flag (--num_gpus, --resnet_size) alone would select the seed's recipe
    underscore = getattr(parse_args(["--recipe=demo", f"--{name}={text}"]), name)
    dashed = getattr(parse_args(["--recipe=demo", f"--{name.replace('_', '-')}", text]), name)
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
    assert (cfg.node_batch_size, cfg.train_dir, cfg.zero_init_residual, cfg.cuda_graph) == (
        64,
        "/tmp/run",
        False,
        True,
    )
    assert cfg.deterministic is False
    # The ResNet seed's own flags are covered, each to its field, in tests/test_resnet_seed_recipe.py.


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


def test_resnet_v15_recipe_is_tf_official_2018():
    # The ResNet seed's recipes (resnet50, resnet101) are tested in tests/test_resnet_seed_recipe.py.
    cfg = parse_args(["--recipe=resnet101_v1.5"])
    assert cfg.model == "resnet101" and cfg.optimizer == "momentum" and cfg.lr_batch_scaling
    assert (cfg.lr_boundary_epochs, cfg.learning_rate_decay_factor, cfg.weight_decay) == (
        [30.0, 60.0, 80.0, 90.0],
        0.1,
        1e-4,
    )
    assert (cfg.batch_size, cfg.image_size, cfg.bn_momentum, cfg.bn_eps) == (32, 224, 0.003, 1e-5)
    assert (cfg.preprocess, cfg.num_classes, cfg.label_offset, cfg.train_epochs) == ("resnet", 1000, -1, 90)
    assert (cfg.node_batch_size, cfg.input_order) == (0, "rank_slices")
    assert parse_args(["--recipe=resnet50_v1.5", "--resnet_size=152"]).model == "resnet152"


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
        # A NaN was "negative": what is wrong with it is that it is not a number.
        (["--initial_learning_rate=nan"], "--initial_learning_rate must be a number, got nan"),
        (["--batch_size=4", "--bucket_cap_mb=nan"], "--bucket_cap_mb must be a number, got nan"),
        (["--momentum=2"], "--momentum must be below 1, got 2.0"),  # it trained (and diverged)
        (["--momentum=1"], "--momentum must be below 1, got 1.0"),
        (["--lr_schedule=piecewise", "--lr_boundary_epochs="], "--lr_schedule=piecewise needs --lr_boundary"),
        (["--bucket_cap_mb=-1"], "--bucket_cap_mb must be positive"),
        (["--rmsprop_decay=1.5"], "--rmsprop_decay must be in [0, 1]"),
        (["--bn_momentum=-0.1"], "--bn_momentum must be in [0, 1]"),
        (["--bn_eps=0"], "--bn_eps must be positive"),
        (["--num_epochs_per_decay=0"], "--num_epochs_per_decay must be positive"),
        # Infinities and huge epoch counts passed the ranges above and ended in an OverflowError where
        # the steps were counted (train.py, schedule.py), or, --weight_decay=inf, in NaN weights.
        (["--max_steps=0", "--train_epochs=inf"], "--train_epochs must be a finite number, got inf"),
        (["--eval_every_epochs=inf"], "--eval_every_epochs must be a finite number"),
        (["--weight_decay=inf"], "--weight_decay must be a finite number"),
        (["--momentum=inf"], "--momentum must be a finite number"),
        (["--lr_boundary_epochs=1,inf"], "--lr_boundary_epochs must be a finite number, got inf"),
        (["--lr_boundary_epochs=nan"], "--lr_boundary_epochs must be a finite number, got nan"),
        (["--num_epochs_per_decay=1e30"], "--num_epochs_per_decay must be between 0 and 1e+06 epochs"),
        (["--train_epochs=2e6"], "--train_epochs must be between 0 and 1e+06 epochs, got 2e+06"),
        (["--lr_boundary_epochs=-1,2"], "--lr_boundary_epochs must be between 0 and 1e+06 epochs, got -1"),
        (["--no-max_steps"], "--no-max_steps: --no- is for on/off flags, and --max_steps takes a value"),
        (["--no-deterministic=1"], "--no-deterministic takes no value"),
        (["positional"], "unexpected argument"),
        # A batch no machine holds: an allocation traceback at the first evaluation, after training.
        (["--eval_batch_size=100000000"], "--eval_batch_size=100000000: one batch of 100,000,000 images"),
        (["--batch_size=10000000"], "--batch_size=10000000: one batch of 10,000,000 images"),
    ],
)
def test_bad_flags_name_the_flag(argv, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_args(argv)


def test_config_round_trips_through_json():
    cfg = parse_args(["--recipe=inception_v3", "--max_steps=7"])
    assert Config(**json.loads(cfg.to_json())) == cfg


def test_readme_flags_reference_lists_every_field():
    readme = README.read_text(encoding="utf-8")
    missing = [name for name in Config.__dataclass_fields__ if f"| `--{name}` |" not in readme]
    assert not missing, f"README's flags table lacks {missing}"


def test_help_goes_to_stdout_with_exit_0(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(["--help"])
    assert stop.value.code == 0 and "--bucket_cap_mb" in capsys.readouterr().out


def test_readme_flags_table_is_the_generated_one():
    readme = README.read_text(encoding="utf-8")
    table = readme.split("<!-- flags table:")[1].split("-->", 1)[1].split("<!-- end of flags table -->")[0]
    assert table.strip() == flags_table(), "README's flags table is stale: paste `python -m fasttrain.flags`"


def test_help_shows_the_named_recipes_values_as_defaults(capsys):
    def help_line(argv, name):
        with pytest.raises(SystemExit):
            parse_args(argv)
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith(f"  --{name} "))

    assert help_line(["--help"], "max_steps").endswith("[default: 300]")  # the demo's
    assert help_line(["--recipe", "resnet50", "--help"], "max_steps").endswith("[default: 0]")
    assert help_line(["--help", "--recipe=resnet50"], "lr_schedule").endswith("[default: piecewise]")
    assert help_line(["--recipe=resnet50", "--help"], "lr_boundary_epochs").endswith("[default: 30,60,80,90]")
    assert help_line(["--recipe=inception_v3", "--help"], "image_size").endswith("[default: 299]")


def test_recipes_are_configs_named_for_themselves():
    names = typing.get_args(typing.get_args(typing.get_type_hints(Config)["recipe"])[0])
    assert list(RECIPES) == list(names)
    assert list(names) == ["demo", "inception_v3", "resnet50", "resnet101", "resnet50_v1.5", "resnet101_v1.5"]
    for name, recipe in RECIPES.items():
        assert isinstance(recipe, Config) and recipe.recipe == name
        assert make_config(recipe=name) == recipe
    # The field defaults are the base, which is no recipe; the CLI trains the demo when none is named.
    assert Config.__dataclass_fields__["recipe"].default is None
    assert parse_args([]) == RECIPES["demo"]
    # A Config made from a recipe has its own list: changing it leaves the recipe as it was.
    make_config(recipe="resnet50").lr_boundary_epochs.append(100.0)
    assert RECIPES["resnet50"].lr_boundary_epochs == [30.0, 60.0, 80.0, 90.0]


@pytest.mark.parametrize(
    "name", [n for n, hint in typing.get_type_hints(Config).items() if "Literal" in str(hint)]
)
def test_every_choice_field_refuses_other_values(name):
    hint = typing.get_type_hints(Config)[name]
    literal = next((a for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal), hint)
    choices = ", ".join(typing.get_args(literal))
    with pytest.raises(ConfigError, match=re.escape(f"--{name}='bogus' is not one of {choices}")):
        dataclasses.replace(RECIPES["demo"], **{name: "bogus"})


def test_lr_boundary_epochs_is_a_list_the_flag_spells_with_commas():
    assert parse_args(["--lr_boundary_epochs=5,7.5"]).lr_boundary_epochs == [5.0, 7.5]
    assert parse_args(["--lr_boundary_epochs="]).lr_boundary_epochs == []  # piecewise without steps
    assert json.loads(parse_args(["--lr_boundary_epochs", "5,7"]).to_json())["lr_boundary_epochs"] == [5, 7]
    with pytest.raises(ConfigError, match=re.escape("--lr_boundary_epochs='30,10' is not a comma-separated")):
        parse_args(["--lr_boundary_epochs=30,10"])
    with pytest.raises(ConfigError, match=re.escape("--lr_boundary_epochs='a,b' is not a comma-separated")):
        parse_args(["--lr_boundary_epochs=a,b"])


# A config.json written before lr_boundary_epochs was a list (the resnet50 recipe, by commit d345055,
# which is resnet50_v1.5 now); checkpoints saved the same values under "config".
_SAVED_BEFORE_LISTS = """\
{
  "aux_loss_weight": 0.0,
  "base_channels": 64,
  "batch_size": 32,
  "bn_eps": 1e-05,
  "bn_momentum": 0.003,
  "bucket_cap_mb": 25.0,
  "channels_last": null,
  "checkpoint_dir": "",
  "checkpoint_every": 5000,
  "color_distort": false,
  "cuda_graph": null,
  "data_backend": "auto",
  "data_cache_dir": "",
  "data_dir": "/data/imagenet",
  "deterministic": false,
  "device": "auto",
  "ema_decay": 0.0,
  "epoch_size": 0,
  "eval_at_end": true,
  "eval_every_epochs": 1.0,
  "fine_tune": false,
  "grad_accum_steps": 1,
  "grad_sync": "buckets",
  "histogram_every": 0,
  "image_size": 224,
  "initial_learning_rate": 0.1,
  "keep_checkpoints": 3,
  "label_offset": -1,
  "label_smoothing": 0.0,
  "learning_rate_decay_factor": 0.1,
  "log_every": 10,
  "lr_batch_scaling": true,
  "lr_boundary_epochs": "30,60,80,90",
  "lr_schedule": "piecewise",
  "max_eval_batches": 0,
  "max_nonfinite_steps": 20,
  "max_steps": 0,
  "model": "resnet50",
  "momentum": 0.9,
  "no_decay_bn_bias": false,
  "num_classes": 1000,
  "num_epochs_per_decay": 30.0,
  "num_gpus": 0,
  "num_workers": 4,
  "optimizer": "momentum",
  "optimizer_impl": "auto",
  "precision": "auto",
  "preprocess": "resnet",
  "pretrained_model_checkpoint_path": "",
  "profile_comm": false,
  "recipe": "resnet50",
  "resnet_size": 0,
  "rmsprop_decay": 0.9,
  "rmsprop_epsilon": 1.0,
  "seed": 0,
  "shuffle_buffer": 2048,
  "skip_corrupt": false,
  "subset": "train",
  "sync_bn": false,
  "tensorboard": true,
  "train_dir": "runs/r50",
  "train_epochs": 90.0,
  "weight_decay": 0.0001,
  "zero_init_residual": true
}
"""


def test_a_config_saved_before_lr_boundary_epochs_was_a_list_still_loads():
    saved = json.loads(_SAVED_BEFORE_LISTS)
    assert saved["lr_boundary_epochs"] == "30,60,80,90"
    now = make_config(recipe="resnet50_v1.5", data_dir="/data/imagenet", train_dir="runs/r50")
    # then the only loader; and BN's gamma and beta decayed, as the recipe did then
    now = dataclasses.replace(now, num_workers=4, loader="processes", no_decay_bn=False)
    assert Config(**upgrade_saved_config(saved)) == now  # as the evaluator reads config.json
    assert changed_settings(saved, now) == []  # as a resume compares a checkpoint's config
    assert changed_settings(saved, dataclasses.replace(now, lr_boundary_epochs=[30, 60])) == [
        "lr_boundary_epochs [30.0, 60.0, 80.0, 90.0] -> [30.0, 60.0]"
    ]
    with pytest.raises(ConfigError, match="the saved lr_boundary_epochs 'x' is not"):
        upgrade_saved_config({"lr_boundary_epochs": "x"})


def test_an_inception_config_saved_before_inception_bn_gamma_is_the_gamma_network():
    # Before the field existed inception_v3 always had a BN gamma; today's default is the seed's network
    # without one, so a resume of such a run must name the setting that changed the checkpoint's shapes.
    old = {k: v for k, v in dataclasses.asdict(make_config(recipe="inception_v3")).items()}
    del old["inception_bn_gamma"]
    upgraded = upgrade_saved_config(old)
    assert upgraded["inception_bn_gamma"] is True
    now = make_config(recipe="inception_v3")
    changes = changed_settings(old, now)
    assert changes == ["inception_bn_gamma True -> False"]
    assert shaping_changes(changes) == changes
    assert "inception_bn_gamma" not in upgrade_saved_config({"model": "resnet50_v2"})


def test_a_v15_config_saved_before_no_decay_bn_decayed_bn_and_its_resume_names_the_change():
    # The v1.5 recipes decay every parameter but BN's (TF official's exclude_batch_norm) since
    # no_decay_bn exists; a run begun before decayed gamma and beta too, in one parameter group.
    old = dataclasses.asdict(make_config(recipe="resnet50_v1.5"))
    del old["no_decay_bn"]
    assert upgrade_saved_config(old)["no_decay_bn"] is False
    changes = changed_settings(old, make_config(recipe="resnet50_v1.5"))
    assert changes == ["no_decay_bn False -> True"] and shaping_changes(changes) == changes


def test_a_batch_is_refused_only_past_the_machine_s_memory(monkeypatch):
    from fasttrain import config_checks

    one_batch = 256 * 224 * 224 * 3  # bytes: uint8 images
    monkeypatch.setattr(config_checks, "_memory_bytes", lambda: one_batch)
    parse_args(["--batch_size=256", "--image_size=224"])
    with pytest.raises(ConfigError, match=re.escape("--batch_size=257: one batch of 257 images of 224x224")):
        parse_args(["--batch_size=257", "--image_size=224"])
    with pytest.raises(ConfigError, match=re.escape("--eval_batch_size=257")):
        parse_args(["--batch_size=256", "--eval_batch_size=257", "--image_size=224"])
