"""fasttrain/accuracy.py against tf.nn.in_top_k's rule written out per image in Python (in_top_k_op.h:
the label is in the top k when fewer than k classes score strictly above it and its own logit is
finite) and tf.argmax's first maximum, on ties and non-finite logits, where torch's topk differed."""

import math

import pytest
import torch

from fasttrain.accuracy import correct, top1_is_first_max


def _in_top_k(row: list[float], label: int, k: int) -> bool:
    target = row[label]
    return math.isfinite(target) and sum(v > target for v in row) < k


def _first_max(row: list[float]) -> int:
    """tf.argmax: the first of the greatest values, NaN passed over (0 when all are NaN)."""
    best = None
    for i, v in enumerate(row):
        if not math.isnan(v) and (best is None or v > row[best]):
            best = i
    return 0 if best is None else best


CASES = [
    ([5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0], 6),  # label tied with the 2nd-6th: in the top 5
    ([2.0, 0.0, 2.0, 1.0, 1.0, 1.0, 1.0, 0.0], 2),  # label tied with class 0 at the top
    ([1.0, float("nan"), 3.0, 0.0, 0.0, 0.0, 0.0, 0.0], 1),  # the label's logit is NaN
    ([float("inf")] * 8, 3),  # all infinite: never a hit
    ([1.0] * 8, 7),  # all equal
    ([0.5, 0.25, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0], 4),  # no ties: 5th place exactly
]


@pytest.mark.parametrize("first_max", [False, True])
def test_hits_follow_in_top_k_and_argmax(first_max):
    logits = torch.tensor([row for row, _ in CASES])
    labels = torch.tensor([label for _, label in CASES])
    top1, top5 = correct(logits, labels, first_max)
    want5 = [_in_top_k(row, label, 5) for row, label in CASES]
    want1 = [_first_max(row) == label if first_max else _in_top_k(row, label, 1) for row, label in CASES]
    assert top5.tolist() == want5 == [True, True, False, False, True, True]
    assert top1.tolist() == want1
    in_top_1 = [False, True, False, False, True, False]
    assert want1 == ([False, False, False, False, False, False] if first_max else in_top_1)


def test_random_bf16_logits_agree_with_the_per_image_rule():
    # bf16 logits over 1001 classes tie often: the case the seeds' rule decides.
    torch.manual_seed(0)
    logits = (torch.randn(300, 1001) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 1001, (300,))
    top1, top5 = correct(logits, labels, first_max_top1=False)
    rows = logits.float().tolist()
    assert top5.tolist() == [_in_top_k(r, int(y), 5) for r, y in zip(rows, labels)]
    assert top1.tolist() == [_in_top_k(r, int(y), 1) for r, y in zip(rows, labels)]


def test_the_rule_of_each_seed():
    assert not top1_is_first_max("inception_v3")  # inception_eval.py: tf.nn.in_top_k(logits, labels, 1)
    assert top1_is_first_max("resnet101_v2") and top1_is_first_max("resnet50")  # tf.argmax
