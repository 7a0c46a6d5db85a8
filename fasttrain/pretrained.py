"""Start a run from another run's weights: --pretrained_model_checkpoint_path, with --fine_tune.

The checkpoint is a fasttrain file (its "model" state) or a TF checkpoint of the seed's model (its raw
weights, what the Inception seed restores; fasttrain.tf.state.model_state). With fine_tune the
classifier is left out and re-initialised.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fasttrain import checkpoint as ckpt
from fasttrain.config import Config
from fasttrain.models import classifier_names, reset_classifier
from fasttrain.tf.checkpoint import is_tf_checkpoint


def restore_pretrained(model: torch.nn.Module, cfg: Config, log) -> None:
    """Start from another run's weights; with --fine_tune, all but the re-initialised classifier."""
    skip = tuple(classifier_names(model)) if cfg.fine_tune else ()
    state = _pretrained_state(model, cfg, skip)
    own = model.state_dict()
    wanted = {k: v for k, v in state.items() if not (skip and k.startswith(skip))}
    missing = [k for k in own if k not in wanted and not (skip and k.startswith(skip))]
    mismatched = [k for k, v in wanted.items() if k in own and own[k].shape != v.shape]
    if missing or mismatched or set(wanted) - set(own):
        problem = (
            f"shapes differ for {', '.join(mismatched[:3])}"
            if mismatched
            else f"missing {', '.join((missing or sorted(set(wanted) - set(own)))[:3])}"
        )
        hint = "" if cfg.fine_tune else " (pass fine_tune to re-initialise the classifier)"
        raise ckpt.CheckpointError(
            f"{cfg.pretrained_model_checkpoint_path} does not fit model {cfg.model_name}: {problem}{hint}",
            settings=("fine_tune",),
        )
    model.load_state_dict(wanted, strict=False)
    if cfg.fine_tune:
        reset_classifier(model)
    log(
        f"restored weights from {cfg.pretrained_model_checkpoint_path}"
        f"{' (classifier re-initialised)' if cfg.fine_tune else ''}"
    )


def _pretrained_state(model: torch.nn.Module, cfg: Config, skip: tuple[str, ...]) -> dict:
    """The pretrained checkpoint's model state: a fasttrain file's, or a TF checkpoint's raw weights
    (what the Inception seed restores), the `skip` prefixes left out (fasttrain.tf.state)."""
    path = cfg.pretrained_model_checkpoint_path
    if not is_tf_checkpoint(path):
        return ckpt.load_checkpoint(Path(path))["model"]
    from fasttrain.tf.checkpoint import open_checkpoint
    from fasttrain.tf.state import model_state, name_map

    try:
        return model_state(open_checkpoint(path), cfg.model_name, model, skip=skip)
    except ckpt.CheckpointError as exc:
        heads = tuple(classifier_names(model))
        head_names = [v.name for k, v in name_map(cfg.model_name, model).items() if k.startswith(heads)]
        about_head = any(f"variable {name} has shape" in str(exc) for name in head_names)
        hint = " (pass fine_tune to re-initialise the classifier)" if about_head and not cfg.fine_tune else ""
        raise ckpt.CheckpointError(f"{exc}{hint}", settings=("fine_tune", *exc.settings)) from None
