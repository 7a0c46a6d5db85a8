"""A block's BatchNorm (+ residual add) (+ ReLU): torch's ops or fasttrain's Triton kernels (--bn_kernels).

`bn_add_relu(bn, x, residual, relu)` is what ResNet v1.5's and the seed's v2 blocks and Inception v3's
conv + BN + ReLU layers call where they normalise. By default it runs exactly the torch ops they ran
before (`bn(x)`, `out += residual` in place, `F.relu(out, inplace=True)`). On a model given
`use_bn_kernels`, a BatchNorm in training mode runs fasttrain.kernels.batch_norm.bn_act instead: the
statistics, the normalisation, the residual add and the ReLU in 4 passes over the activations, forward
and backward 8 (11 with the add) against the eager ops' 14 (20), with the same running-statistics
update as nn.BatchNorm2d (num_batches_tracked included). In eval mode, on the meta device (where the
step is traced), and for a residual of another dtype the torch ops run. The projection shortcut's
BatchNorm (ResNet v1.5's downsample) stays torch's. Inception's SlimBatchNorm (beta only, TF's
zero-debiased moving averages) runs the kernels through its own `kernel_forward`, which averages the
batch statistics they hand back.

The kernels replace what --compile fuses, so the two are not combined (config_checks refuses it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.errors import SettingError

_FLAG = "_fasttrain_bn_kernels"


def bn_add_relu(
    bn: nn.BatchNorm2d, x: torch.Tensor, residual: torch.Tensor | None = None, relu: bool = True
) -> torch.Tensor:
    """relu(bn(x) + residual) (each part optional), with bn's running statistics updated in training."""
    if getattr(bn, _FLAG, False) and _kernel_applies(bn, x, residual):
        if hasattr(bn, "kernel_forward"):  # a module's own statistics (Inception's SlimBatchNorm)
            return bn.kernel_forward(x, residual, relu)
        from fasttrain.kernels.batch_norm import bn_act

        bn.num_batches_tracked.add_(1)
        return bn_act(
            x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
            momentum=bn.momentum, eps=bn.eps, residual=residual, relu=relu,
        )  # fmt: skip
    out = bn(x)
    if residual is not None:
        out += residual  # in place: BN's backward does not need its output
    return F.relu(out, inplace=True) if relu else out


def _kernel_applies(bn: nn.BatchNorm2d, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    return (
        bn.training
        and x.device.type != "meta"
        and getattr(bn, "track_running_stats", True)
        and bn.momentum is not None
        and (residual is None or residual.dtype == x.dtype)
    )


def use_bn_kernels(model: nn.Module, device: torch.device) -> int:
    """Mark every nn.BatchNorm2d of `model` to run the Triton kernels where its block calls
    bn_add_relu; returns how many were marked. Raises SettingError (naming --bn_kernels) when the
    device cannot run them."""
    from fasttrain.kernels.common import why_triton_cannot_run

    reason = why_triton_cannot_run(device)
    if reason:
        raise SettingError(f"--bn_kernels=triton cannot run on {device}: {reason}", settings=("bn_kernels",))
    marked = 0
    for m in model.modules():
        # Not SyncBatchNorm, which synchronises what the kernels would not.
        if type(m) is nn.BatchNorm2d or hasattr(m, "kernel_forward"):
            setattr(m, _FLAG, True)
            marked += 1
    return marked
