"""The training step on several ranks skips the same steps: a loss that is not finite on one rank
only skips the step on every rank (gloo CPU ranks, fasttrain's buckets and torch DDP).

Reference: the ranks themselves. Their parameters must stay bit-equal (each rank applies the same
all-reduced gradient or none) and each rank must count the same skips.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from launch_helpers import spawn

from fasttrain.buckets import GradBuckets
from fasttrain.config import make_config
from fasttrain.distributed import wrap_ddp
from fasttrain.models import create_model
from fasttrain.optim import FusedMomentum
from fasttrain.precision import Precision
from fasttrain.schedule import LRSchedule
from fasttrain.step import TrainStep, classification_loss

CPU = torch.device("cpu")
FP32 = Precision("fp32", channels_last=False, cuda_graph=False)
STEPS, BAD_STEP, BAD_RANK = 3, 1, 1


def _step(model, info, mode, bad):
    cfg = make_config(initial_learning_rate=0.05, learning_rate_decay_factor=1.0)
    opt = FusedMomentum(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, impl="torch")
    buckets = ddp_model = None
    if mode == "buckets":
        buckets = GradBuckets(opt.flat, info, bucket_cap_mb=0.05, first_bucket_mb=0.01, enabled=True)
    else:
        ddp_model = wrap_ddp(model, info)

    def loss_fn(out, y):
        loss = classification_loss(out, y, label_smoothing=0.1)
        # A loss that is not finite while its gradients are: the added constant has no gradient.
        # (Cross-entropy can do this itself: a log-probability of -inf has the finite gradient
        # softmax - target.)
        return loss + torch.tensor(float("inf")) if bad["now"] else loss

    return TrainStep(
        model, optimizer=opt, precision=FP32, device=CPU, world_size=info.world_size, buckets=buckets,
        ddp_model=ddp_model, schedule=LRSchedule(cfg, steps_per_epoch=100, global_batch=4, device=CPU),
        loss_fn=loss_fn, preprocess="resnet",
    )  # fmt: skip


def _one_rank_not_finite(info, out, mode):
    torch.manual_seed(0)  # every rank builds the same model
    model = create_model("resnet18", 5, base_channels=8)
    bad = {"now": False}
    step = _step(model, info, mode, bad)
    gen = torch.Generator().manual_seed(10 + info.rank)  # each rank its own batches
    for i in range(STEPS):
        bad["now"] = info.rank == BAD_RANK and i == BAD_STEP
        images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8, generator=gen)
        step([(images, torch.randint(0, 5, (2,), generator=gen))])
    vec = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(vec) for _ in range(info.world_size)]
    dist.all_gather(everyone, vec)
    skipped = [torch.zeros((), dtype=torch.int64) for _ in range(info.world_size)]
    dist.all_gather(skipped, step.scaler.skipped_steps.clone())
    if info.rank == 0:
        same = [torch.equal(v, vec) for v in everyone]
        torch.save({"same": same, "skipped": [int(s) for s in skipped]}, out)


@pytest.mark.parametrize("mode", ["buckets", "ddp"])
def test_a_loss_not_finite_on_one_rank_skips_the_step_on_every_rank(tmp_path, mode):
    # Before: only the rank whose loss was not finite skipped; the others applied the all-reduced
    # (finite) gradient, so the replicas' weights parted for the rest of the run without a word, and
    # that rank alone stopped at its next log row while the others waited for it.
    spawn(_one_rank_not_finite, 2, str(tmp_path / "result"), mode)
    result = torch.load(tmp_path / "result")
    assert result["skipped"] == [1, 1]
    assert all(result["same"])
