"""ResNet v1.5 (18/34/50/101/152): the ResNet seed's architecture, channels_last- and AMP-ready.

v1.5 differs from the paper's v1 only in the bottleneck: the stride of a downsampling block sits on
the 3x3 convolution, not on the first 1x1 (TF official models and NVIDIA call this v1.5; torchvision
does the same). Module and parameter names follow torchvision (conv1, bn1, layer1.0.conv1, ...,
fc), so a torchvision state_dict loads as it is.

Structure, with w = base_channels (64 for the standard widths) and e = 1 (basic) or 4 (bottleneck):

    stem:   conv 7x7/2 (3 -> w), BN, ReLU, max-pool 3x3/2 (padding 1)
    layerK: blocks[K] residual blocks of width w * 2^(K-1), K = 1..4; the first block of layers 2-4
            has stride 2, and a 1x1/stride conv + BN projects the shortcut whenever shape changes
    basic:      x -> conv3x3/s, BN, ReLU, conv3x3, BN -> + shortcut -> ReLU
    bottleneck: x -> conv1x1, BN, ReLU, conv3x3/s, BN, ReLU, conv1x1 (x e), BN -> + shortcut -> ReLU
    head:   global average pool to 1x1, flatten, fc (8 w e -> num_classes, with bias)

Parameter counts with 1000 classes and w = 64: ResNet-18 11,689,512; -34 21,797,672;
-50 25,557,032; -101 44,549,160; -152 60,192,808.

Initialisation (deterministic under torch.manual_seed: every draw comes from the global generator, in
registration order):
- conv weights: Kaiming normal, std = sqrt(2 / fan_out), fan_out = out_channels * kh * kw (He et al.
  2015; torchvision and NVIDIA's ResNet-50 v1.5). The TF 1.4 seed used variance_scaling(scale 1,
  fan_in), a smaller scale; with BN after every conv the difference washes out after a few steps.
- BN: gamma 1, beta 0; with zero_init_residual, the last BN gamma of every block is 0, so each block
  starts as the identity (Goyal et al. 2017).
- fc: Glorot (Xavier) uniform weight, zero bias: tf.layers.dense's default, which the seed used.

BatchNorm defaults: TF decay 0.997 -> torch momentum 1 - 0.997 = 0.003 (running = (1 - m) * running
+ m * batch), eps 1e-5.

Layout: no `.view` and no op that reorders memory; the head pools to (N, C, 1, 1) and flattens, which
is layout-free for a 1x1 map. With the model and the input in channels_last every convolution reads
and writes NHWC.
"""

from __future__ import annotations

import torch
from torch import nn

from fasttrain.models.bn_act import bn_add_relu
from fasttrain.models.stem import StemConv2d

BN_MOMENTUM = 1.0 - 0.997
BN_EPS = 1e-5

# Blocks per stage and whether the block is a bottleneck, per depth.
_ARCHS: dict[int, tuple[tuple[int, int, int, int], bool]] = {
    18: ((2, 2, 2, 2), False),
    34: ((3, 4, 6, 3), False),
    50: ((3, 4, 6, 3), True),
    101: ((3, 4, 23, 3), True),
    152: ((3, 8, 36, 3), True),
}
DEPTHS = tuple(_ARCHS)


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, downsample: nn.Module | None):
        super().__init__()
        self.conv1 = _conv(cin, width, 3, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, width, 3)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = bn_add_relu(self.bn1, self.conv1(x))
        return bn_add_relu(self.bn2, self.conv2(out), identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, downsample: nn.Module | None):
        super().__init__()
        self.conv1 = _conv(cin, width, 1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, width, 3, stride)  # v1.5: the stride is here, not on conv1
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv(width, width * self.expansion, 1)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.downsample = downsample

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = bn_add_relu(self.bn1, self.conv1(x))
        out = bn_add_relu(self.bn2, self.conv2(out))
        return bn_add_relu(self.bn3, self.conv3(out), identity)


class ResNet(nn.Module):
    """ResNet v1.5 of the given depth; forward maps (N, 3, H, W) images to (N, num_classes) logits."""

    classifier_names = ("fc",)

    def __init__(
        self,
        depth: int,
        num_classes: int,
        base_channels: int = 64,
        zero_init_residual: bool = True,
        bn_momentum: float = BN_MOMENTUM,
        bn_eps: float = BN_EPS,
    ):
        super().__init__()
        if depth not in _ARCHS:
            raise ValueError(f"ResNet depth {depth} is not one of {', '.join(map(str, DEPTHS))}")
        blocks, bottleneck = _ARCHS[depth]
        block = Bottleneck if bottleneck else BasicBlock
        w = base_channels
        self.conv1 = StemConv2d(3, w, 7, stride=2, padding=3, bias=False)  # 3 channels, or 4 (stem.py)
        self.bn1 = nn.BatchNorm2d(w)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = w
        for stage, count in enumerate(blocks):
            width = w * 2**stage
            layers = []
            for i in range(count):
                stride = 2 if (i == 0 and stage > 0) else 1
                cout = width * block.expansion
                downsample = None
                if stride != 1 or cin != cout:
                    downsample = nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout))
                layers.append(block(cin, width, stride, downsample))
                cin = cout
            self.add_module(f"layer{stage + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        self._init_weights(zero_init_residual)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum, m.eps = bn_momentum, bn_eps

    def _init_weights(self, zero_init_residual: bool) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn.weight)
        self.reset_classifier()

    def reset_classifier(self) -> None:
        """Re-initialise fc (Glorot uniform weight, zero bias), as at construction."""
        nn.init.xavier_uniform_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def stem(self, x: torch.Tensor) -> torch.Tensor:
        """conv1, BN, ReLU and the max pool: a method of its own, which --compile compiles as one
        region (fasttrain.compile) while the modules keep their state_dict names."""
        return self.maxpool(bn_add_relu(self.bn1, self.conv1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        # (N, C, 1, 1) -> (N, C): flatten of a 1x1 map is a no-copy reshape in either layout.
        return self.fc(torch.flatten(self.avgpool(x), 1))
