"""TF checkpoints of the seeds' models into fasttrain's objects, and back: driven by fasttrain.tf_names.

    weights = model_state(ckpt, "inception_v3", model)             # raw weights, or ema=True
    step = load_run(ckpt, cfg, run, log)                            # continue a TF run: everything
    tensors = export_tensors("inception_v3", model, optimizer, bn_ema, step, "rmsprop")

What a TF run holds and where fasttrain keeps it (`v` is a variable's full name from the name map):

    v                                   model.state_dict() entry (layout converted: conv HWIO <-> OIHW,
                                        dense (in, out) <-> (out, in))
    v/ExponentialMovingAverage          the optimizer's "ema" buffer (trainable v); BufferEMA's shadow
                                        (BN moving_mean/moving_variance, which the Inception seed
                                        averages too: trainable_variables() + moving_average_variables())
    v/RMSProp, v/RMSProp_1              RMSProp's ms ("square_avg") and momentum ("momentum_buffer"):
                                        RMSPropOptimizer makes the "rms" slot first, then "momentum"
    v/Momentum                          MomentumOptimizer's accumulator ("momentum_buffer")
    global_step                         the step counter and the EMA's num_updates (applied_steps);
                                        float32 in the Inception seed, int64 in the ResNet seeds

A map entry with layout "ones" (slim's batch norm has no gamma) is 1 on import, its slots fresh
(ms 1, momentum 0) and its shadow 1, and is left out on export (with a note if it is not all ones).
A TF run continued here has no fasttrain data position: it starts the epoch that holds its step from
that epoch's first batch. Every mismatch is one CheckpointError line naming the variable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from fasttrain.checkpoint import CheckpointError
from fasttrain.tf_names import TFVariable, to_tf, to_torch, variable_map

EMA = "ExponentialMovingAverage"
GLOBAL_STEP = "global_step"
SLOTS = {
    "rmsprop": {"square_avg": "RMSProp", "momentum_buffer": "RMSProp_1"},
    "momentum": {"momentum_buffer": "Momentum"},
}
_FRESH = {"square_avg": 1.0, "momentum_buffer": 0.0}  # TF's slot initial values (RMSProp ms is ones)
# Leaf names of the seeds' model variables: a TF variable ending in one that no map entry names is an
# extra variable (another architecture), whereas anything else (slots, averages, loss averages) is not.
_MODEL_LEAVES = {"weights", "biases", "kernel", "bias", "gamma", "beta", "moving_mean", "moving_variance"}


def global_step_dtype(model_name: str) -> np.dtype:
    """The seed's global_step dtype: float32 in the Inception seed, int64 in the ResNet seeds."""
    return np.dtype(np.float32 if model_name == "inception_v3" else np.int64)


def name_map(model_name: str, model: torch.nn.Module) -> dict[str, TFVariable]:
    try:
        return variable_map(model_name, model)
    except (ValueError, ImportError) as exc:
        raise CheckpointError(f"no TensorFlow names for model {model_name}: {exc}") from None


def _fail(ckpt, model_name: str, what: str, settings: tuple[str, ...] = ()) -> CheckpointError:
    return CheckpointError(
        f"TensorFlow checkpoint {ckpt.prefix} does not fit model {model_name}: {what}", settings=settings
    )


def _read(
    ckpt, model_name: str, var: TFVariable, like: torch.Tensor, suffix: str = ""
) -> torch.Tensor | None:
    """Variable `var.name + suffix` in torch's layout and `like`'s shape and dtype; None if absent."""
    if var.layout == "ones":
        return torch.ones_like(like, device="cpu")
    name = var.name + suffix
    shapes = ckpt.shapes()
    if name not in shapes:
        return None
    want = tuple(to_tf(np.empty(tuple(like.shape), np.uint8), var.layout).shape)
    if shapes[name][0] != want:
        raise _fail(ckpt, model_name, f"variable {name} has shape {shapes[name][0]}, the model's is {want}")
    return torch.from_numpy(to_torch(ckpt.get(name), var.layout)).to(like.dtype)


def check_variables(ckpt, model_name: str, vmap: dict[str, TFVariable], skip: tuple[str, ...] = ()) -> None:
    """CheckpointError when the checkpoint is another model's or holds model variables the map lacks."""
    names = set(ckpt.shapes())
    mapped = {v.name for v in vmap.values() if v.layout != "ones"}
    if not mapped & names:
        held = sorted(n for n in names if n.rsplit("/", 1)[-1] in _MODEL_LEAVES)[:1] or sorted(names)[:1]
        raise _fail(
            ckpt,
            model_name,
            f"none of its variables is there (it needs e.g. {min(mapped)}; the checkpoint holds e.g. "
            f"{held[0] if held else 'nothing'}): another model's checkpoint?",
            settings=("model",),
        )
    skipped = {v.name for k, v in vmap.items() if skip and k.startswith(skip)}
    extra = sorted(n for n in names - mapped - skipped if n.rsplit("/", 1)[-1] in _MODEL_LEAVES)
    if extra:
        raise _fail(
            ckpt,
            model_name,
            f"variable {extra[0]} is not in the model ({len(extra)} such)",
            settings=("model",),
        )


