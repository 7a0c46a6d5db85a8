"""Pre-activation ResNet v2 (18/34/50/101/152/200): the ResNet seed's `imagenet_resnet_v2`, layer for layer.

The seed is the TF 1.4 ImageNet example (ucloud/uai-sdk examples/tensorflow/train/imagenet/code/
resnet_model.py, a copy of TF official ResNet of Dec 2017). With w = base_channels (64 standard) and
e = 1 (basic block: 18, 34) or 4 (bottleneck: 50-200):

    stem:   conv 7x7/2 (3 -> w), fixed padding 3 + VALID; NO BN or ReLU after it
            max-pool 3x3/2, TF 'SAME' padding (at 112 px: none top/left, one row/column bottom/right)
    layerK: blocks[K] pre-activation blocks of width w * 2^(K-1); the FIRST block of EVERY stage (stage
            1 and ResNet-18/34 included) has a 1x1 projection shortcut, with stride 2 in stages 2-4
    basic:      x -> BN, ReLU = a;  a -> conv3x3/s, BN, ReLU, conv3x3;  + (proj(a) or x)
    bottleneck: x -> BN, ReLU = a;  a -> conv1x1, BN, ReLU, conv3x3/s, BN, ReLU, conv1x1 (x e);
                + (proj(a) or x)       (the projection reads the pre-activated a, not x)
    head:   BN, ReLU, average pool (the seed's 7x7 VALID pool: global at 224 px), fc (8 w e -> classes,
            with bias)

Convolutions: strided ones pad (k - 1) // 2 before and k - 1 - that after, then VALID (the seed's
`fixed_padding`); stride-1 ones are TF 'SAME'. For odd k both are the symmetric torch padding (k - 1) // 2,
so every conv here is a plain nn.Conv2d without bias.

Parameter counts (trainable variables, BN gamma/beta included, moving statistics not), 1001 classes,
w = 64, MEASURED with TensorFlow 2.21 on the seed's graph ported to tf.compat.v1 (tests/data/tf_ports/
resnet_v2.py; tests/data/tf-resnet-v2/variables.json, asserted in tests/test_tf_names_resnet_v2.py):
    resnet18_v2 11,692,329   resnet34_v2 21,800,489   resnet50_v2 25,551,401
    resnet101_v2 44,543,529  resnet152_v2 60,187,177  resnet200_v2 64,668,201
(v1.5 at 1000 classes, for comparison: resnet50 25,557,032; v2 has no BN after the stem, no BN on the
projections, one BN more at the end, and 1001 outputs.)

Initialisation as TF 1.4 drew it (deterministic under torch.manual_seed, registration order):
- conv: tf.variance_scaling_initializer() of TF 1.4 = truncated normal (re-drawn beyond 2 sigma) with
  stddev sqrt(1 / fan_in), fan_in = kh * kw * cin. TF >= 1.12 divides that stddev by 0.8796 so the
  truncated draw has the variance asked for; TF 1.4 did not, and neither does this.
- fc: tf.layers.dense's default, Glorot uniform weight, zero bias.
- BN: gamma 1, beta 0, moving mean 0, moving variance 1.

BatchNorm (resnet_model.py `batch_norm_relu`, fused=True): decay 0.997 -> torch momentum 0.003. The
seed passes epsilon 1e-5, which TF 1.4's `nn.fused_batch_norm` raised to its cuDNN floor 1.001e-5 (TF 2
dropped the floor): the floor is applied here to any epsilon given. Training mode normalises with the
biased batch variance and moves the moving variance toward the unbiased (Bessel-corrected) one, in TF's
fused kernel (its layers kept the correction: `_bessels_correction_test_only`) and in torch alike.
The seed's `--batch-norm-decay` and `--batch-norm-epsilon` flags never reach its model (resnet_model.py
uses its module constants); here bn_momentum and bn_eps do apply.

Layout and CUDA graphs: no host reads, no view that reorders memory, Python control flow only on static
shapes; with the model and the input in channels_last every convolution reads and writes NHWC.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.models.bn_act import bn_add_relu
from fasttrain.models.stem import StemConv2d

BN_MOMENTUM = 1.0 - 0.997  # resnet_model.py _BATCH_NORM_DECAY = 0.997
# resnet_model.py _BATCH_NORM_EPSILON = 1e-5, raised by TF 1.4's nn.fused_batch_norm to its floor
# `min_epsilon = 1.001e-5` (a cuDNN requirement; TF 2 removed the floor).
TF_FUSED_BN_MIN_EPS = 1.001e-5
BN_EPS = max(1e-5, TF_FUSED_BN_MIN_EPS)

# resnet_model.py imagenet_resnet_v2's model_params: blocks per stage, bottleneck or not.
_ARCHS: dict[int, tuple[tuple[int, int, int, int], bool]] = {
    18: ((2, 2, 2, 2), False),
    34: ((3, 4, 6, 3), False),
    50: ((3, 4, 6, 3), True),
    101: ((3, 4, 23, 3), True),
    152: ((3, 8, 36, 3), True),
    200: ((3, 24, 36, 3), True),
}
DEPTHS = tuple(_ARCHS)


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    # conv2d_fixed_padding: stride 1 -> 'SAME', stride > 1 -> fixed_padding + 'VALID'. For an odd kernel
    # both pad (k - 1) // 2 on every side (SAME at stride 1 pads k - 1 in total, the extra on the end).
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=(kernel - 1) // 2, bias=False)


def tf_same_max_pool(x: torch.Tensor) -> torch.Tensor:
    """tf.layers.max_pooling2d(pool_size=3, strides=2, padding='SAME') on (N, C, H, W).

    TF: out = ceil(in / 2) per dimension, padding max((out - 1) * 2 + 3 - in, 0) split floor half
    before, the rest after (even in: 0 before, 1 after; odd in: 1 and 1), and padded cells never win a
    max. torch pads symmetrically, but with ceil_mode=True its last window may run past the end, where
    it reads nothing: padding = TF's before part plus ceil_mode gives TF's windows for every size (even
    in: windows start at 0, 2, ..., in - 2, the last reading in - 2, in - 1 and the missing cell in;
    odd in: they start at -1, 1, ..., in - 2). Decided from the static shape only.
    """
    before = tuple(1 if size % 2 else 0 for size in x.shape[-2:])
    return F.max_pool2d(x, 3, 2, padding=before, ceil_mode=True)


@torch.no_grad()
def truncated_normal_(w: torch.Tensor, std: float) -> torch.Tensor:
    """TF's truncated_normal, in place: N(0, std^2) with every draw beyond 2 std re-drawn (rejection, as
    TF's kernel does). torch's trunc_normal_ draws the same distribution through erfinv, which took
    1 s per million weights on a CPU (25 s for ResNet-50); this takes a normal_ and a few small redraws.
    Host reads (the loop's test), at construction only; a meta tensor has no values to redraw."""
    w.normal_()
    if w.is_meta:
        return w
    flat = w.view(-1)
    redo = torch.nonzero(flat.abs() > 2.0).squeeze(1)  # one pass; ~4.6% of the draws
    while redo.numel():  # note: host reads (nonzero's size); later rounds touch only the redrawn few
        draws = torch.randn(redo.numel(), dtype=w.dtype, device=w.device)
        flat[redo] = draws
        redo = redo[draws.abs() > 2.0]
    return w.mul_(std)


class PreActBasicBlock(nn.Module):
    """resnet_model.py building_block. Registration order = TF's variable creation order: bn1,
    shortcut, conv1, bn2, conv2."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, projection: bool):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.shortcut = _conv(cin, width, 1, stride) if projection else None
        self.conv1 = _conv(cin, width, 3, stride)  # the stride on the (first) 3x3
        self.bn2 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = bn_add_relu(self.bn1, x)  # BN's backward reads its input, not its output
        shortcut = x if self.shortcut is None else self.shortcut(a)
        out = self.conv2(bn_add_relu(self.bn2, self.conv1(a)))
        out += shortcut  # in place: a conv's backward does not need its output
        return out


class PreActBottleneck(nn.Module):
    """resnet_model.py bottleneck_block. Registration order = TF's: bn1, shortcut, conv1, bn2, conv2,
    bn3, conv3."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, projection: bool):
        super().__init__()
        cout = width * self.expansion
        self.bn1 = nn.BatchNorm2d(cin)
        self.shortcut = _conv(cin, cout, 1, stride) if projection else None
        self.conv1 = _conv(cin, width, 1)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, width, 3, stride)  # the stride on the 3x3
        self.bn3 = nn.BatchNorm2d(width)
        self.conv3 = _conv(width, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = bn_add_relu(self.bn1, x)
        shortcut = x if self.shortcut is None else self.shortcut(a)
        out = bn_add_relu(self.bn2, self.conv1(a))
        out = bn_add_relu(self.bn3, self.conv2(out))
        out = self.conv3(out)
        out += shortcut
        return out


class ResNetV2(nn.Module):
    """The seed's imagenet_resnet_v2(depth, num_classes): (N, 3, H, W) images -> (N, num_classes) logits.

    Module registration order follows TF's variable creation order (conv1, layer1..4, final_bn, fc),
    so state_dict order is the order of the seed's conv2d_N / batch_normalization_N numbering.
    """

    classifier_names = ("fc",)

    def __init__(
        self,
        depth: int,
        num_classes: int,
        base_channels: int = 64,
        bn_momentum: float = BN_MOMENTUM,
        bn_eps: float = BN_EPS,
    ):
        super().__init__()
        if depth not in _ARCHS:
            raise ValueError(f"ResNet v2 depth {depth} is not one of {', '.join(map(str, DEPTHS))}")
        blocks, bottleneck = _ARCHS[depth]
        block = PreActBottleneck if bottleneck else PreActBasicBlock
        w = base_channels
        self.conv1 = StemConv2d(3, w, 7, stride=2, padding=3, bias=False)  # fixed_padding(7): 3 and 3
        cin = w
        for stage, count in enumerate(blocks):
            width = w * 2**stage
            layers = []
            for i in range(count):
                # block_layer: only the first block projects and strides (stride 1 in stage 1).
                stride = 2 if (i == 0 and stage > 0) else 1
                layers.append(block(cin, width, stride, projection=i == 0))
                cin = width * block.expansion
            self.add_module(f"layer{stage + 1}", nn.Sequential(*layers))
        self.final_bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                # TF 1.4's fused batch norm ran max(eps, 1.001e-5) whatever epsilon it was given.
                m.momentum, m.eps = bn_momentum, max(bn_eps, TF_FUSED_BN_MIN_EPS)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                # TF 1.4 VarianceScaling(scale=1, fan_in, normal): truncated_normal(0, sqrt(1 / fan_in)),
                # truncated at 2 standard deviations, without TF 1.12's / 0.8796.
                fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
                truncated_normal_(m.weight, std=math.sqrt(1.0 / fan_in))
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        self.reset_classifier()

    def reset_classifier(self) -> None:
        """Re-initialise fc (Glorot uniform weight, zero bias: tf.layers.dense's default)."""
        nn.init.xavier_uniform_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def stem(self, x: torch.Tensor) -> torch.Tensor:
        """conv1 and the SAME max pool: a method of its own, which --compile compiles as one region
        (fasttrain.compile: inductor fuses the padding into the pool and its backward)."""
        return tf_same_max_pool(self.conv1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = bn_add_relu(self.final_bn, x)
        # The seed's 7x7 VALID average pool is the global average at 224 px (a 7x7 map), the only size
        # its reshape to (N, 8 w e) accepts; global here so that other sizes (tests) run. (N, C, 1, 1)
        # -> (N, C) is a no-copy flatten in either layout.
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
