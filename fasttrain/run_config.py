"""The run's config as resolved and as saved.

A node's batch over its processes (`resolve_node_batch`, which train() applies first, so config.json
and the checkpoints hold the per-process batch that trained; the model --resnet_size selects is
resolved by Config itself), and config.json files of earlier versions read in this version's terms
(`upgrade_saved_config`, for a resume's comparison and the evaluator).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from fasttrain.config import ConfigError, number_list

if TYPE_CHECKING:
    from fasttrain.config import Config


def processes_per_node(node_batch_size: int = 0) -> int:
    """This node's process count: torchrun's LOCAL_WORLD_SIZE (its --nproc_per_node), 1 without it.
    ConfigError when a node_batch_size is to be divided and WORLD_SIZE says several processes but
    LOCAL_WORLD_SIZE is unset (a launcher other than torchrun): 1 gave each process the node's batch."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    if node_batch_size and "LOCAL_WORLD_SIZE" not in os.environ and world.isdigit() and int(world) > 1:
        raise ConfigError(
            f"--node_batch_size={node_batch_size} is divided over this node's processes, but "
            f"WORLD_SIZE={world} comes without LOCAL_WORLD_SIZE: set LOCAL_WORLD_SIZE to the node's process "
            "count (torchrun sets it), or give --batch_size per process"
        )
    text = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        return max(1, int(text))
    except ValueError:
        raise ConfigError(f"LOCAL_WORLD_SIZE={text!r} is not a process count (torchrun sets it)") from None


def resolve_node_batch(cfg: Config, processes: int) -> Config:
    """cfg on a node of `processes` processes: batch_size = node_batch_size / processes (the ResNet seed's
    `int(batch_size / num_shards)` per tower, imagenet.py make_batch), which must divide evenly, as the
    seed requires of --train-batch-size and --eval-batch-size over --num_gpus (imagenet_main.py)."""
    if not cfg.node_batch_size:
        return cfg
    for name, spelled in (
        # Set by the ResNet seed's --train-batch-size, or by the Inception seed's --batch_size with
        # --num_gpus (seed_flags.machine_batch): the message names both, not the one not typed.
        ("node_batch_size", "the ResNet seed's --train-batch-size, or --batch_size with --num_gpus"),
        ("eval_batch_size", "the ResNet seed's --eval-batch-size"),
    ):
        value = getattr(cfg, name)
        if value % processes:
            raise ConfigError(
                f"--{name}={value} ({spelled}) is one node's batch and does not divide over "
                f"its {processes} processes (torchrun --nproc_per_node={processes}): choose a multiple "
                f"of {processes}"
            )
    return dataclasses.replace(cfg, batch_size=cfg.node_batch_size // processes)


def upgrade_saved_config(saved: dict) -> dict:
    """A config saved by any fasttrain version (config.json, a checkpoint's "config") in this version's
    terms. lr_boundary_epochs was saved as the flag's text, "30,60,80,90", before it was a list. Before
    input_order existed (the ResNet seed's recipes came with it), recipes resnet50/resnet101 were what
    resnet50_v1.5/resnet101_v1.5 are now, and "model" was saved as given, not after resnet_size
    (resnet_size 50 beside model "resnet101" trained resnet50). Before inception_bn_gamma existed,
    inception_v3 always had a BN gamma (torchvision's structure), which is inception_bn_gamma=True now.
    Before loader existed, the torch backend's only loader was DataLoader processes; before "auto", the
    default was threads, and config.json has held the loader a run used since then. Before no_decay_bn
    existed, no run exempted BN alone from weight decay (the v1.5 recipes decayed gamma and beta)."""
    saved = dict(saved)
    text = saved.get("lr_boundary_epochs")
    if isinstance(text, str):
        try:
            saved["lr_boundary_epochs"] = number_list(text)
        except ValueError:
            raise ConfigError(
                f"the saved lr_boundary_epochs {text!r} is not a comma-separated list of numbers"
            ) from None
    if "input_order" not in saved:
        if saved.get("recipe") in ("resnet50", "resnet101"):
            saved["recipe"] += "_v1.5"
        size, model = saved.get("resnet_size"), saved.get("model")
        if size and isinstance(model, str) and model.startswith("resnet"):
            saved["model"] = f"resnet{size}"
    if "loader" not in saved:
        saved["loader"] = "processes"
    if "inception_bn_gamma" not in saved and saved.get("model") == "inception_v3":
        saved["inception_bn_gamma"] = True
    saved.setdefault("no_decay_bn", False)
    return saved
