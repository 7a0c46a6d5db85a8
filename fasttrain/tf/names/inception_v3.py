"""The Inception seed's slim variable names for fasttrain's Inception v3 (fasttrain.models.inception_v3).

slim names have no top scope. Each conv -> BN -> ReLU layer (BasicConv2d) is one slim conv2d scope:

    <scope>/weights                       conv.weight         HWIO <-> OIHW ("conv")
    <scope>/BatchNorm/beta                bn.bias
    <scope>/BatchNorm/moving_mean         bn.running_mean
    <scope>/BatchNorm/moving_variance     bn.running_var
    (no gamma: slim's batch_norm had scale=False)  bn.weight of the bn_gamma model ("ones")

and the two classifiers are slim fc scopes, `aux_logits/FC/{weights,biases}` (AuxLogits.fc) and
`logits/logits/{weights,biases}` (fc), weights (in, out) <-> (out, in) ("dense"). The scopes:
stem conv0..conv4 (Conv2d_1a_3x3, 2a, 2b, 3b, 4a); blocks mixed_35x35x256a, mixed_35x35x288a/b
(Mixed_5b/c/d), mixed_17x17x768a..e (Mixed_6a..e), mixed_17x17x1280a (Mixed_7a), mixed_8x8x2048a/b
(Mixed_7b/c); inside a block `<branch>/Conv`, `<branch>/Conv_1`, ... in the order slim built the
branch's layers (the 8x8 blocks build the 1x3 before the 3x1); the aux head's 1x1 is `aux_logits/proj`
and its 5x5 `aux_logits/Conv`.

What else a seed checkpoint holds, named from these (tests/data/tf-inception/full_variables.json):
  <var>/ExponentialMovingAverage   the EMA shadow of every trainable variable AND of every
                                   moving_mean / moving_variance (inception_train.py averages both)
  <var>/RMSProp, <var>/RMSProp_1   RMSProp's ms (initialised to ones) and momentum, trainable only
  global_step                      float32
  zero-debias state of each moving statistic (TF's assign_moving_average defaults to zero_debias,
  and slim called it inside the BatchNorm scope, so the scope repeats):
      <scope>/BatchNorm/<scope>/BatchNorm/moving_mean/{biased,local_step}     (moving_variance alike)
  local_step is the layer's update count: fasttrain's bn.num_batches_tracked (both local_steps of a
  layer are equal); biased = moving * (1 - decay^local_step) (zero_debias_names below;
  fasttrain.tf.state reads the count and checks biased on import, fasttrain.tf.export writes both).
Not mapped: what the seed's training graph adds beside the model (its loss averages `tower_0/.../avg`,
made by ExponentialMovingAverage(0.9, name='avg') in inception_train.py's _tower_loss) is left behind
on import with a note and not written on export.
"""

from __future__ import annotations

from torch import nn

from fasttrain.tf.names.variable import TFVariable

_STEM = {
    "Conv2d_1a_3x3": "conv0",
    "Conv2d_2a_3x3": "conv1",
    "Conv2d_2b_3x3": "conv2",
    "Conv2d_3b_1x1": "conv3",
    "Conv2d_4a_3x3": "conv4",
}
_BLOCKS = {
    "Mixed_5b": "mixed_35x35x256a",
    "Mixed_5c": "mixed_35x35x288a",
    "Mixed_5d": "mixed_35x35x288b",
    "Mixed_6a": "mixed_17x17x768a",
    "Mixed_6b": "mixed_17x17x768b",
    "Mixed_6c": "mixed_17x17x768c",
    "Mixed_6d": "mixed_17x17x768d",
    "Mixed_6e": "mixed_17x17x768e",
    "Mixed_7a": "mixed_17x17x1280a",
    "Mixed_7b": "mixed_8x8x2048a",
    "Mixed_7c": "mixed_8x8x2048b",
    "AuxLogits": "aux_logits",
}


def _conv(branch: str, i: int) -> str:
    return f"{branch}/Conv" if i == 0 else f"{branch}/Conv_{i}"


