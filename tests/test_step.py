"""The training step: eager on the CPU against plain PyTorch; its training top-1 against the argmax of
the weights before the update; CUDA-graph replay against eager on a GPU."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fasttrain.bn_buffers import BufferEMA
from fasttrain.buckets import GradBuckets
from fasttrain.compile import CompiledModel
from fasttrain.config import make_config
from fasttrain.data.normalize import normalize_images
from fasttrain.dist_info import DistInfo
from fasttrain.input_stall import InputStall
from fasttrain.models import create_model
from fasttrain.optim import FusedMomentum
from fasttrain.precision import Precision
from fasttrain.schedule import LRSchedule
from fasttrain.step import TrainStep, classification_loss

CPU = torch.device("cpu")


def _batches(n, batch=4, size=32, classes=5, seed=0, device=CPU):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=gen).to(device),
            torch.randint(0, classes, (batch,), generator=gen).to(device),
        )
        for _ in range(n)
    ]


def _step_fn(
    model, precision, device, lr=0.05, wd=1e-4, ema=None, impl="torch", dist_info=None, compile_mode=None
):
    cfg = make_config(initial_learning_rate=lr, learning_rate_decay_factor=1.0)
    opt = FusedMomentum(model.parameters(), lr=lr, momentum=0.9, weight_decay=wd, ema_decay=ema, impl=impl)
    schedule = LRSchedule(cfg, steps_per_epoch=100, global_batch=4, device=device)
    loss_fn = lambda out, y: classification_loss(out, y, label_smoothing=0.1)
    bn_ema = BufferEMA(model, ema) if ema else None
    buckets = None
    if dist_info is not None:
        # Small buckets so that a small net still has several, all-reduced as backward fills them.
        buckets = GradBuckets(opt.flat, dist_info, bucket_cap_mb=0.25, first_bucket_mb=0.05, enabled=True)
    step = TrainStep(
        model,
        optimizer=opt,
        precision=precision,
        device=device,
        schedule=schedule,
        loss_fn=loss_fn,
        preprocess="resnet",
        buckets=buckets,
        bn_ema=bn_ema,
        compiled=CompiledModel(model, compile_mode, log=lambda line: None) if compile_mode else None,
    )
    return step, opt


def test_eager_step_equals_plain_pytorch_sgd():
    # Each step starts both sides from the same weights, BN statistics and momentum, so the comparison
    # is one step deep: over several free-running steps a tiny BN-heavy net amplifies last-bit
    # rounding differences (measured: 1e-7 after one step, 1e-4 after six).
    torch.manual_seed(0)
    model = create_model("resnet18", 5, base_channels=8)
    reference = copy.deepcopy(model)
    step, opt = _step_fn(model, Precision("fp32", channels_last=False, cuda_graph=False), CPU)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    for images, labels in _batches(6):
        step([(images, labels)])
        sgd.zero_grad()
        x = normalize_images(images, "resnet", torch.float32, False)
        loss = F.cross_entropy(reference(x), labels, label_smoothing=0.1)
        loss.backward()
        sgd.step()
        assert step.last_loss.item() == pytest.approx(loss.item(), rel=1e-6)
        ours = opt.state_dict()["state"]
        for i, ((name, a), b) in enumerate(zip(model.named_parameters(), reference.parameters())):
            # fp32 update arithmetic in a different order than torch's SGD: a few ulps
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7, msg=name)
            momentum = sgd.state[b]["momentum_buffer"]
            torch.testing.assert_close(ours[i]["momentum_buffer"], momentum, rtol=2e-6, atol=1e-7, msg=name)
            b.data.copy_(a)
            momentum.copy_(ours[i]["momentum_buffer"])
        for a, b in zip(model.buffers(), reference.buffers()):
            assert torch.equal(a, b)
    assert step.step_count.item() == 6


def test_nonfinite_loss_skips_the_update_and_counts():
    torch.manual_seed(0)
    model = create_model("resnet18", 5, base_channels=8)
    step, opt = _step_fn(model, Precision("fp32", channels_last=False, cuda_graph=False), CPU)
    good = _batches(2)
    step([good[0]])
    before = [p.detach().clone() for p in model.parameters()]
    original = step.loss_fn
    step.loss_fn = lambda out, y: original(out, y) * float("nan")
    step([good[1]])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert step.nonfinite_streak.item() == 1 and opt.applied_steps.item() == 1
    step.loss_fn = original
    step([good[1]])
    assert step.nonfinite_streak.item() == 0 and opt.applied_steps.item() == 2


def test_inception_loss_weights_the_aux_head():
    logits, aux = torch.randn(3, 7), torch.randn(3, 7)
    labels = torch.tensor([0, 3, 6])
    expected = F.cross_entropy(logits, labels, label_smoothing=0.1) + 0.4 * F.cross_entropy(
        aux, labels, label_smoothing=0.1
    )
    assert classification_loss((logits, aux), labels, 0.1, 0.4).item() == pytest.approx(expected.item())


def test_bn_ema_follows_tf_warmup():
    model = torch.nn.BatchNorm2d(3)
    ema = BufferEMA(model, decay=0.99)
    model.running_mean.fill_(1.0)
    ema.update(torch.tensor(1), torch.tensor(0.0))  # n = 1: d = min(0.99, 2 / 11)
    d = 2 / 11
    torch.testing.assert_close(ema.shadows[0], torch.full((3,), 1 - d), rtol=1e-6, atol=0)
    ema.update(torch.tensor(2), torch.tensor(1.0))  # a skipped step leaves the shadow alone
    torch.testing.assert_close(ema.shadows[0], torch.full((3,), 1 - d), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("name", "size", "precision"), [
    ("resnet18", 32, "fp32"), ("resnet18", 32, "bf16"),
    ("inception_v3", 75, "fp32"),  # the seed's slim BN, zero-debiased by its update count
])  # fmt: skip
def test_a_skipped_step_leaves_every_buffer_and_the_bn_ema_as_they_were(name, size, precision):
    # A non-finite batch: its forward had already written non-finite running statistics (and the BN
    # EMA's lerp with weight 0 kept them: 0 * NaN is NaN) before the update was skipped. Every later
    # evaluation, and every checkpoint, then held NaN statistics while the run trained on. Every
    # buffer: Inception's update count (num_batches_tracked, TF's zero-debias local_step) left one
    # ahead of statistics put back would debias them wrong for thousands of steps.
    torch.manual_seed(0)
    # Inception as the trainer builds it (slim BN), without the aux head, which needs 299 px
    kwargs = (
        {"base_channels": 8} if name == "resnet18" else {"inception_bn_gamma": False, "aux_logits": False}
    )
    model = create_model(name, 5, **kwargs)
    step, opt = _step_fn(model, Precision(precision, channels_last=False, cuda_graph=False), CPU, ema=0.9)
    for images, labels in _batches(2, size=size):
        step([(images, labels)])
    before = {n: b.clone() for n, b in model.named_buffers()}
    assert any(not b.is_floating_point() for b in before.values())  # the counts are among them
    shadows = {n: s.clone() for n, s in step.bn_ema.state_dict().items()}
    weights = [p.detach().clone() for p in model.parameters()]
    images, labels = _batches(1, size=size, seed=1)[0]
    bad = images.float() / 255  # a float batch (DALI's kind), one value of it infinite
    bad[0, 3, 3, 0] = float("inf")
    step([(bad, labels)])
    assert int(step.scaler.skipped_steps) == 1
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n  # before: NaN statistics, and counts one ahead
    for n, s in step.bn_ema.state_dict().items():
        assert torch.equal(s, shadows[n]), n
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    step([_batches(1, size=size, seed=2)[0]])  # the next step trains on from there
    assert int(opt.applied_steps) == 3
    assert all(torch.isfinite(b).all() for b in model.buffers() if b.is_floating_point())


# --- training top-1 (the ResNet seed's train_accuracy): of the batch trained on, before its update ---


class TwoHeads(torch.nn.Module):
    """Inception's output shape, (logits, aux logits), with heads that disagree."""

    def __init__(self, classes: int):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1))
        self.logits, self.aux = torch.nn.Linear(8, classes), torch.nn.Linear(8, classes)

    def forward(self, x):
        h = self.features(x).flatten(1)
        return self.logits(h), self.aux(h)


