"""The seeds' own flags, translated: which recipe a command line without --recipe trains (`seed_recipe`),
the ResNet seed's flags whose value changes convention (SEED_CONVERSIONS), and the flags of either seed
that fasttrain has no use for, taken with a one-line note saying what it does instead (NOTED_FLAGS).
fasttrain.flags parses the command line with these. Imports no torch.
"""

from __future__ import annotations

from fasttrain.config import RECIPES, ConfigError

# TF 1.4's fused batch norm raised any smaller epsilon to this (cuDNN's minimum): the ResNet seed's
# layers, fused=True with epsilon 1e-5, ran at 1.001e-5 (tf.layers normalization.py, _fused_batch_norm).
TF_FUSED_BN_MIN_EPSILON = 1.001e-5


def _bn_decay(decay: float) -> float:
    return 1 - decay  # TF's moving = decay * moving + (1 - decay) * batch; torch's momentum is 1 - decay


def _bn_epsilon(eps: float) -> float:
    return max(eps, TF_FUSED_BN_MIN_EPSILON)


# The ResNet seed's flags whose value is converted into a field's convention: name -> (field, convert,
# the note printed when the conversion is not the expected one, or None). The seed parsed both but its
# model kept resnet_model.py's constants (0.997, 1e-5); here they set the BN of the model that trains.
SEED_CONVERSIONS = {
    "batch_norm_decay": ("bn_momentum", _bn_decay, None),
    "batch_norm_epsilon": (
        "bn_eps",
        _bn_epsilon,
        f"raised to {TF_FUSED_BN_MIN_EPSILON}, TF 1.4's fused batch-norm floor, as the seed ran it",
    ),
}

# The seeds' flags fasttrain has no use for: accepted (with any value) and noted once, saying what
# fasttrain does instead. ResNet seed: imagenet_main.py; Inception seed: inception_train.py and
# image_processing.py.
NOTED_FLAGS = {
    "work_dir": "the UAI SDK's working directory; fasttrain writes only to --train_dir (--output_dir)",
    "log_dir": "the UAI SDK's log directory; fasttrain logs to stdout and writes metrics.jsonl and "
    "TensorBoard files into --train_dir",
    "variable_strategy": "no parameter server: every process holds the variables and gradients are "
    "all-reduced (--grad_sync)",
    "sync": "training is always synchronous (one all-reduce per step)",
    "num_layers": "the seed never read it (a CIFAR leftover); the depth is --resnet_size or --model",
    "use_distortion_for_training": "training images are always augmented (the seed's flag was argparse "
    "type=bool, so any value it was given meant True)",
    "num_preprocess_threads": "images are decoded and augmented by --num_workers threads per rank "
    "(torch backend; DataLoader processes with --loader=processes) or DALI's --num_workers CPU threads",
    "num_readers": "each rank reads the records fasttrain.data.sharding plans for it; its --num_workers "
    "threads decode them",
    "input_queue_memory_factor": "the shuffle buffer holds --shuffle_buffer records",
    "log_device_placement": "one process per device (torchrun's LOCAL_RANK) holds the whole model; "
    "there is no placement to log",
    "data_format": "the memory layout is --channels_last (NHWC; default on CUDA GPUs with tensor cores)",
    "num_intra_threads": "fasttrain sets torch's intra-op threads itself (the run's first line says how "
    "many; OMP_NUM_THREADS overrides)",
    "num_inter_threads": "torch runs a step's operators in order; the intra-op threads are fasttrain's "
    "choice (the run's first line; OMP_NUM_THREADS overrides)",
}
# The distributed Inception seed's flags (inception_distributed_train.py) that no fasttrain flag replaces
# one for one: refused, each with what to run instead (a parameter-server job, or a run that checkpoints
# at other times than the user asked, is not one to start on a guess).
_PS_LAUNCH = (
    "--job_name/--task_id/--ps_hosts/--worker_hosts are the parameter-server launch of "
    "inception_distributed_train.py: launch with torchrun --nnodes=N --nproc_per_node=G ... -m fasttrain "
    "--recipe inception_v3 (that program's own defaults were --initial_learning_rate=0.045 "
    "--num_epochs_per_decay=2 --learning_rate_decay_factor=0.94)"
)
REFUSED_FLAGS = {
    "job_name": _PS_LAUNCH,
    "task_id": _PS_LAUNCH,
    "ps_hosts": _PS_LAUNCH,
    "worker_hosts": _PS_LAUNCH,
    "num_replicas_to_aggregate": "--num_replicas_to_aggregate is SyncReplicasOptimizer's, of "
    "inception_distributed_train.py: fasttrain's every step all-reduces the gradients of all processes "
    "(torchrun's), as that program's default (-1: every worker) did; leave it out",
    "save_interval_secs": "--save_interval_secs is inception_distributed_train.py's checkpoint interval in "
    "seconds (600): fasttrain writes a checkpoint every --checkpoint_every steps (5000) and at the end; "
    "give that instead",
    "save_summaries_secs": "--save_summaries_secs is inception_distributed_train.py's summary interval in "
    "seconds (180): fasttrain writes its TensorBoard scalars every --log_every steps (histograms: "
    "--histogram_every); give those instead",
}