# torchvision's layer name inside a block -> slim's path under the block's scope.
_LAYERS = {
    "branch1x1": "branch1x1/Conv",
    "branch_pool": "branch_pool/Conv",
    "branch3x3": "branch3x3/Conv",  # Mixed_6a's single 3x3/2
    **{f"branch5x5_{i + 1}": _conv("branch5x5", i) for i in range(2)},
    **{f"branch3x3dbl_{i + 1}": _conv("branch3x3dbl", i) for i in range(3)},  # Mixed_5x, 6a
    **{f"branch7x7_{i + 1}": _conv("branch7x7", i) for i in range(3)},
    **{f"branch7x7dbl_{i + 1}": _conv("branch7x7dbl", i) for i in range(5)},
    **{f"branch7x7x3_{i + 1}": _conv("branch7x7x3", i) for i in range(4)},
    **{f"branch3x3_{i + 1}": _conv("branch3x3", i) for i in range(2)},  # Mixed_7a
    # Mixed_7b/7c: 1x1, then the 1x3 and the 3x1 built in that order.
    "branch3x3_2a": "branch3x3/Conv_1",
    "branch3x3_2b": "branch3x3/Conv_2",
    "branch3x3dbl_3a": "branch3x3dbl/Conv_2",
    "branch3x3dbl_3b": "branch3x3dbl/Conv_3",
    "conv0": "proj",  # the aux head
    "conv1": "Conv",
    "fc": "FC",
}
_BN = {"weight": ("gamma", "ones"), "bias": ("beta", "vector")}
_BN.update({"running_mean": ("moving_mean", "vector"), "running_var": ("moving_variance", "vector")})


def layer_scope(module_name: str) -> str:
    """slim scope of a BasicConv2d or Linear by its module name ("Mixed_7b.branch3x3_2a" -> ...)."""
    if module_name == "fc":
        return "logits/logits"
    if module_name in _STEM:
        return _STEM[module_name]
    block, _, layer = module_name.partition(".")
    if block not in _BLOCKS or layer not in _LAYERS:
        raise ValueError(f"no slim name for Inception v3 layer {module_name!r}")
    return f"{_BLOCKS[block]}/{_LAYERS[layer]}"


def variable_map(model: nn.Module) -> dict[str, TFVariable]:
    """state_dict key -> TFVariable for every floating entry, in state_dict order."""
    out: dict[str, TFVariable] = {}
    for key, value in model.state_dict().items():
        if not value.is_floating_point():
            continue  # num_batches_tracked: see zero_debias_names
        module_name, entry = key.rsplit(".", 1)
        if module_name.endswith(".conv"):
            out[key] = TFVariable(f"{layer_scope(module_name[: -len('.conv')])}/weights", "conv")
        elif module_name.endswith(".bn"):
            name, layout = _BN[entry]
            out[key] = TFVariable(f"{layer_scope(module_name[: -len('.bn')])}/BatchNorm/{name}", layout)
        else:  # fc, AuxLogits.fc
            name, layout = {"weight": ("weights", "dense"), "bias": ("biases", "vector")}[entry]
            out[key] = TFVariable(f"{layer_scope(module_name)}/{name}", layout)
    return out


def zero_debias_names(model: nn.Module) -> dict[str, dict[str, str]]:
    """For the seed model (SlimBatchNorm): bn.num_batches_tracked key -> the layer's zero-debias
    variables {"moving_mean/local_step": name, "moving_mean/biased": name, and the same for
    moving_variance}. TF's local_step is float32; import it as the layer's count (both are equal)
    and check biased == moving * (1 - decay**local_step); export writes them from the count."""
    out = {}
    for key in model.state_dict():
        if key.endswith(".bn.num_batches_tracked"):
            bn = f"{layer_scope(key[: -len('.bn.num_batches_tracked')])}/BatchNorm"
            out[key] = {
                f"{stat}/{part}": f"{bn}/{bn}/{stat}/{part}"
                for stat in ("moving_mean", "moving_variance")
                for part in ("local_step", "biased")
            }
    return out
