"""The checks a `Config` passes when it is made (fasttrain/config.py's `Config.__post_init__`), and the
error they raise: each setting's range, its choices (the Literal[...] field types), the settings that
conflict, and --resnet_size's choice of model.

Apart from fasttrain/config.py, which holds the fields and their docstrings, so that each file keeps
one concern; this module does not import it (the hints are read off the instance's class).
"""

from __future__ import annotations

import functools
import math
import os
import typing
from typing import Literal

from fasttrain.errors import SettingError


class ConfigError(SettingError):
    """A user error in flags or configuration; the CLI prints it in one line and exits 2."""


def _allowed(hint) -> tuple:
    """The values a Literal[...] field type allows, None too for `Literal[...] | None` (() otherwise)."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    args = typing.get_args(hint)
    literal = next((a for a in args if typing.get_origin(a) is Literal), None)
    return (*typing.get_args(literal), None) if literal and type(None) in args else ()


@functools.cache
def _hints(config_class: type) -> dict:
    return typing.get_type_hints(config_class)


_POSITIVE = (
    "batch_size",
    "log_every",
    "checkpoint_every",
    "keep_checkpoints",
    "image_size",
    "num_classes",
    "grad_accum_steps",
    "base_channels",
    "max_nonfinite_steps",
    "num_epochs_per_decay",
    "learning_rate_decay_factor",
    "bucket_cap_mb",
)
_NON_NEGATIVE = (
    "seed",
    "max_steps",
    "train_epochs",
    "num_workers",
    "shuffle_buffer",
    "epoch_size",
    "max_eval_batches",
    "eval_every_epochs",
    "histogram_every",
    "num_gpus",
    "node_batch_size",
    "eval_batch_size",
    "weight_decay",
    "label_smoothing",
    "aux_loss_weight",
    "ema_decay",
    "initial_learning_rate",
    "momentum",
    "rmsprop_epsilon",
)


RESNET_SIZES = (18, 34, 50, 101, 152, 200)


def resolve_model(model: str, resnet_size: int) -> str:
    """The model --resnet_size selects, in the family of `model`: resnet<N>_v2 for a v2 model (the
    ResNet seed's `imagenet_resnet_v2(resnet_size, ...)`), resnet<N> for v1.5."""
    if not resnet_size:
        return model
    if resnet_size not in RESNET_SIZES:
        raise ConfigError(f"--resnet_size={resnet_size} is not one of {', '.join(map(str, RESNET_SIZES))}")
    if not model.startswith("resnet"):
        raise ConfigError(f"--resnet_size={resnet_size} and --model={model} conflict; give one of them")
    if model.endswith("_v2"):
        return f"resnet{resnet_size}_v2"
    if resnet_size == 200:
        raise ConfigError(
            f"--resnet_size=200 is a v2 model only (resnet200_v2, the resnet50/resnet101 recipes); "
            f"--model={model} is v1.5, which goes up to 152"
        )
    return f"resnet{resnet_size}"


def validate(cfg) -> None:
    """Raise ConfigError for the first setting of cfg (a Config) that is out of range or conflicts."""
    hints = _hints(type(cfg))
    for name, hint in hints.items():  # the choices are the Literal[...] field types
        allowed = _allowed(hint)
        if allowed and getattr(cfg, name) not in allowed:
            names = ", ".join(a for a in allowed if a is not None)
            raise ConfigError(f"--{name}={getattr(cfg, name)!r} is not one of {names}")
    # Written as `not value > 0` so that a NaN (`--initial_learning_rate=nan`) is refused too.
    for name in _POSITIVE:
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"--{name} must {_a_number('be positive', getattr(cfg, name))}")
    for name in _NON_NEGATIVE:
        if getattr(cfg, name) is None and type(None) in typing.get_args(hints[name]):  # auto
            continue
        if not getattr(cfg, name) >= 0:
            raise ConfigError(f"--{name} must {_a_number('not be negative', getattr(cfg, name))}")
    _check_finite(cfg)  # after the ranges, whose messages say more about a NaN
    # A momentum of 1 or more never forgets a gradient (TensorFlow takes it, and the run diverges).
    if not cfg.momentum < 1.0:
        raise ConfigError(f"--momentum must be below 1, got {cfg.momentum}")
    for name in ("rmsprop_decay", "bn_momentum"):
        value = getattr(cfg, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ConfigError(f"--{name} must be in [0, 1], got {value}")
    if cfg.bn_eps is not None and not cfg.bn_eps > 0:
        raise ConfigError(f"--bn_eps must be positive, got {cfg.bn_eps}")
    if cfg.label_offset not in (0, -1):
        raise ConfigError(f"--label_offset must be 0 (background class 0) or -1, got {cfg.label_offset}")
    if not 0.0 <= cfg.ema_decay < 1.0:
        raise ConfigError(f"--ema_decay must be in [0, 1), got {cfg.ema_decay}")
    if cfg.label_smoothing >= 1.0:
        raise ConfigError(f"--label_smoothing must be below 1, got {cfg.label_smoothing}")
    if cfg.max_steps == 0 and cfg.train_epochs == 0:
        raise ConfigError("set --max_steps or --train_epochs: both are 0")
    if cfg.histogram_every % cfg.log_every:
        raise ConfigError(
            f"--histogram_every={cfg.histogram_every} must be a multiple of --log_every={cfg.log_every} "
            "(histograms are written at log steps, where the trainer reads the device anyway)"
        )
    if cfg.seed >= _SEED_LIMIT:
        raise ConfigError(f"--seed must be below 2**32, got {cfg.seed}")
    if cfg.image_size < MIN_IMAGE_SIZE:
        raise ConfigError(
            f"--image_size must be at least {MIN_IMAGE_SIZE}, got {cfg.image_size} (the evaluation's resize "
            "before its central crop rounds a smaller one to nothing)"
        )
    for name, images in (("batch_size", cfg.batch_size), ("eval_batch_size", cfg.eval_batch_per_process)):
        # One batch of uint8 images is the least any loader holds (the thread loader keeps a ring of 3
        # or more): `--eval_batch_size=100000000` ended in an allocation traceback at the first
        # evaluation, after the training steps before it.
        need, memory = images * cfg.image_size**2 * 3, _memory_bytes()
        if need > memory:
            raise ConfigError(
                f"--{name}={getattr(cfg, name)}: one batch of {images:,} images of {cfg.image_size}x"
                f"{cfg.image_size} is {need / 2**30:,.0f} GiB of input buffers, more than this machine's "
                f"{memory / 2**30:,.0f} GiB of memory"
            )
    if cfg.bucket_cap_mb > MAX_BUCKET_MB:
        raise ConfigError(f"--bucket_cap_mb must be at most {MAX_BUCKET_MB:,} MiB, got {cfg.bucket_cap_mb:g}")
    if cfg.model_name == "inception_v3" and cfg.image_size < INCEPTION_MIN_IMAGE_SIZE:
        raise ConfigError(
            f"inception_v3 trains at --image_size of at least {INCEPTION_MIN_IMAGE_SIZE}, got "
            f"{cfg.image_size} (its aux head's 5x5 VALID convolution needs the 17x17 map of a 299 px input)"
        )
    if cfg.optimizer_impl == "triton":
        _check_triton(cfg.device)
    if cfg.model_name == "inception_v3" and cfg.batch_size < 2:
        raise ConfigError("inception_v3 needs --batch_size of at least 2 (the aux head's BN sees 1x1 maps)")
    if cfg.sync_bn and cfg.model_name == "inception_v3" and not cfg.inception_bn_gamma:
        # torch's SyncBatchNorm converts nn.BatchNorm layers only; trained without a word, the ranks
        # would keep their own statistics while config.json said sync_bn.
        raise ConfigError(
            "--sync_bn converts torch's BatchNorm layers, and inception_v3 without --inception_bn_gamma "
            "(the seed's slim batch norm, beta only) has none: drop --sync_bn, or add --inception_bn_gamma "
            "for torch's BatchNorm2d"
        )
    if cfg.bn_kernels == "triton":
        _check_bn_kernels(cfg)
    if cfg.fine_tune and not cfg.pretrained_model_checkpoint_path:
        raise ConfigError("--fine_tune needs --pretrained_model_checkpoint_path")
    bounds = cfg.lr_boundary_epochs
    if not isinstance(bounds, list) or not all(isinstance(b, (int, float)) for b in bounds):
        raise ConfigError(f"lr_boundary_epochs must be a list of numbers, got {bounds!r}")
    for name, value in [(n, getattr(cfg, n)) for n in _EPOCHS] + [("lr_boundary_epochs", b) for b in bounds]:
        if value is not None and not 0 <= value <= MAX_EPOCHS:
            never = (
                " (to never decay: --learning_rate_decay_factor=1)" if name == "num_epochs_per_decay" else ""
            )
            raise ConfigError(f"--{name} must be between 0 and {MAX_EPOCHS:g} epochs, got {value:g}{never}")
    if cfg.lr_schedule == "piecewise" and not bounds:  # an unset shell variable: a constant LR, unsaid
        raise ConfigError(
            "--lr_schedule=piecewise needs --lr_boundary_epochs (it is empty); for a constant learning "
            "rate give --learning_rate_decay_factor=1"
        )
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ConfigError(
            f"--lr_boundary_epochs={','.join(f'{b:g}' for b in bounds)!r} is not a comma-separated "
            "list of increasing numbers"
        )


# Settings counted in epochs, and their bound: a million epochs of ImageNet at batch 1 is 1.3e12 steps,
# far inside the int64 step counter; above it, `--num_epochs_per_decay=1e30` ended in an OverflowError.
_EPOCHS = ("train_epochs", "num_epochs_per_decay", "eval_every_epochs")
MAX_EPOCHS = 1e6


def _memory_bytes() -> float:
    """This machine's physical memory in bytes (inf where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return math.inf


def _a_number(rule: str, value) -> str:
    """'be positive, got -1', or for a NaN (which no range takes) 'be a number, got nan', not 'negative'."""
    return f"be a number, got {value}" if value != value else f"{rule}, got {value}"


def _check_finite(cfg) -> None:
    """Every number of cfg finite: `--train_epochs=inf` passed the range checks below and ended in an
    OverflowError when the steps were counted, `--weight_decay=inf` trained to NaN weights."""
    for name in _hints(type(cfg)):
        value = getattr(cfg, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"--{name} must be a finite number, got {item}")


def without_effect(cfg, given) -> dict[str, str]:
    """Of the settings a command line gave (field names), each one this configuration never reads,
    with why: a user who types --rmsprop_decay with the momentum optimizer meant something else, and
    training without a word would be silently not what was asked."""
    inception = cfg.model_name == "inception_v3"
    rules = {
        "rmsprop_decay": (cfg.optimizer != "rmsprop", f"the optimizer is {cfg.optimizer}"),
        "rmsprop_epsilon": (cfg.optimizer != "rmsprop", f"the optimizer is {cfg.optimizer}"),
        "lr_boundary_epochs": (cfg.lr_schedule != "piecewise", f"lr_schedule is {cfg.lr_schedule}"),
        "num_epochs_per_decay": (cfg.lr_schedule != "exponential", f"lr_schedule is {cfg.lr_schedule}"),
        "aux_loss_weight": (not inception, f"{cfg.model_name} has no aux head"),
        "inception_bn_gamma": (not inception, f"the model is {cfg.model_name}"),
        "train_epochs": (cfg.max_steps > 0, f"max_steps {cfg.max_steps} sets the run's length"),
        "zero_init_residual": (
            inception or cfg.model_name.endswith("_v2"),
            f"{cfg.model_name}'s blocks end in no BN to zero (v1.5 ResNets' do)",
        ),
        "histogram_every": (not cfg.tensorboard, "tensorboard is off (histograms go to TensorBoard)"),
        "color_distort": (
            cfg.preprocess != "inception",
            f"preprocess is {cfg.preprocess} (the distortion is Inception preprocessing's)",
        ),
    }
    return {name: why for name, (unused, why) in rules.items() if unused and name in given}


# The aux head pools Mixed_6e's map 5x5/3 and then applies a 5x5 convolution without padding, so it
# needs a map of 17x17 (5x5 after pooling): 299 px and up; at 298 px the map is 16x16 and training
# stopped in avg_pool2d ("Output size is too small"). Eval mode alone would run down to 75 px.
INCEPTION_MIN_IMAGE_SIZE = 299
# The ResNet evaluation resizes the short side to round(S * 256 / 224) and truncates: for S below 4
# that is S or less, and the central crop's window went negative or empty (a ZeroDivisionError in
# the resize at the first evaluation, after the whole run had trained); 8 leaves a margin.
MIN_IMAGE_SIZE = 8
# torch DDP's bucket size in bytes is a C++ int64: 1e300 MiB ended in a TypeError from its Reducer.
MAX_BUCKET_MB = 2**20
# The seed goes into NumPy SeedSequences and torch generators (as seed * 1000 + rank for synthetic
# batches, which overflows torch's 64-bit seed above about 1.8e16): 32 bits is plenty and safe.
_SEED_LIMIT = 2**32


def _check_triton(device: str) -> None:
    """--optimizer_impl=triton needs Triton and a CUDA device (or Triton's CPU interpreter, for tests)."""
    from fasttrain.kernels.common import HAVE_TRITON, interpreter_enabled

    if not HAVE_TRITON:
        raise ConfigError(
            "--optimizer_impl=triton needs the triton package; use --optimizer_impl=auto or torch"
        )
    if interpreter_enabled():
        return
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        raise ConfigError(
            "--optimizer_impl=triton needs a CUDA device and this run is on the CPU; use "
            "--optimizer_impl=auto or torch (TRITON_INTERPRET=1 runs the kernels on the CPU, for tests)"
        )


def _check_bn_kernels(cfg) -> None:
    """--bn_kernels=triton: without what it would silently undo or be undone by."""
    if cfg.compile:
        raise ConfigError(
            "--bn_kernels=triton replaces what --compile fuses (BatchNorm, the residual add, ReLU): "
            "choose one (--no-compile, or --bn_kernels=torch)"
        )
    if cfg.sync_bn:
        raise ConfigError(
            "--bn_kernels=triton computes each rank's own BatchNorm statistics; --sync_bn needs torch's "
            "SyncBatchNorm (--bn_kernels=torch)"
        )
    if cfg.channels_last is False:
        raise ConfigError(
            "--bn_kernels=triton works on channels_last activations; with --no-channels_last it would "
            "copy every one in and out: drop --no-channels_last, or use --bn_kernels=torch"
        )