# The noted flags that are TF booleans (inception_train.py DEFINE_boolean): TF's flags spell their false
# --noNAME (--nolog_device_placement), as they do the booleans that are fields (--nofine_tune).
NOTED_BOOLEANS = ("log_device_placement",)


# Which recipe a command line without --recipe trains (`seed_recipe`). The demo's own command lines
# use fasttrain's field names, so only flags that fasttrain's users have no reason to type select a
# seed's recipe: each seed's flags that no fasttrain field is named after (beyond plain synonyms:
# --output_dir and --learning-rate stay aliases on every recipe) and the seed-only fields
# --resnet_size and --num_gpus. Names as typed, '-' read as '_'.
RESNET_SEED_FLAGS = (  # imagenet_main.py's (the UAI SDK adds --work_dir and --log_dir)
    "train_batch_size", "resnet_size", "epochs_per_eval", "batch_norm_decay", "batch_norm_epsilon",
    "work_dir", "log_dir", "variable_strategy", "sync", "num_layers", "use_distortion_for_training",
    "data_format", "num_intra_threads", "num_inter_threads",
)  # fmt: skip
INCEPTION_SEED_FLAGS = ("num_preprocess_threads", "num_readers", "input_queue_memory_factor")  # its queues
# Flags both seeds have (inception_train.py and imagenet_main.py): on their own they do not say which
# program is meant; then the flags that only one of the seeds spells that way decide, the Inception
# seed's --train_dir, --batch_size, --max_steps against the ResNet seed's --output_dir,
# --train-batch-size, --train-epochs.
BOTH_SEEDS_FLAGS = ("num_gpus", "log_device_placement")
INCEPTION_SEED_SPELLINGS = (
    "train_dir", "batch_size", "max_steps", "subset", "image_size", "initial_learning_rate",
    "num_epochs_per_decay", "learning_rate_decay_factor", "pretrained_model_checkpoint_path", "fine_tune",
)  # fmt: skip
RESNET_SEED_SPELLINGS = (
    "output_dir", "train_epochs", "learning_rate", "eval_batch_size", "momentum", "weight_decay",
)  # fmt: skip
_RESNET_SEED, _INCEPTION_SEED = "the ResNet seed", "the Inception seed"
_PROGRAM = {
    "resnet50": "imagenet_main.py",
    "resnet101": "imagenet_main.py",
    "inception_v3": "inception_train.py",
}
_ADD_RECIPE = (
    "add --recipe resnet50 or resnet101 (the ResNet seed) or --recipe inception_v3 (the Inception seed)"
)


