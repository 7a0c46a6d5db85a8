"""Inception v3 with its auxiliary classifier: the Inception seed's architecture (Szegedy et al. 2015).

Layer for layer the network of TF models' inception/slim/inception_model.py at 299x299. Module and
parameter names follow torchvision (Conv2d_1a_3x3, Mixed_5b.branch1x1.conv, AuxLogits.fc, fc), so a
torchvision state_dict loads as it is. Every convolution is conv (no bias) -> BN -> ReLU.

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

Parameter count with 1000 classes and the aux head: 27,161,264 (without the aux head 23,834,568).
That count is torchvision's structure: every BN has a learnable gamma and beta. TF slim's batch_norm
had beta only (scale=False), 18,112 parameters fewer (27,143,152). We keep the gamma: it starts at 1,
so the network starts as TF's did; the weight decay also reaches it unless no_decay_bn_bias is set.

Average pools inside the Inception blocks (3x3, stride 1, padding 1) exclude the padding from the
count, as TF's SAME-padded avg_pool does (torchvision counts it).

Initialisation (TF's, deterministic under torch.manual_seed): every conv and fc weight is drawn from
a normal truncated at 2 standard deviations (tf.truncated_normal_initializer), std 0.1 for
convolutions, 0.01 for the aux head's 5x5 convolution, 0.001 for both classifiers (fc and
AuxLogits.fc); biases 0, BN gamma 1, beta 0. (torchvision passes a=-2, b=2 as absolute bounds, which
for std 0.1 truncates at 20 std, i.e. not at all; we truncate at 2 std as TF did.)

BatchNorm defaults: TF decay 0.9997 -> torch momentum 0.0003, eps 0.001.

forward(x): in train mode with aux_logits returns (logits, aux_logits), both (N, num_classes);
otherwise logits alone. Concatenation along channels keeps channels_last (torch.cat keeps the
inputs' common memory format), pools keep it, and the heads flatten a 1x1 map, so with the model
and the input in channels_last every convolution reads and writes NHWC.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BN_MOMENTUM = 1.0 - 0.9997
BN_EPS = 0.001
_CONV_STD = 0.1
_AUX_CONV_STD = 0.01
_LOGITS_STD = 0.001


class BasicConv2d(nn.Module):
    """conv (no bias) -> BN -> ReLU; `init_std` is the truncated-normal std of its weight."""

    def __init__(self, cin: int, cout: int, kernel, stride: int = 1, padding=0, init_std: float = _CONV_STD):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.init_std = init_std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)), inplace=True)


def _avg_pool_3x3(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    """35x35 block: 1x1 | 1x1 -> 5x5 | 1x1 -> 3x3 -> 3x3 | avg-pool -> 1x1 (pool_features)."""

    def __init__(self, cin: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, 1)
        self.branch5x5_1 = BasicConv2d(cin, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(_avg_pool_3x3(x))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    """35x35 -> 17x17 reduction: 3x3/2 (384) | 1x1 -> 3x3 -> 3x3/2 (96) | max-pool 3x3/2."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3(x)
        b3d = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([b3, b3d, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    """17x17 block with factorised 7x7 convolutions (1x7 and 7x1) of c7 channels."""

    def __init__(self, cin: int, c7: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 192, 1)
        self.branch7x7_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, 192, 1)

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

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_1(x)
        for conv in (self.branch7x7x3_2, self.branch7x7x3_3, self.branch7x7x3_4):
            b7 = conv(b7)
        return torch.cat([b3, b7, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    """8x8 block: 1x1 (320) | 1x1 -> (1x3 | 3x1) | 1x1 -> 3x3 -> (1x3 | 3x1) | avg-pool -> 1x1 (192)."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 320, 1)
        self.branch3x3_1 = BasicConv2d(cin, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bp = self.branch_pool(_avg_pool_3x3(x))
        return torch.cat(
            [
                b1,
                self.branch3x3_2a(b3),
                self.branch3x3_2b(b3),
                self.branch3x3dbl_3a(b3d),
                self.branch3x3dbl_3b(b3d),
                bp,
            ],
            1,
        )


class InceptionAux(nn.Module):
    """Auxiliary classifier on the 17x17x768 map (Mixed_6e's output)."""

    def __init__(self, cin: int, num_classes: int):
        super().__init__()
        self.conv0 = BasicConv2d(cin, 128, 1)
        self.conv1 = BasicConv2d(128, 768, 5, init_std=_AUX_CONV_STD)
        self.fc = nn.Linear(768, num_classes)

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
    ):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.maxpool1 = nn.MaxPool2d(3, stride=2)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.maxpool2 = nn.MaxPool2d(3, stride=2)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, c7=128)
        self.Mixed_6c = InceptionC(768, c7=160)
        self.Mixed_6d = InceptionC(768, c7=160)
        self.Mixed_6e = InceptionC(768, c7=192)
        self.AuxLogits = InceptionAux(768, num_classes) if aux_logits else None
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280)
        self.Mixed_7c = InceptionE(2048)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(p=1.0 - dropout_keep)
        self.fc = nn.Linear(2048, num_classes)
        self.classifier_names = ("fc", "AuxLogits.fc") if aux_logits else ("fc",)
        self._init_weights()
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum, m.eps = bn_momentum, bn_eps

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

    def forward(self, x: torch.Tensor):
        x = self.maxpool1(self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x))))
        x = self.maxpool2(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)))
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