def model_state(
    ckpt, model_name: str, model: torch.nn.Module, *, ema: bool = False, skip: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """A state_dict for `model` (all its floating-point entries but those under `skip` prefixes).

    ema: each variable's ExponentialMovingAverage shadow where the checkpoint has one (what the seed's
    eval program restores), the variable itself where not; an error if it has none at all.
    """
    vmap = name_map(model_name, model)
    check_variables(ckpt, model_name, vmap, skip)
    names = ckpt.shapes()
    if ema and not any(f"{v.name}/{EMA}" in names for v in vmap.values()):
        raise CheckpointError(
            f"TensorFlow checkpoint {ckpt.prefix} has no {EMA} shadows (the run kept no EMA)"
        )
    own = model.state_dict()
    # The entries TF has no counterpart of (BN's num_batches_tracked, unused with a set momentum) as
    # the model has them, so that the result is a whole state_dict.
    out = {k: v.detach().cpu().clone() for k, v in own.items() if k not in vmap}
    for key, var in vmap.items():
        if skip and key.startswith(skip):
            continue
        value = _read(ckpt, model_name, var, own[key], f"/{EMA}") if ema else None
        if value is None:
            value = _read(ckpt, model_name, var, own[key])
        if value is None:
            raise _fail(ckpt, model_name, f"variable {var.name} is missing")
        out[key] = value
    return out


def network_widths(reader, model_name: str) -> tuple[int, int]:
    """(num_classes, base_channels) of the checkpoint's network: its classifier's and its stem
    convolution's output widths (the last dimension of each in TF's layout)."""
    from fasttrain.models import classifier_names, create_model

    probe = create_model(model_name, 1001)
    vmap = name_map(model_name, probe)
    stem = next(iter(vmap.values())).name
    classifier = vmap[f"{classifier_names(probe)[0]}.weight"].name
    shapes = reader.shapes()
    for name in (stem, classifier):
        if name not in shapes:
            raise CheckpointError(
                f"TensorFlow checkpoint {reader.prefix} has no {name}: is it a {model_name}?"
            )
    base = shapes[stem][0][-1] if model_name.startswith("resnet") else 64
    return int(shapes[classifier][0][-1]), int(base)


def config_for(cfg, ckpt):
    """cfg with the checkpoint's class count (label_offset 0 for 1001: class 0 is the seeds'
    background) and ResNet width: a recipe made for a TF run directory, which has no config.json."""
    num_classes, base_channels = network_widths(ckpt, cfg.model_name)
    changes = {"base_channels": base_channels}
    if num_classes != cfg.num_classes:
        changes.update(num_classes=num_classes, label_offset=0 if num_classes == 1001 else cfg.label_offset)
    return dataclasses.replace(cfg, **changes)


def read_global_step(ckpt) -> int:
    if GLOBAL_STEP not in ckpt.shapes():
        raise CheckpointError(
            f"TensorFlow checkpoint {ckpt.prefix} has no global_step, so no step to continue"
        )
    return int(ckpt.get(GLOBAL_STEP))


def _param_names(model: torch.nn.Module, optimizer) -> list[str]:
    """The state_dict key of each parameter in the optimizer's state order (flat registration order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in optimizer.flat.registration_order]


def load_run(ckpt, cfg, run, log: Callable[[str], None]) -> int:
    """Continue the TF run `ckpt` in `run`: weights, BN statistics, slots, EMA, step, data position.
    Returns the step (global_step)."""
    model_name, model, optimizer = cfg.model_name, run.model, run.optimizer
    vmap = name_map(model_name, model)
    model.load_state_dict(model_state(ckpt, model_name, model))
    step = read_global_step(ckpt)
    names = set(ckpt.shapes())
    slots = SLOTS[cfg.optimizer]
    state = optimizer.state_dict()
    shadows_missing = 0
    params = dict(model.named_parameters())
    for i, key in enumerate(_param_names(model, optimizer)):
        var, entry, param = vmap[key], state["state"][i], params[key]
        for state_key, suffix in slots.items():
            value = _read(ckpt, model_name, var, param, f"/{suffix}")
            if var.layout == "ones":
                value = torch.full_like(value, _FRESH[state_key])
            if value is None:
                other = [o for o, s in SLOTS.items() if f"{var.name}/{next(iter(s.values()))}" in names]
                why = f" (it was trained with {other[0]})" if other else ""
                what = f"variable {var.name}/{suffix} of optimizer {cfg.optimizer} is missing{why}"
                raise _fail(ckpt, model_name, what, settings=("optimizer",))
            entry[state_key] = value
        if "ema" in entry:
            shadow = _read(ckpt, model_name, var, param, f"/{EMA}")
            shadows_missing += shadow is None
            entry["ema"] = (
                param.detach().cpu().clone() if shadow is None else shadow
            )  # TF starts at the weight
        entry["step"] = torch.full_like(entry["step"], step)
    optimizer.load_state_dict(state)
    if run.bn_ema is not None:
        own = model.state_dict()
        shadows = {}
        for name in run.bn_ema.names:
            shadow = _read(ckpt, model_name, vmap[name], own[name], f"/{EMA}")
            shadows_missing += shadow is None
            shadows[name] = own[name] if shadow is None else shadow
        run.bn_ema.load_state_dict(shadows)
    train_step = run.step.state_dict()
    train_step["step_count"] = torch.full_like(train_step["step_count"], step)
    run.step.load_state_dict(train_step)
    # As fasttrain.train counts an epoch's steps: records over the global batch.
    global_batch = cfg.batch_size * run.info.world_size * cfg.grad_accum_steps
    steps_per_epoch = max(1, (cfg.epoch_size or run.loader.num_records) // global_batch)
    epoch = step // steps_per_epoch
    run.loader.load_state_dict({"epoch": epoch, "batch": 0})
    log(
        f"continuing TensorFlow run {ckpt.prefix} ({ckpt.version}) at step {step}: a TF checkpoint has no "
        f"data position, so epoch {epoch} starts again from its first batch"
    )
    if shadows_missing and cfg.ema_decay:
        log(f"note: {shadows_missing} variables had no {EMA} shadow; their EMA starts at the current values")
    if not cfg.ema_decay and any(n.endswith(f"/{EMA}") for n in names):
        log(f"note: the TF run kept an EMA ({EMA} shadows), which ema_decay 0 leaves behind")
    return step


def export_tensors(
    model_name: str, model: torch.nn.Module, optimizer, bn_ema, step: int, optimizer_kind: str
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The seed's TF variables for fasttrain's state: weights, BN statistics, slots, EMA shadows and
    global_step (optimizer and bn_ema may be None). Also the notes to show (values TF cannot hold)."""
    vmap = name_map(model_name, model)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}
    lost = []
    for key, var in vmap.items():
        if var.layout == "ones":
            if not torch.all(state[key] == 1):
                lost.append(key)
            continue
        out[var.name] = to_tf(state[key].numpy(), var.layout)
    if optimizer is not None:
        saved = optimizer.state_dict()["state"]
        for i, key in enumerate(_param_names(model, optimizer)):
            var = vmap[key]
            if var.layout == "ones":
                continue
            for state_key, suffix in SLOTS[optimizer_kind].items():
                out[f"{var.name}/{suffix}"] = to_tf(saved[i][state_key].cpu().numpy(), var.layout)
            if "ema" in saved[i]:
                out[f"{var.name}/{EMA}"] = to_tf(saved[i]["ema"].cpu().numpy(), var.layout)
    if bn_ema is not None:
        for name, shadow in bn_ema.state_dict().items():
            if vmap[name].layout != "ones":
                out[f"{vmap[name].name}/{EMA}"] = to_tf(shadow.cpu().numpy(), vmap[name].layout)
    out[GLOBAL_STEP] = np.asarray(step, dtype=global_step_dtype(model_name))
    notes = []
    if lost:
        notes.append(
            f"note: {len(lost)} batch-norm scales (e.g. {lost[0]}) are not 1, and the seed's network has no "
            "such variable: TF will compute with 1 (train with the exact seed network to avoid this)"
        )
    return out, notes