def _batch(seed: int, n: int = 64, classes: int = 10):
    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 16, 16, 3), dtype=torch.uint8, generator=gen)
    return images, torch.randint(0, classes, (n,), generator=gen)


def _top1(model, images, labels) -> float:
    """Independent reference: the main head's argmax against the labels, weights before the update."""
    with torch.no_grad():
        logits = model(normalize_images(images, "resnet", torch.float32, False))[0]
    return (logits.argmax(dim=1) == labels).double().mean().item()


@pytest.mark.parametrize("accum", [1, 2])
def test_last_top1_is_the_trained_batches_top1_before_the_update(accum):
    torch.manual_seed(0)
    model = TwoHeads(10)
    opt = FusedMomentum(model.parameters(), lr=0.5, momentum=0.9, impl="torch")
    schedule = LRSchedule(make_config(initial_learning_rate=0.5), 100, 64, CPU)
    loss_fn = lambda out, y: classification_loss(out, y, aux_weight=0.4)
    step = TrainStep(
        model,
        optimizer=opt,
        precision=Precision("fp32", False, False),
        device=CPU,
        schedule=schedule,
        loss_fn=loss_fn,
        preprocess="resnet",
    )
    seen = set()
    for i in range(6):
        batches = [_batch(10 * i + k) for k in range(accum)]
        before = copy.deepcopy(model)
        expected = sum(_top1(before, *b) for b in batches) / accum
        step(batches)
        assert step.last_top1.item() == pytest.approx(expected, abs=1e-6)
        seen.add(round(expected, 4))
    assert len(seen) > 1, "the batches should not all have the same top-1"


