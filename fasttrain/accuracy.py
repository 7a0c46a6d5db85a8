"""Top-1 and top-5 hits as the seeds' TensorFlow counts them.

    top1, top5 = correct(logits, labels, first_max_top1=top1_is_first_max(model_name))   # (N,) bool

Top-5, and the Inception seed's top-1, are tf.nn.in_top_k(logits, labels, k) (inception_eval.py:
`top_1_op = tf.nn.in_top_k(logits, labels, 1)`, `top_5_op = ... 5)`; in_top_k_op.h): the label is in the
top k when fewer than k classes score strictly above its logit,

    hit_k = isfinite(logits[label]) and #{c : logits[c] > logits[label]} < k,

so every class tied at the k-th place counts as in, and a label whose own logit is not finite never
does. The ResNet programs' top-1 (the ResNet seed's imagenet_main.py and TF official's) is
`tf.metrics.accuracy(labels, tf.argmax(logits, axis=1))`: argmax's first maximum, NaN passed over.
torch's topk breaks ties by position instead, and counted a NaN logit as a hit; bf16 logits tie often
(random ones over 1001 classes: 3% of rows at the top, 9% at the 5th place).
"""

from __future__ import annotations

import math

import torch


def top1_is_first_max(model_name: str) -> bool:
    """The seed's top-1 rule for this model: argmax's first maximum for the ResNets, in_top_k for
    Inception v3."""
    return model_name != "inception_v3"


def correct(logits: torch.Tensor, labels: torch.Tensor, first_max_top1: bool) -> tuple[torch.Tensor, ...]:
    """(top-1, top-5) hits per image, (N,) bool each, of logits (N, C) and labels (N,) int64 (the module
    docstring's equations; top-5 is top-C for fewer than 5 classes)."""
    logits = logits.float()
    target = logits.gather(1, labels[:, None])[:, 0]
    above = (logits > target[:, None]).sum(dim=1)
    finite = torch.isfinite(target)
    top5 = finite & (above < min(5, logits.shape[1]))
    if first_max_top1:  # tf.argmax passes over NaN (Eigen's reducer keeps a strictly greater one)
        top1 = logits.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf).argmax(dim=1) == labels
    else:
        top1 = finite & (above < 1)
    return top1, top5
