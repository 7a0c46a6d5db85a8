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
    heads = tuple(classifier_names(model))
    skip = heads if cfg.fine_tune else ()
    state, source_model = _pretrained_state(model, cfg, skip)
    own = model.state_dict()
    wanted = {k: v for k, v in state.items() if not (skip and k.startswith(skip))}
    missing = [k for k in own if k not in wanted and not (skip and k.startswith(skip))]
    mismatched = [k for k, v in wanted.items() if k in own and own[k].shape != v.shape]
    unexpected = sorted(set(wanted) - set(own))
    if missing or mismatched or unexpected:
        if mismatched:
            problem = f"shapes differ for {', '.join(mismatched[:3])}"
        elif missing and unexpected:  # another model, or another naming
            problem = f"missing {', '.join(missing[:3])}; it has {', '.join(unexpected[:3])} instead"
        elif missing:
            problem = f"missing {', '.join(missing[:3])}"
        else:
            problem = f"unexpected {', '.join(unexpected[:3])}"
        # The classifier's parameters alone (another num_classes): what fine_tune leaves out. A body that
        # differs (another depth) is another model, which fine_tune does not make fit.
        head_only = all(_in_layers(k, heads) for k in (*missing, *mismatched, *unexpected))
        hint = " (pass fine_tune to re-initialise the classifier)" if head_only and not cfg.fine_tune else ""
        other = f" (it is a {source_model} checkpoint)" if source_model not in ("", cfg.model_name) else ""
        raise ckpt.CheckpointError(
            f"{cfg.pretrained_model_checkpoint_path} does not fit model {cfg.model_name}{other}: "
            f"{problem}{hint}",
            settings=("fine_tune",),
        )
    model.load_state_dict(wanted, strict=False)
    if cfg.fine_tune:
        reset_classifier(model)
    log(
        f"restored weights from {cfg.pretrained_model_checkpoint_path}"
        f"{' (classifier re-initialised)' if cfg.fine_tune else ''}"
    )


def _in_layers(key: str, layers: tuple[str, ...]) -> bool:
    """Whether state_dict `key` is a parameter or buffer of one of `layers` ("fc": fc.weight, not fc2.w)."""
    return any(key == layer or key.startswith(f"{layer}.") for layer in layers)


def _pretrained_state(model: torch.nn.Module, cfg: Config, skip: tuple[str, ...]) -> tuple[dict, str]:
    """The pretrained checkpoint's model state: a fasttrain file's, or a TF checkpoint's raw weights
    (what the Inception seed restores), the `skip` prefixes left out (fasttrain.tf.state); and the model
    a fasttrain file's config names ("" for the others)."""
    path = cfg.pretrained_model_checkpoint_path
    if not is_tf_checkpoint(path):
        return _torch_file_state(Path(path))
    from fasttrain.tf.checkpoint import open_checkpoint
    from fasttrain.tf.state import model_state, name_map

    try:
        return model_state(open_checkpoint(path), cfg.model_name, model, skip=skip), ""
    except ckpt.CheckpointError as exc:
        heads = tuple(classifier_names(model))
        head_names = [v.name for k, v in name_map(cfg.model_name, model).items() if k.startswith(heads)]
        about_head = any(f"variable {name} has shape" in str(exc) for name in head_names)
        hint = " (pass fine_tune to re-initialise the classifier)" if about_head and not cfg.fine_tune else ""
        raise ckpt.CheckpointError(f"{exc}{hint}", settings=("fine_tune", *exc.settings)) from None


def _torch_file_state(path: Path) -> tuple[dict, str]:
    """The model state a torch.save file holds: a fasttrain checkpoint's "model" (`fasttrain.tf.convert
    from-tf` writes one too), or a plain state_dict, parameter names to tensors (`torch.save(model.
    state_dict(), path)`, torchvision's weight files: fasttrain's ResNet v1.5 and Inception v3 use
    torchvision's names), without the "module." prefix a DDP-wrapped model's names carry; and the model a
    fasttrain file's config names ("" for a plain state_dict)."""
    state = ckpt.load_tensors(path)
    if isinstance(state, dict) and "model" in state and "step" in state:
        if not ckpt.is_state_dict(state["model"]):
            raise ckpt.CheckpointError(
                f"{path} holds no state_dict under 'model' (parameter names to tensors)",
                settings=("pretrained_model_checkpoint_path",),
            )
        config = state.get("config")
        named = config.get("model") if isinstance(config, dict) else None
        return state["model"], named if isinstance(named, str) else ""
    if isinstance(state, dict) and state and ckpt.is_state_dict(state):
        if all(k.startswith("module.") for k in state):
            return {k[len("module.") :]: v for k, v in state.items()}, ""
        return state, ""
    # A training script's own dict (epoch, optimizer, ...) or something else: say how to keep the weights.
    inner = [k for k, v in state.items() if isinstance(v, dict) and v] if isinstance(state, dict) else []
    held = (
        f"a dict of {', '.join(map(repr, list(state)[:4]))}"
        if isinstance(state, dict)
        else type(state).__name__
    )
    wrap = f"torch.load({str(path)!r})[{inner[0]!r}]" if inner else "model.state_dict()"
    raise ckpt.CheckpointError(
        f"{path} holds {held}, neither a fasttrain checkpoint nor a state_dict (parameter names to tensors); "
        f"save the weights alone, torch.save({wrap}, 'weights.pt'), and pass that file",
        settings=("pretrained_model_checkpoint_path",),
    )