def load_eval_weights(model: torch.nn.Module, optimizer, bn_ema, raw: dict, ema: dict | None) -> None:
    """For evaluate_raw_and_ema: `raw` (a state_dict) into the model, and `ema` (a state_dict of the
    averaged weights and BN statistics; None: the raw ones) into the optimizer's EMA buffer and the BN
    EMA's shadows."""
    model.load_state_dict(raw)
    ema = ema or raw
    if optimizer is not None and optimizer.ema_decay:
        state = optimizer.state_dict()
        for i, key in enumerate(_param_names(model, optimizer)):
            state["state"][i]["ema"] = ema[key]
        optimizer.load_state_dict(state)
    if bn_ema is not None:
        bn_ema.load_state_dict({name: ema[name] for name in bn_ema.names})


def load_tf_for_eval(ckpt, model_name: str, model: torch.nn.Module, optimizer, bn_ema) -> int:
    """A TF checkpoint as the seed's eval program sees it: raw weights, and the ExponentialMovingAverage
    shadows as the EMA (the raw weights again when the run kept none). Returns its global_step (0
    without one)."""
    raw = model_state(ckpt, model_name, model)
    names = ckpt.shapes()
    has_ema = any(f"{v.name}/{EMA}" in names for v in name_map(model_name, model).values())
    ema = model_state(ckpt, model_name, model, ema=True) if has_ema else None
    load_eval_weights(model, optimizer, bn_ema, raw, ema)
    return read_global_step(ckpt) if GLOBAL_STEP in names else 0
