"""TF checkpoints of the seeds' models into fasttrain's objects, driven by fasttrain.tf.names; the way
back, fasttrain's state as TF variables, is fasttrain.tf.export (by the table below).

    weights = model_state(ckpt, "inception_v3", model)             # raw weights, or ema=True
    step = load_run(ckpt, cfg, run, log)                            # continue a TF run: everything

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

The Inception seed's zero-debias state (every TF >= 0.12 writes it for slim's moving averages;
fasttrain.tf.names.inception_v3.zero_debias_names): `<scope>/BatchNorm/<scope>/BatchNorm/moving_{mean,
variance}/local_step` (float32) is the layer's bn.num_batches_tracked on import (both must be equal
whole numbers; 0 when the checkpoint has none, which is what TF's Saver initialisation gives them: the
first training step then replaces the moving statistics by the batch's), and `.../biased` must equal
moving * (1 - decay^local_step) (decay the layer's, float32 as TF computes it). Export
(fasttrain.tf.export) writes both from the count. Model state, load_run, the pretrained restore and
evaluation all take the count from model_state. (The seed's --pretrained_model_checkpoint_path restores
slim's VARIABLES_TO_RESTORE only, so TF >= 0.12 restarts local_step at 0 there; we keep the
checkpoint's count, as the seed's own TF, which had no zero-debias, kept the statistics going.)
Variables the seeds' runs hold that fasttrain has no use for (the Inception seed's loss averages
`tower_0/.../avg`, ...) are left behind on import, with a note from load_run.

A map entry with layout "ones" (slim's batch norm has no gamma) is 1 on import, its slots fresh
(ms 1, momentum 0) and its shadow 1, and is left out on export (with a note if it is not all ones).
A TF run continued here has no fasttrain data position: it starts the epoch that holds its step from
that epoch's first batch. Every mismatch is one CheckpointError line naming the variable.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import numpy as np
import torch

from fasttrain.checkpoint import CheckpointError
from fasttrain.models import classifier_names, create_model
from fasttrain.tf.names import variable_map
from fasttrain.tf.names.inception_v3 import zero_debias_names
from fasttrain.tf.names.variable import TFVariable, to_tf, to_torch
from fasttrain.tf.validate import read_count

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
_NUM_BATCHES = ".num_batches_tracked"
# A float32 check of biased = moving * (1 - decay^t): TF stored moving = biased / (1 - decay^t) with
# its own float32 pow; 1 - decay^t at small t amplifies the pow's rounding (~1e-7 of decay^t) up to
# ~1e4-fold (t = 1, decay 0.9997), so 1e-2 of the layer's scale; a biased of another run or step is
# off by O(1) of it.
_BIASED_RTOL = 1e-2


def _zero_debias_names(model_name: str, model: torch.nn.Module) -> dict[str, dict[str, str]]:
    if model_name != "inception_v3":
        return {}
    return zero_debias_names(model)


def _decay_keep(model: torch.nn.Module, key: str) -> torch.Tensor:
    """The layer's decay as TF holds it: 1 - (1 - decay) in float32 (SlimBatchNorm._update_moving)."""
    momentum = model.get_submodule(key[: -len(_NUM_BATCHES)]).momentum
    return 1.0 - torch.tensor(momentum, dtype=torch.float32)


def _bias_factor(keep: torch.Tensor, t: float) -> torch.Tensor:
    return 1.0 - torch.pow(keep, torch.tensor(float(t), dtype=torch.float32))


