"""The run configuration: every setting a typed `Config` field with a docstring, validated once.

The field defaults are the base; a recipe (`RECIPES`, made from fasttrain/recipes.py's table) is a
`Config`, the base plus the seed's changes, and `make_config` applies overrides to one. Every field is
a command-line flag (fasttrain/flags.py), and the resolved config is saved as `config.json` in the run
directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fasttrain.config_checks import INCEPTION_MIN_IMAGE_SIZE as INCEPTION_MIN_IMAGE_SIZE  # re-exported
from fasttrain.config_checks import ConfigError as ConfigError  # re-exported: its long-standing home
from fasttrain.config_checks import resolve_model, validate
from fasttrain.recipes import RECIPE_SETTINGS


@dataclass
class Config:
    # --- run control -------------------------------------------------------------------------
    recipe: (
        Literal["demo", "inception_v3", "resnet50", "resnet101", "resnet50_v1.5", "resnet101_v1.5"] | None
    ) = None
    """Named recipe these values start from (fasttrain/recipes.py): demo (the CLI's when none is named),
    inception_v3, resnet50/resnet101 (the ResNet seed: pre-activation v2, VGG preprocessing) or
    resnet50_v1.5/resnet101_v1.5 (TF official 2018); None in the base, these field defaults, no recipe."""
    train_dir: str = ""
    """Run directory for checkpoints, config.json and metrics.jsonl (default: runs/<recipe>)."""
    max_steps: int = 0
    """Number of optimizer steps to train for (0: train_epochs epochs)."""
    train_epochs: float = 0.0
    """Epochs to train for when max_steps is 0 (the ResNet seed's --train-epochs, 100); given alone on
    the command line it sets max_steps to 0 (a recipe's max_steps would end the run first)."""
    seed: int = 0
    """Seed for model initialisation, data order and augmentation (`0 <= seed < 2**32`)."""
    deterministic: bool = False
    """Deterministic algorithms and one data worker, so a run is bit-reproducible on the CPU (on CUDA
    also a fixed cuBLAS workspace, `CUBLAS_WORKSPACE_CONFIG=:4096:8` unless set)."""
    log_every: int = 10
    """Print the seeds' `step N, loss = X (...)` line and a metrics record every N steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to train_dir (rank 0): loss, LR, images/s, accuracy, evaluations."""
    histogram_every: int = 0
    """Also write weight and gradient histograms to TensorBoard every N steps, a multiple of log_every
    (0: never; each costs a host copy of the model)."""
    checkpoint_every: int = 5000
    """Write ckpt-<step>.pt every N steps (and always at the end)."""
    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep in train_dir."""
    eval_at_end: bool = True
    """Evaluate top-1/top-5 on the validation split, raw and EMA weights, when training ends."""
    eval_every_epochs: float = 0.0
    """Also evaluate, raw and EMA, every N epochs while training (0: never; the ResNet seed's
    --epochs_per_eval, 1)."""
    max_eval_batches: int = 0
    """Evaluate on at most this many batches per rank (0: the whole validation split)."""
    max_nonfinite_steps: int = 20
    """With fp16 loss scaling: stop after this many consecutive skipped (overflowed) steps. Without it
    (fp32, bf16) a run stops at the first log row after a non-finite loss, as the seeds assert."""
    fine_tune: bool = False
    """With pretrained_model_checkpoint_path: restore all but the classifier, which is re-initialised."""
    pretrained_model_checkpoint_path: str = ""
    """A checkpoint to start from (the run starts at step 0): a fasttrain .pt, a plain state_dict file
    (torch.save(model.state_dict()), torchvision's names), or a TensorFlow one (a prefix model.ckpt-N, V1
    or V2, or a train directory: its newest), whose raw weights load."""
    checkpoint_dir: str = ""
    """Begin from the newest checkpoint in this directory instead of train_dir's own; a TensorFlow
    run's directory (or prefix) is continued: weights, BN statistics, EMA, optimizer slots, step. Once
    train_dir holds checkpoints of this run, the same command goes on from those."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Device to train on: auto (CUDA when available), cuda, or cpu."""
    num_gpus: int = 0
    """Accepted for the seeds' command lines only: the device count is torchrun's --nproc_per_node. With
    --batch_size (the Inception seed's), that batch is one machine's: --node_batch_size; without it,
    the Inception seed's default 32 is."""
    profile_comm: bool = False
    """Measure how much of the gradient all-reduce time is hidden behind backward and report it."""

    # --- data ------------------------------------------------------------------------------
    data_dir: str = ""
    """Directory of TFRecord shards train-*-of-* and validation-*-of-* (demo: built in the cache)."""
    subset: Literal["train", "validation"] = "train"
    """Split to train on: train or validation (the seeds' --subset)."""
    data_backend: Literal["auto", "dali", "torch", "synthetic"] = "auto"
    """Input pipeline: auto (DALI's GPU decode on a CUDA device when DALI imports, else torch), dali,
    torch, or synthetic."""
    data_cache_dir: str = ""
    """Cache for the demo data set and for index files of read-only data directories."""
    row_checkpoints: bool = True
    """Torch backend: decode training crops through the shards' JPEG row checkpoints where
    `python -m fasttrain.data row-checkpoints DATA_DIR` built them (the same pixels, less decode CPU)."""
    fused_decode: bool = True
    """Torch backend: make each training image (the crop's decode, resize, colour) in one call that
    drops the GIL once, where its check on this machine passes (the same pixels; false: separate calls)."""
    num_workers: int | None = None
    """Torch backend: loader threads per rank (DataLoader processes with loader=processes); DALI: CPU
    threads. auto: on CUDA the rank's share of the cores less one (at most 16; DALI 4), 4 on the CPU."""
    shuffle_buffer: int = 2048
    """Records held in the shuffle buffer of each reader (shard order is shuffled too)."""
    input_order: Literal["rank_slices", "one_stream"] = "rank_slices"
    """Training record order (fasttrain/data/sharding.py): rank_slices (each rank shuffles its own
    contiguous slice of the shard-shuffled stream) or one_stream (the ResNet seed's: one shard-shuffled
    stream through one shuffle buffer, its batches dealt to the ranks in turn); torch backend."""
    image_size: int = 224
    """Training and evaluation image side in pixels."""
    preprocess: Literal["inception", "resnet", "vgg"] = "resnet"
    """Preprocessing style: inception (scale to [-1, 1], 87.5% central eval crop), resnet (TF 2018
    official: distorted-bbox crop, means) or vgg (the ResNet seed's: short side jittered in [256, 512],
    random crop, means on the [0, 1] scale)."""
    color_distort: bool = False
    """Inception colour distortion (brightness, saturation, hue, contrast) in training, with
    preprocess inception only."""
    label_offset: int = -1
    """Added to the stored labels 1..1000: 0 keeps background 0 (1001 classes), -1 gives 0..999."""
    num_classes: int = 1000
    """Classifier outputs (1001 with label_offset 0)."""
    epoch_size: int = 0
    """Training records per epoch for the LR schedule (0: counted from the data)."""
    skip_corrupt: bool = False
    """Skip corrupt records (counted in the log) instead of stopping with an error."""
    loader: Literal["auto", "threads", "processes"] = "auto"
    """torch backend: decode in num_workers threads of the training process (less CPU per image),
    or in DataLoader processes, which win with many workers per rank: the GIL-held part of an image
    (crop sampling, Example parsing) caps threads near 1 / that fraction of a core's work
    (bench/bench_input.py measures both). auto: processes above 6 workers where /dev/shm can hold
    their batches, else threads."""

    # --- model -----------------------------------------------------------------------------
    model: Literal[
        "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
        "resnet18_v2", "resnet34_v2", "resnet50_v2", "resnet101_v2", "resnet152_v2", "resnet200_v2",
        "inception_v3",
    ] = "resnet50"  # fmt: skip
    """Architecture: resnet18/34/50/101/152 (v1.5), resnet18/34/50/101/152/200_v2 (the ResNet seed's
    pre-activation v2) or inception_v3."""
    resnet_size: int = 0
    """The ResNet seed's flag: 18, 34, 50, 101, 152 or 200 selects resnet<N>_v2 when the model is a v2
    (the resnet50/101 recipes), resnet<N> (v1.5, up to 152) otherwise; config.json holds the model it
    selected (0: use --model)."""
    base_channels: int = 64
    """Width of the first ResNet stage (64 is the standard architecture; the demo uses less)."""
    zero_init_residual: bool = True
    """Zero-initialise the last BN gamma of every residual block."""
    bn_momentum: float | None = None
    """BatchNorm running-statistics momentum in torch's convention, 1 - TF decay (none: the model's)."""
    bn_eps: float | None = None
    """BatchNorm epsilon (none: the model's; ResNet 1e-5, Inception 0.001)."""
    label_smoothing: float = 0.0
    """Label smoothing of the cross-entropy loss."""
    aux_loss_weight: float = 0.0
    """Weight of the Inception auxiliary head's loss (0.4 in the Inception seed)."""
    inception_bn_gamma: bool = False
    """Inception v3 only: a learnable BN gamma in every layer (torchvision's structure); off trains the
    seed's slim network, beta only."""

    # --- optimisation ----------------------------------------------------------------------
    batch_size: int = 32
    """Training images per process per step (the Inception seed's --batch_size); set from
    node_batch_size when the run starts if that is given (config.json holds the result)."""
    node_batch_size: int = 0
    """Training images per node per step, divided evenly over the node's processes (torchrun's
    --nproc_per_node, 1 without torchrun) into batch_size: the ResNet seed's --train-batch-size
    (0: batch_size is given per process)."""
    eval_batch_size: int = 0
    """Evaluation images per batch, one node's and divided like node_batch_size when that is given,
    else one process's (0: batch_size): the ResNet seed's --eval-batch-size; results do not depend on it."""
    optimizer: Literal["rmsprop", "momentum"] = "momentum"
    """rmsprop (TensorFlow's RMSPropOptimizer) or momentum (TensorFlow's MomentumOptimizer)."""
    optimizer_impl: Literal["auto", "triton", "chunked", "torch"] = "auto"
    """Optimizer implementation: auto (Triton on supported GPUs, else chunked), triton, chunked, or torch."""
    initial_learning_rate: float = 0.1
    """Learning rate at step 0 (before lr_batch_scaling)."""
    lr_batch_scaling: bool = False
    """Multiply the learning rate by global_batch / 256 (TF official ResNet 2018 / v1.5's rule; the ResNet
    seed does not scale)."""
    lr_schedule: Literal["exponential", "piecewise"] = "exponential"
    """exponential (staircase decay every num_epochs_per_decay) or piecewise (lr_boundary_epochs)."""
    num_epochs_per_decay: float = 30.0
    """Exponential schedule: epochs between decays."""
    learning_rate_decay_factor: float = 0.16
    """Exponential schedule: multiplier per decay; piecewise: multiplier at each boundary."""
    lr_boundary_epochs: list[float] = field(default_factory=lambda: [30.0, 60.0, 80.0, 90.0])
    """Piecewise schedule: the epochs, increasing, at which the LR is multiplied by the factor (the flag
    takes them comma-separated)."""
    momentum: float = 0.9
    """Momentum of either optimizer."""
    rmsprop_decay: float = 0.9
    """RMSProp decay of the mean square."""
    rmsprop_epsilon: float = 1.0
    """RMSProp epsilon (inside the square root, as in TensorFlow)."""
    weight_decay: float = 1e-4
    """L2 weight decay added to the gradient, g += wd * w (TensorFlow's loss term)."""
    no_decay_bn_bias: bool = False
    """Exempt BatchNorm parameters and biases from weight decay."""
    no_decay_bn: bool = False
    """Exempt BatchNorm parameters only from weight decay, biases kept (TF official ResNet's L2 filter)."""
    ema_decay: float = 0.0
    """Exponential moving average of weights and BN statistics (0: off; 0.9999 in the Inception seed)."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (only the last one communicates; an epoch's last
    batches that fill no step are dropped)."""

    # --- precision, layout, speed -----------------------------------------------------------
    precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    """fp32, fp16 (dynamic loss scaling), bf16, or auto (by GPU class; fp32 on the CPU)."""
    channels_last: bool | None = None
    """NHWC memory layout (default: on for CUDA devices with tensor cores, off on the CPU)."""
    cuda_graph: bool | None = None
    """Capture the whole training step in a CUDA graph (default: on for CUDA)."""
    compile: bool | None = None
    """Compile the model's blocks with torch.compile (inductor) inside the step and its CUDA graph
    (default: on for CUDA, off on the CPU and with --deterministic)."""
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = "default"
    """inductor mode of --compile (the modes with CUDA graphs of their own do not fit the captured step)."""
    pad_stem: bool | None = None
    """Give the first convolution its images with a fourth, zero channel, as NVIDIA's MLPerf ResNet-50
    does (default: off; on an H200 it gained nothing in the whole bf16 step; same weights and output)."""
    bn_kernels: Literal["torch", "triton"] = "torch"
    """BatchNorm (+ residual add) + ReLU: torch's ops (fused by --compile) or triton, fasttrain's kernels
    (8 passes over the activations, 11 with the add; CUDA, without --compile, which it then defaults
    off; not yet measured on a GPU)."""
    grad_sync: Literal["buckets", "ddp"] = "buckets"
    """Multi-process gradient sync: buckets (fasttrain's flat-buffer all-reduce) or ddp (torch DDP)."""
    bucket_cap_mb: float = 25.0
    """All-reduce bucket size in MiB (the first bucket is about 1 MiB)."""
    sync_bn: bool = False
    """Synchronise BatchNorm statistics across ranks (default: per rank, as in the seeds)."""

    def __post_init__(self) -> None:
        self.model = resolve_model(self.model, self.resnet_size)
        validate(self)
        # A copy, in floats: a Config made from a recipe must not share the recipe's list.
        self.lr_boundary_epochs = [float(b) for b in self.lr_boundary_epochs]

    @property
    def model_name(self) -> str:
        """The architecture (model holds it with --resnet_size applied)."""
        return self.model

    @property
    def eval_batch_per_process(self) -> int:
        """Evaluation images per process per batch: eval_batch_size as its docstring says, with the
        node's process count read off the resolved batches (node_batch_size / batch_size)."""
        if not self.eval_batch_size:
            return self.batch_size
        if self.node_batch_size:
            return max(1, self.eval_batch_size * self.batch_size // self.node_batch_size)
        return self.eval_batch_size

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


# The seeds' spellings that are not field names (the ResNet seed's imagenet_main.py flags; fasttrain/
# flags.py adds those whose value it converts and those it only notes).
ALIASES = {
    "train_batch_size": "node_batch_size",
    "output_dir": "train_dir",
    "epochs_per_eval": "eval_every_epochs",
    "learning_rate": "initial_learning_rate",
}


# Each named recipe as a Config (validated here, at import: a recipe that does not validate is a bug).
RECIPES: dict[str, Config] = {name: Config(**settings) for name, settings in RECIPE_SETTINGS.items()}


def make_config(**overrides) -> Config:
    """The named recipe's Config (overrides['recipe'], default demo) with overrides applied."""
    recipe = overrides.get("recipe", "demo")
    if recipe not in RECIPES:
        raise ConfigError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    size, model = overrides.get("resnet_size"), overrides.get("model")
    if size and model and model not in (f"resnet{size}", f"resnet{size}_v2"):
        # Both given: the seed's flag would silently win, training a model the user did not name.
        raise ConfigError(f"--resnet_size={size} and --model={model} conflict; give one of them")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ConfigError(f"unknown config field(s): {', '.join(sorted(unknown))}")
    if "batch_size" in overrides:
        if overrides.get("node_batch_size"):
            node, per_process = overrides["node_batch_size"], overrides["batch_size"]
            raise ConfigError(
                f"--node_batch_size={node} and --batch_size={per_process} conflict: the node's batch is "
                "divided into the per-process one; give one of them"
            )
        overrides = {"node_batch_size": 0, **overrides}  # a per-process batch replaces a recipe's node batch
    return dataclasses.replace(RECIPES[recipe], **overrides)


def number_list(text: str) -> list[float]:
    """'30,60,80,90' -> [30.0, 60.0, 80.0, 90.0]: a list setting as its flag, and config.json before it
    was a list, spell it. ValueError when an item is not a number."""
    return [float(v) for v in text.split(",") if v.strip()]


def default_cache_dir() -> Path:
    """Where the demo data set and index files for read-only data directories are cached."""
    root = os.environ.get("FASTTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fasttrain"
    )
    return Path(root)