# --- CUDA only -------------------------------------------------------------------------------------

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _keep_cudnn_flags():
    flags = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags


def _run(name, size, graph, steps=20, precision="fp32", dist_info=None, pinned=False, compile_mode=None):
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # Inception v3 as the trainer builds it by default (Config.inception_bn_gamma False: the seed's
    # slim batch norm: no gamma, batch_norm given a weight of ones; with weight None this test
    # failed on an H200, torch's channels_last CUDA backward returning an empty bias gradient).
    kwargs = {"base_channels": 16} if name.startswith("resnet") else {"inception_bn_gamma": False}
    model = create_model(name, 5, **kwargs).to(CUDA, memory_format=torch.channels_last)
    policy = Precision(precision, channels_last=True, cuda_graph=graph)
    step, _ = _step_fn(
        model, policy, CUDA, ema=0.99, impl="triton", dist_info=dist_info, compile_mode=compile_mode
    )
    for images, labels in _batches(steps, batch=4, size=size, seed=1, device=CUDA):
        if pinned:  # as the thread loader hands them over
            images, labels = images.cpu().pin_memory(), labels.cpu().pin_memory()
        step([(images, labels)])
    torch.cuda.synchronize()
    return model, step


@pytest.mark.gpu
@pytest.mark.parametrize("name, size", [("resnet50", 64), ("inception_v3", 299)])
def test_graph_replay_equals_eager(name, size):
    eager, _ = _run(name, size, graph=False)
    graphed, step = _run(name, size, graph=True)
    assert step.graph is not None
    for (key, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_regions_replay_in_the_graph_as_they_run_eagerly(precision):
    # --compile inside the whole-step graph: inductor's kernels, compiled before the warm-up steps,
    # replayed; the same kernels run eagerly give the same training.
    eager, _ = _run("resnet18", 64, graph=False, steps=8, precision=precision, compile_mode="default")
    graphed, step = _run("resnet18", 64, graph=True, steps=8, precision=precision, compile_mode="default")
    assert step.graph is not None and step.compiled.active
    for (key, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.gpu
def test_pinned_host_batches_go_through_the_staging_copy_and_train_the_same():
    # Host batches are copied on the copy stream into staging buffers, then into the graph's inputs:
    # the same training as batches already on the device, which skip the staging.
    on_device, step_d = _run("resnet18", 32, graph=True, steps=8)
    from_host, step_h = _run("resnet18", 32, graph=True, steps=8, pinned=True)
    assert step_h.graph is not None and len(step_h._staging) == 1 and not step_d._staging
    for (key, a), b in zip(on_device.state_dict().items(), from_host.state_dict().values()):
        assert torch.equal(a, b), key


@pytest.mark.gpu
def test_replayed_step_never_syncs_the_host():
    model, step = _run("resnet18", 32, graph=True, steps=5)
    batch = _batches(1, size=32, seed=9, device=CUDA)[0]
    pinned = tuple(t.cpu().pin_memory() for t in batch)  # the loader's: through the staging copy
    step.timeline = InputStall(loader=None, cuda=True, log=print, num_workers=0)  # the trainer's events
    torch.cuda.set_sync_debug_mode("error")
    try:
        step([batch])
        step([pinned])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert step.timeline._steps == 2  # both steps timed, without a host sync


@pytest.mark.gpu
def test_injected_fp16_overflow_skips_exactly_that_step():
    model, step = _run("resnet18", 32, graph=True, steps=5, precision="fp16")
    # The first steps at the initial scale 2^16 may overflow by themselves (the scaler then halves
    # it, as GradScaler does): count the skips from here on.
    skipped = step.scaler.skipped_steps.item()
    before = [p.detach().clone() for p in model.parameters()]
    step.scaler.scale.fill_(3e38)  # the scaled loss overflows fp32 gradients: inf/NaN everywhere
    step([_batches(1, size=32, seed=7, device=CUDA)[0]])
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert step.scaler.skipped_steps.item() == skipped + 1
    assert step.scaler.scale.item() == pytest.approx(1.5e38)
    step.scaler.scale.fill_(1024.0)  # small enough that this tiny net's fp16 gradients stay finite
    step([_batches(1, size=32, seed=8, device=CUDA)[0]])
    torch.cuda.synchronize()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert step.scaler.skipped_steps.item() == skipped + 1


@pytest.mark.gpu
def test_bucket_all_reduces_are_captured_in_the_graph_on_nccl(tmp_path):
    # One GPU allows one NCCL rank (NCCL refuses two ranks on one device), so this checks the capture
    # mechanics on a one-rank communicator with the buckets forced on: the hooks launch every bucket's
    # all_reduce during capture (ProcessGroupNCCL's stream joins and wait() are recorded), the capture
    # succeeds, and replay equals the eager bucketed run. On one rank an in-place all_reduce is no
    # kernel at all (NCCL returns early), so sums inside a graph need a machine with several GPUs.
    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    device = torch.device("cuda", torch.cuda.current_device())
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    try:
        info = DistInfo(rank=0, world_size=1, local_rank=0, device=device, backend="nccl", is_main=True)
        eager, eager_step = _run("resnet18", 32, graph=False, steps=8, dist_info=info)
        graphed, step = _run("resnet18", 32, graph=True, steps=8, dist_info=info)
        captured, works = step.graph is not None, len(step.buckets._works)
        step.release_graph()  # as the trainer does before leaving the group (pytorch#115388)
    finally:
        dist.destroy_process_group()
    assert captured and step.buckets._rebuilt
    assert len(step.buckets.bucket_ranges) >= 3
    # The captured step launched (recorded) every bucket, as the last eager steps did.
    assert works == len(step.buckets.bucket_ranges) == len(eager_step.buckets._works)
    for (key, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=key)


def test_last_grad_scale_is_the_scale_the_step_s_gradients_were_made_with():
    # The histograms unscaled p.grad by the loss scale read after the step; on a growth step that is
    # twice the one backward used, and they showed half the gradients.
    from fasttrain.precision import DynamicLossScaler

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    reference = copy.deepcopy(model)
    opt = FusedMomentum(model.parameters(), lr=0.0, momentum=0.0, impl="torch")
    step = TrainStep(
        model, optimizer=opt, precision=Precision("fp16", False, False), device=cpu,
        schedule=LRSchedule(make_config(initial_learning_rate=0.0), 100, 4, cpu),
        loss_fn=lambda out, y: F.cross_entropy(out.float(), y), preprocess="resnet",
    )  # fmt: skip
    step.scaler = DynamicLossScaler(cpu, True, growth_interval=2)  # 2000 in a run
    x, y = torch.randn(4, 2, 2, 3), torch.tensor([0, 1, 2, 0])
    with torch.autocast("cpu", dtype=torch.float16):  # float NHWC batches go in as they are (model_input)
        F.cross_entropy(reference(x.permute(0, 3, 1, 2)).float(), y).backward()
    for _ in range(2):
        step([(x, y)])
    assert step.scaler.scale.item() == 2.0**17  # grown at the end of step 2
    assert step.last_grad_scale.item() == 2.0**-16  # what step 2's backward was scaled by
    unscaled = model[1].weight.grad * step.last_grad_scale
    torch.testing.assert_close(unscaled, reference[1].weight.grad, rtol=1e-2, atol=1e-4)  # fp16 autocast
