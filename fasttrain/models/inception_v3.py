"""Inception v3 with its auxiliary classifier: the Inception seed's network (Szegedy et al. 2015).

Layer for layer the network of TF models' inception/inception/slim/inception_model.py at 299x299
(checked layer by layer in tests/test_inception_seed.py, and against TensorFlow's own logits in
tests/test_tf_names_inception_v3.py). Module and parameter names follow torchvision (Conv2d_1a_3x3,
Mixed_5b.branch1x1.conv, AuxLogits.fc, fc); fasttrain.tf.names.inception_v3 maps them to slim's.
Every convolution is conv (no bias) -> BN -> ReLU.

    input 3x299x299 -> conv 3x3/2 (32) -> conv 3x3 (32) -> conv 3x3 pad 1 (64) -> max-pool 3x3/2
    -> conv 1x1 (80) -> conv 3x3 (192) -> max-pool 3x3/2                             192x35x35
    -> Mixed_5b/5c/5d (InceptionA, pool branch 32/64/64)                              288x35x35
    -> Mixed_6a (InceptionB, grid reduction)                                          768x17x17
    -> Mixed_6b/6c/6d/6e (InceptionC, factorised 7x7 with 128/160/160/192 channels)   768x17x17
       `-> aux head (train mode only): avg-pool 5x5/3 -> conv 1x1 (128) -> conv 5x5 (768)
           -> global avg-pool -> flatten -> AuxLogits.fc (768 -> num_classes)
    -> Mixed_7a (InceptionD, grid reduction)                                         1280x8x8
    -> Mixed_7b/7c (InceptionE, expanded 3x3 branches)                               2048x8x8
    -> global avg-pool -> flatten -> dropout (keep 0.8) -> fc (2048 -> num_classes)

Batch norm, two structures (`bn_gamma`):
  False, the seed's: slim.ops.batch_norm(scale=False) (SlimBatchNorm below): beta only, no gamma.
      Parameters with 1001 classes and the aux head: 27,145,970, TF's count of the seed's graph
      (27,143,152 at 1000 classes). What the trainer builds by default (Config.inception_bn_gamma).
  True, torchvision's: nn.BatchNorm2d with gamma and beta, 18,112 parameters more (27,161,264 at
      1000 classes), torch's running statistics (unbiased variance, constant momentum). The
      constructor's default, so a torchvision state_dict loads as it is.

SlimBatchNorm's equations (slim/ops.py batch_norm; TF's moving_averages.assign_moving_average with
its default zero_debias=True, which every TF from 0.12 on applies to slim's moving statistics):
  train: mean, var = tf.nn.moments(x, [N, H, W])   (var BIASED: divided by N*H*W, not N*H*W - 1)
         y = (x - mean) / sqrt(var + eps) + beta
         with o = 1 - decay (float32), a = 1 - o, t = num_batches_tracked (TF's `local_step`), for
         each moving statistic M fed the batch's value v (TF keeps biased = M * (1 - a^t) itself):
             biased = M * (1 - a^t);  biased -= (biased - v) * o;  M = biased / (1 - a^(t+1))
         so the first update sets M to the batch's statistics exactly, whatever M held before.
  eval:  y = (x - moving_mean) / sqrt(moving_variance + eps) + beta
The batch statistics come out of torch's fused batch_norm (scratch running buffers at momentum 1:
the batch mean and the unbiased variance, scaled back to the biased one), so a training step makes
no extra pass over the activations and no host read: channels_last and CUDA-graph safe.

Padding: slim's stem convolutions are VALID except conv2 (SAME, pad 1), the blocks' are SAME (odd
kernels at stride 1: symmetric pad k // 2), their stride-2 convolutions and max-pools VALID.
Average pools inside the blocks (3x3, stride 1, SAME) exclude the padding from the count, as TF's
avg_pool does (torchvision counts it). The aux head's pool is 5x5/3 VALID; its 5x5 convolution
takes the whole 5x5 map (VALID) and, like every slim conv2d here, has BN and ReLU; its fc and the
logits fc have biases and no activation. Dropout (keep 0.8) is on the pooled 2048 vector before fc.

depth_multiplier scales every block's channel count c to max(1, int(c * depth_multiplier)) (the
rule of the TF port in tests/data/tf_ports/inception_v3.py); names do not change. 1.0 is the seed's
network; smaller widths exist for TensorFlow fixtures small enough to commit.

Initialisation (TF's, deterministic under torch.manual_seed): every conv and fc weight is drawn from
a normal truncated at 2 standard deviations (tf.truncated_normal_initializer), std 0.1 for
convolutions, 0.01 for the aux head's 5x5 convolution, 0.001 for both classifiers (fc and
AuxLogits.fc); biases 0, BN gamma 1, beta 0, moving mean 0, moving variance 1.

BatchNorm defaults: TF decay 0.9997 -> torch momentum 0.0003, eps 0.001.

forward(x): in train mode with aux_logits returns (logits, aux_logits), both (N, num_classes);
otherwise logits alone. Concatenation along channels keeps channels_last (torch.cat keeps the
inputs' common memory format), pools keep it, and the heads flatten a 1x1 map, so with the model
and the input in channels_last every convolution reads and writes NHWC.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.models.bn_act import bn_add_relu
from fasttrain.models.stem import StemConv2d

BN_MOMENTUM = 1.0 - 0.9997
BN_EPS = 0.001
_CONV_STD = 0.1
_AUX_CONV_STD = 0.01
_LOGITS_STD = 0.001


class SlimBatchNorm(nn.Module):
    """slim's batch norm without gamma (equations in the module docstring); (N, C, H, W) -> same.

    State: `bias` (beta), `running_mean`, `running_var` (TF's moving_mean, moving_variance) and
    `num_batches_tracked` (TF's local_step of the zero-debiased moving averages).
    """

    def __init__(self, num_features: int, eps: float = BN_EPS, momentum: float = BN_MOMENTUM):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # slim has no gamma, but batch_norm is given a weight of ones (not a parameter: no gradient,
        # not in the state_dict): with weight None, torch's CUDA backward for channels_last input
        # returns an EMPTY bias gradient ("NativeBatchNormBackward0 returned an invalid gradient at
        # index 2 - got [0]", Normalization.cuh allocates grad_bias only when weight is defined),
        # which stopped every Inception v3 step on an H200 (torch 2.11). With a weight it runs the
        # kernels nn.BatchNorm2d runs. ones_like is a fill kernel: graph-capturable.
        ones = torch.ones_like(self.bias)
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, ones, self.bias, False, 0.0, self.eps)
        # At momentum 1 torch's kernel writes the batch mean and UNBIASED variance into the scratch
        # buffers ((1 - 1) * 0 + 1 * value: exact); tf.nn.moments' variance is the biased one.
        batch_mean = torch.zeros_like(self.running_mean)
        batch_var = torch.zeros_like(self.running_var)
        y = F.batch_norm(x, batch_mean, batch_var, ones, self.bias, True, 1.0, self.eps)
        n = x.numel() // x.shape[1]
        with torch.no_grad():
            self._update_moving(batch_mean, batch_var * ((n - 1) / n))
        return y

    def kernel_forward(self, x: torch.Tensor, residual: torch.Tensor | None, relu: bool) -> torch.Tensor:
        """Training forward in fasttrain's Triton kernels (--bn_kernels triton; models/bn_act.py calls
        it): beta only, the batch's mean and biased variance averaged as above."""
        from fasttrain.kernels.batch_norm import bn_act

        mean, var = torch.empty_like(self.running_mean), torch.empty_like(self.running_var)
        y = bn_act(
            x, None, self.bias, None, None, momentum=0.0, eps=self.eps, residual=residual, relu=relu,
            batch_stats=(mean, var),
        )  # fmt: skip
        with torch.no_grad():
            self._update_moving(mean, var)
        return y

    def _update_moving(self, mean: torch.Tensor, var: torch.Tensor) -> None:
        # TF's _zero_debias (moving_averages.py), all in float32 as TF computes it: o = 1 - decay is
        # the Python double rounded once, a = 1 - o and the powers a^t in float32 (1 - a^t near
        # t = 1 amplifies any other rounding of o ~1e4-fold).
        # torch.full is a fill kernel: no host-to-device copy, so a CUDA graph can capture it.
        one_minus_decay = torch.full((), 1.0 - (1.0 - self.momentum), dtype=torch.float32, device=mean.device)
        keep = 1.0 - one_minus_decay
        t = self.num_batches_tracked.to(torch.float32)
        debias_old = 1.0 - torch.pow(keep, t)
        debias_new = 1.0 - torch.pow(keep, t + 1.0)
        for moving, value in ((self.running_mean, mean), (self.running_var, var)):
            biased = moving * debias_old
            biased = biased - (biased - value) * one_minus_decay
            moving.copy_(biased / debias_new)
        self.num_batches_tracked.add_(1)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, beta only"


class BasicConv2d(nn.Module):
    """conv (no bias) -> BN -> ReLU; `init_std` is the truncated-normal std of its weight."""

    def __init__(
        self,
        cin,
        cout,
        kernel,
        stride=1,
        padding=0,
        init_std=_CONV_STD,
        *,
        bn: type = SlimBatchNorm,
        conv: type = nn.Conv2d,
    ):
        super().__init__()
        self.conv = conv(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = bn(cout)
        self.init_std = init_std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bn_add_relu(self.bn, self.conv(x))


def _avg_pool_3x3(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    """35x35 block: 1x1 | 1x1 -> 5x5 | 1x1 -> 3x3 -> 3x3 | avg-pool -> 1x1 (pool_features)."""

    def __init__(self, cin: int, pool_features: int, conv, d):
        super().__init__()
        self.branch1x1 = conv(cin, d(64), 1)
        self.branch5x5_1 = conv(cin, d(48), 1)
        self.branch5x5_2 = conv(d(48), d(64), 5, padding=2)
        self.branch3x3dbl_1 = conv(cin, d(64), 1)
        self.branch3x3dbl_2 = conv(d(64), d(96), 3, padding=1)
        self.branch3x3dbl_3 = conv(d(96), d(96), 3, padding=1)
        self.branch_pool = conv(cin, d(pool_features), 1)
        self.out_channels = d(64) + d(64) + d(96) + d(pool_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(_avg_pool_3x3(x))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    """35x35 -> 17x17 reduction: 3x3/2 (384) | 1x1 -> 3x3 -> 3x3/2 (96) | max-pool 3x3/2."""

    def __init__(self, cin: int, conv, d):
        super().__init__()
        self.branch3x3 = conv(cin, d(384), 3, stride=2)
        self.branch3x3dbl_1 = conv(cin, d(64), 1)
        self.branch3x3dbl_2 = conv(d(64), d(96), 3, padding=1)
        self.branch3x3dbl_3 = conv(d(96), d(96), 3, stride=2)
        self.out_channels = d(384) + d(96) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3(x)
        b3d = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([b3, b3d, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    """17x17 block with factorised 7x7 convolutions (1x7 and 7x1) of c7 channels."""

    def __init__(self, cin: int, c7: int, conv, d):
        super().__init__()
        c7, c = d(c7), d(192)
        self.branch1x1 = conv(cin, c, 1)
        self.branch7x7_1 = conv(cin, c7, 1)
        self.branch7x7_2 = conv(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = conv(c7, c, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = conv(cin, c7, 1)
        self.branch7x7dbl_2 = conv(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = conv(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = conv(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = conv(c7, c, (1, 7), padding=(0, 3))
        self.branch_pool = conv(cin, c, 1)
        self.out_channels = 4 * c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        b7d = self.branch7x7dbl_1(x)
        for conv in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            b7d = conv(b7d)
        bp = self.branch_pool(_avg_pool_3x3(x))
        return torch.cat([b1, b7, b7d, bp], 1)


class InceptionD(nn.Module):
    """17x17 -> 8x8 reduction: 1x1 -> 3x3/2 (320) | 1x1 -> 1x7 -> 7x1 -> 3x3/2 (192) | max-pool."""

    def __init__(self, cin: int, conv, d):
        super().__init__()
        c = d(192)
        self.branch3x3_1 = conv(cin, c, 1)
        self.branch3x3_2 = conv(c, d(320), 3, stride=2)
        self.branch7x7x3_1 = conv(cin, c, 1)
        self.branch7x7x3_2 = conv(c, c, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = conv(c, c, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = conv(c, c, 3, stride=2)
        self.out_channels = d(320) + c + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_1(x)
        for conv in (self.branch7x7x3_2, self.branch7x7x3_3, self.branch7x7x3_4):
            b7 = conv(b7)
        return torch.cat([b3, b7, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    """8x8 block: 1x1 (320) | 1x1 -> (1x3 | 3x1) | 1x1 -> 3x3 -> (1x3 | 3x1) | avg-pool -> 1x1 (192)."""

    def __init__(self, cin: int, conv, d):
        super().__init__()
        c = d(384)
        self.branch1x1 = conv(cin, d(320), 1)
        self.branch3x3_1 = conv(cin, c, 1)
        self.branch3x3_2a = conv(c, c, (1, 3), padding=(0, 1))
        self.branch3x3_2b = conv(c, c, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = conv(cin, d(448), 1)
        self.branch3x3dbl_2 = conv(d(448), c, 3, padding=1)
        self.branch3x3dbl_3a = conv(c, c, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = conv(c, c, (3, 1), padding=(1, 0))
        self.branch_pool = conv(cin, d(192), 1)
        self.out_channels = d(320) + 4 * c + d(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bp = self.branch_pool(_avg_pool_3x3(x))
        b3s = [self.branch3x3_2a(b3), self.branch3x3_2b(b3)]
        b3ds = [self.branch3x3dbl_3a(b3d), self.branch3x3dbl_3b(b3d)]
        return torch.cat([b1, *b3s, *b3ds, bp], 1)


class InceptionAux(nn.Module):
    """Auxiliary classifier on the 17x17 map (Mixed_6e's output)."""

    def __init__(self, cin: int, num_classes: int, conv, d):
        super().__init__()
        self.conv0 = conv(cin, d(128), 1)
        self.conv1 = conv(d(128), d(768), 5, init_std=_AUX_CONV_STD)
        self.fc = nn.Linear(d(768), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.avg_pool2d(x, 5, stride=3)  # 17x17 -> 5x5 (VALID)
        x = self.conv1(self.conv0(x))  # 5x5 conv, no padding: -> 1x1
        # The 5x5 conv leaves 1x1 at 299 px; pooling keeps larger inputs working.
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Inception3(nn.Module):
    """Inception v3; forward maps (N, 3, 299, 299) to logits, plus aux logits in train mode."""

    def __init__(
        self,
        num_classes: int,
        aux_logits: bool = True,
        dropout_keep: float = 0.8,
        bn_momentum: float = BN_MOMENTUM,
        bn_eps: float = BN_EPS,
        bn_gamma: bool = True,
        depth_multiplier: float = 1.0,
    ):
        super().__init__()
        if not depth_multiplier > 0:
            raise ValueError(f"depth_multiplier must be positive, got {depth_multiplier}")
        if bn_gamma:
            bn = functools.partial(nn.BatchNorm2d, eps=bn_eps, momentum=bn_momentum)
        else:
            bn = functools.partial(SlimBatchNorm, eps=bn_eps, momentum=bn_momentum)
        conv = functools.partial(BasicConv2d, bn=bn)

        def d(channels: int) -> int:
            return max(1, int(channels * depth_multiplier))

        self.Conv2d_1a_3x3 = conv(3, d(32), 3, stride=2, conv=StemConv2d)  # 3 channels, or 4 (stem.py)
        self.Conv2d_2a_3x3 = conv(d(32), d(32), 3)
        self.Conv2d_2b_3x3 = conv(d(32), d(64), 3, padding=1)
        self.maxpool1 = nn.MaxPool2d(3, stride=2)
        self.Conv2d_3b_1x1 = conv(d(64), d(80), 1)
        self.Conv2d_4a_3x3 = conv(d(80), d(192), 3)
        self.maxpool2 = nn.MaxPool2d(3, stride=2)
        self.Mixed_5b = InceptionA(d(192), 32, conv, d)
        self.Mixed_5c = InceptionA(self.Mixed_5b.out_channels, 64, conv, d)
        self.Mixed_5d = InceptionA(self.Mixed_5c.out_channels, 64, conv, d)
        self.Mixed_6a = InceptionB(self.Mixed_5d.out_channels, conv, d)
        self.Mixed_6b = InceptionC(self.Mixed_6a.out_channels, 128, conv, d)
        self.Mixed_6c = InceptionC(self.Mixed_6b.out_channels, 160, conv, d)
        self.Mixed_6d = InceptionC(self.Mixed_6c.out_channels, 160, conv, d)
        self.Mixed_6e = InceptionC(self.Mixed_6d.out_channels, 192, conv, d)
        width_6e = self.Mixed_6e.out_channels
        self.AuxLogits = InceptionAux(width_6e, num_classes, conv, d) if aux_logits else None
        self.Mixed_7a = InceptionD(width_6e, conv, d)
        self.Mixed_7b = InceptionE(self.Mixed_7a.out_channels, conv, d)
        self.Mixed_7c = InceptionE(self.Mixed_7b.out_channels, conv, d)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(p=1.0 - dropout_keep)
        self.fc = nn.Linear(self.Mixed_7c.out_channels, num_classes)
        self.classifier_names = ("fc", "AuxLogits.fc") if aux_logits else ("fc",)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, BasicConv2d):
                _trunc_normal(m.conv.weight, m.init_std)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        self.reset_classifier()

    def reset_classifier(self) -> None:
        """Re-initialise fc and AuxLogits.fc (truncated normal std 0.001, zero bias), as at construction."""
        for name in self.classifier_names:
            fc = self.get_submodule(name)
            _trunc_normal(fc.weight, _LOGITS_STD)
            nn.init.zeros_(fc.bias)

    # The stem's two max pools with the conv + BN + ReLU before each: methods of their own, which
    # --compile compiles as regions (fasttrain.compile), so that inductor fuses the pool (and its
    # backward) with the BN and ReLU; ATen's channels_last max pool took 5 ms of a 34 ms step at batch
    # 128 on an H200 (bench/results/2026-11-28-h200-fourth-run/). The modules keep their names.
    def conv_pool1(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool1(self.Conv2d_2b_3x3(x))

    def conv_pool2(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool2(self.Conv2d_4a_3x3(x))

    def forward(self, x: torch.Tensor):
        x = self.conv_pool1(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = self.conv_pool2(self.Conv2d_3b_1x1(x))
        x = self.Mixed_5d(self.Mixed_5c(self.Mixed_5b(x)))
        x = self.Mixed_6e(self.Mixed_6d(self.Mixed_6c(self.Mixed_6b(self.Mixed_6a(x)))))
        aux = self.AuxLogits(x) if self.AuxLogits is not None and self.training else None
        x = self.Mixed_7c(self.Mixed_7b(self.Mixed_7a(x)))
        # (N, 2048, 1, 1) -> (N, 2048): flatten of a 1x1 map is a no-copy reshape in either layout.
        logits = self.fc(self.dropout(torch.flatten(self.avgpool(x), 1)))
        return logits if aux is None else (logits, aux)


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    # tf.truncated_normal_initializer: N(0, std^2) with draws beyond 2 std re-drawn.
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std)