def zero_debias_counts(ckpt, model_name: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """bn.num_batches_tracked key -> the layer's local_step (0 without one), biased checked against
    the checkpoint's moving statistics; {} for models without zero-debias state."""
    names, own, out = _shapes(ckpt), model.state_dict(), {}
    vmap = name_map(model_name, model)
    for key, zd in _zero_debias_names(model_name, model).items():
        steps = {zd[f"{s}/local_step"] for s in ("moving_mean", "moving_variance")} & set(names)
        count = 0
        if steps:
            values = {name: read_count(ckpt, name, names) for name in sorted(steps)}
            count = next(iter(values.values()))
            if len(set(values.values())) > 1:
                first = sorted(values)[0]
                raise _fail(ckpt, model_name, f"variable {first} is {values} (want equal whole counts)")
            keep = _decay_keep(model, key)
            bn = key[: -len(_NUM_BATCHES)]
            for stat, entry in (("moving_mean", "running_mean"), ("moving_variance", "running_var")):
                if zd[f"{stat}/biased"] not in names or f"{bn}.{entry}" not in own:
                    continue
                moving = np.asarray(ckpt.get(vmap[f"{bn}.{entry}"].name))
                # Its shape before reading it: a crafted one may be no array's.
                if names[zd[f"{stat}/biased"]][0] != moving.shape:
                    raise _fail(
                        ckpt, model_name, f"variable {zd[f'{stat}/biased']} has shape "
                        f"{names[zd[f'{stat}/biased']][0]}, not {stat}'s {moving.shape}",
                    )  # fmt: skip
                biased = np.asarray(ckpt.get(zd[f"{stat}/biased"]), np.float64)
                want = moving.astype(np.float64) * float(_bias_factor(keep, count))
                scale = max(float(np.abs(want).max()), float(np.abs(biased).max()), 1e-12)
                if biased.shape != want.shape or np.abs(biased - want).max() > _BIASED_RTOL * scale:
                    raise _fail(
                        ckpt,
                        model_name,
                        f"variable {zd[f'{stat}/biased']} is not {stat} * (1 - decay^local_step) at "
                        f"local_step {count}: zero-debias state of another step or run",
                    )
        out[key] = torch.tensor(count, dtype=own[key].dtype)
    return out


def unused_variables(ckpt, model_name: str, model: torch.nn.Module) -> list[str]:
    """The checkpoint's variables fasttrain has no counterpart of (e.g. the Inception seed's loss
    averages `tower_0/.../avg`): not the map's, their slots or shadows, zero-debias state or step."""
    known = {GLOBAL_STEP}
    for var in name_map(model_name, model).values():
        known |= {
            var.name,
            f"{var.name}/{EMA}",
            *(f"{var.name}/{s}" for k in SLOTS.values() for s in k.values()),
        }
    for zd in _zero_debias_names(model_name, model).values():
        known |= set(zd.values())
    return sorted(set(_shapes(ckpt)) - known)


_SHAPE_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shapes(ckpt) -> dict:
    """ckpt.shapes(), once per reader: it decodes every entry (1553 for the Inception seed), and an
    import asks per variable."""
    if ckpt not in _SHAPE_CACHE:
        _SHAPE_CACHE[ckpt] = ckpt.shapes()
    return _SHAPE_CACHE[ckpt]


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
    shapes = _shapes(ckpt)
    if name not in shapes:
        return None
    want = tuple(to_tf(np.empty(tuple(like.shape), np.uint8), var.layout).shape)
    if shapes[name][0] != want:
        raise _fail(ckpt, model_name, f"variable {name} has shape {shapes[name][0]}, the model's is {want}")
    return torch.from_numpy(to_torch(ckpt.get(name), var.layout)).to(like.dtype)


def check_variables(ckpt, model_name: str, vmap: dict[str, TFVariable], skip: tuple[str, ...] = ()) -> None:
    """CheckpointError when the checkpoint is another model's or holds model variables the map lacks."""
    names = set(_shapes(ckpt))
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
    names = _shapes(ckpt)
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
    out.update(zero_debias_counts(ckpt, model_name, model))
    return out


def network_widths(reader, model_name: str) -> tuple[int, int]:
    """(num_classes, base_channels) of the checkpoint's network: its classifier's and its stem
    convolution's output widths (the last dimension of each in TF's layout)."""
    probe = create_model(model_name, 1001)
    vmap = name_map(model_name, probe)
    stem = next(iter(vmap.values())).name
    classifier = vmap[f"{classifier_names(probe)[0]}.weight"].name
    shapes = _shapes(reader)
    for name, dims, what in ((stem, 4, "convolution kernel"), (classifier, 2, "dense kernel")):
        if name not in shapes:
            raise CheckpointError(
                f"TensorFlow checkpoint {reader.prefix} has no {name}: is it a {model_name}?"
            )
        if len(shapes[name][0]) != dims or not shapes[name][0][-1]:
            raise CheckpointError(
                f"TensorFlow checkpoint {reader.prefix}: variable {name} has shape {shapes[name][0]}, not a "
                f"{what} ({dims} dimensions, the last its width)"
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
    if GLOBAL_STEP not in _shapes(ckpt):
        raise CheckpointError(
            f"TensorFlow checkpoint {ckpt.prefix} has no global_step, so no step to continue"
        )
    return read_count(ckpt, GLOBAL_STEP, _shapes(ckpt))


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
    names = set(_shapes(ckpt))
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
    zero_debias = _zero_debias_names(model_name, model)
    if zero_debias and not any(n in names for zd in zero_debias.values() for n in zd.values()):
        log(
            "note: the TF run has no zero-debias state (local_step) for its moving statistics, as TF "
            "before 0.12 wrote: their count starts at 0, so the first step replaces them by the batch's"
        )
    if unused := unused_variables(ckpt, model_name, model):
        log(f"note: {len(unused)} variables of the TF run have no use here, left behind (e.g. {unused[0]})")
    if shadows_missing and cfg.ema_decay:
        log(f"note: {shadows_missing} variables had no {EMA} shadow; their EMA starts at the current values")
    if not cfg.ema_decay and any(n.endswith(f"/{EMA}") for n in names):
        log(f"note: the TF run kept an EMA ({EMA} shadows), which ema_decay 0 leaves behind")
    return step


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
    names = _shapes(ckpt)
    has_ema = any(f"{v.name}/{EMA}" in names for v in name_map(model_name, model).values())
    ema = model_state(ckpt, model_name, model, ema=True) if has_ema else None
    load_eval_weights(model, optimizer, bn_ema, raw, ema)
    return read_global_step(ckpt) if GLOBAL_STEP in names else 0
