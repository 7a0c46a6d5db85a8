"""fasttrain's state as the seed's TensorFlow variables, for a TF checkpoint (`python -m fasttrain.tf.convert
to-tf`): the names and layouts of fasttrain.tf.state's table (weights, BN statistics, optimizer slots, EMA
shadows), the Inception seed's zero-debias state written from each layer's count, and global_step in the
seed's dtype.

    tensors, notes = export_tensors("inception_v3", model, optimizer, bn_ema, step, "rmsprop")
"""

from __future__ import annotations

import numpy as np
import torch

from fasttrain.tf.names.variable import to_tf
from fasttrain.tf.state import (
    _NUM_BATCHES,
    EMA,
    GLOBAL_STEP,
    SLOTS,
    _bias_factor,
    _decay_keep,
    _param_names,
    _zero_debias_names,
    name_map,
)


def global_step_dtype(model_name: str) -> np.dtype:
    """The seed's global_step dtype: float32 in the Inception seed, int64 in the ResNet seeds."""
    return np.dtype(np.float32 if model_name == "inception_v3" else np.int64)


def zero_debias_tensors(model_name: str, model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The zero-debias variables for `model`'s state (float32 local_step and biased, as TF's)."""
    state, out = model.state_dict(), {}
    for key, zd in _zero_debias_names(model_name, model).items():
        count = int(state[key])
        factor = _bias_factor(_decay_keep(model, key), count)
        bn = key[: -len(_NUM_BATCHES)]
        for stat, entry in (("moving_mean", "running_mean"), ("moving_variance", "running_var")):
            moving = state[f"{bn}.{entry}"].detach().cpu().to(torch.float32)
            out[zd[f"{stat}/local_step"]] = np.asarray(count, dtype=np.float32)
            out[zd[f"{stat}/biased"]] = (moving * factor).numpy()
    return out


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
    out.update(zero_debias_tensors(model_name, model))
    out[GLOBAL_STEP] = np.asarray(step, dtype=global_step_dtype(model_name))
    notes = []
    if lost:
        notes.append(
            f"note: {len(lost)} batch-norm scales (e.g. {lost[0]}) are not 1, and the seed's network has no "
            "such variable: TF will compute with 1 (train with the exact seed network to avoid this)"
        )
    return out, notes