def seed_recipe(seen: dict[str, str], values: dict) -> tuple[str, str] | None:
    """(recipe, the start-up line) when a command line without --recipe holds flags only a seed's program
    has: the ResNet seed's select resnet101 for --resnet_size=101, else resnet50 (the seed's default
    size; another --resnet_size picks resnet<N>_v2 within it), the Inception seed's inception_v3. None:
    the demo. ConfigError when the flags belong to both programs and nothing says which.

    seen: each flag's name as typed ('-' as '_') -> the flag; values: the parsed fields."""
    resnet = [
        seen[n] for n in RESNET_SEED_FLAGS if n in seen and (n != "resnet_size" or values.get("resnet_size"))
    ]
    inception = [seen[n] for n in INCEPTION_SEED_FLAGS if n in seen]
    if resnet and inception:
        raise ConfigError(
            f"{', '.join(resnet)} ({_RESNET_SEED}'s) and {', '.join(inception)} ({_INCEPTION_SEED}'s) are "
            f"flags of different programs: {_ADD_RECIPE}"
        )
    if not resnet and not inception:
        both = [seen[n] for n in BOTH_SEEDS_FLAGS if n in seen]
        if not both:
            return None
        resnet_spelled = [seen[n] for n in RESNET_SEED_SPELLINGS if n in seen]
        inception_spelled = [seen[n] for n in INCEPTION_SEED_SPELLINGS if n in seen]
        if bool(resnet_spelled) == bool(inception_spelled):
            why = (
                f"with {', '.join(resnet_spelled + inception_spelled)} could be either seed's command line"
                if resnet_spelled
                else "is in both seeds' command lines and no other flag says which"
            )
            raise ConfigError(f"{', '.join(both)} {why}: {_ADD_RECIPE}")
        resnet = both + resnet_spelled if resnet_spelled else []
        inception = both + inception_spelled if inception_spelled else []
    if resnet:
        recipe, program = ("resnet101" if values.get("resnet_size") == 101 else "resnet50"), _RESNET_SEED
    else:
        recipe, program = "inception_v3", _INCEPTION_SEED
    return recipe, (
        f"fasttrain: recipe {recipe}: {program}'s program ({_PROGRAM[recipe]}), selected by its flags "
        f"{', '.join(resnet or inception)} (no --recipe given; --recipe NAME trains another)"
    )


def machine_batch(values: dict, spelled: dict[str, str], notes: dict[str, str]) -> None:
    """With --num_gpus, the Inception seed's --batch_size is one machine's, split over its --num_gpus towers
    (inception_train.py: split_batch_size = batch_size / num_gpus): fasttrain's node batch, divided over
    the node's processes; values (the parsed fields) and spelled get node_batch_size in its place, and
    notes a line when it is split. Read per process, --num_gpus=8 --batch_size=32 trained 8x the batch.
    Without --batch_size the seed's default, 32 (image_processing.py), is the machine's on the
    inception_v3 recipe: --num_gpus=2 alone trained a global batch of 64."""
    gpus = values.get("num_gpus")
    if "num_gpus" not in values or "node_batch_size" in values:
        return
    if "batch_size" in values:
        batch = values.pop("batch_size")
        values["node_batch_size"], spelled["node_batch_size"] = batch, spelled.pop("batch_size")
        given = f"--batch_size={batch} with --num_gpus={gpus}"
    elif values.get("recipe") == "inception_v3" and gpus:
        batch = values["node_batch_size"] = RECIPES["inception_v3"].batch_size
        given = f"--num_gpus={gpus} without --batch_size: the seed's default --batch_size={batch}"
    else:
        return
    if gpus != 1:
        notes["batch_size"] = (
            f"{given} is one machine's batch, as the Inception seed splits it over its GPUs: it sets "
            f"--node_batch_size={batch}, divided over this node's processes (torchrun --nproc_per_node)"
        )
