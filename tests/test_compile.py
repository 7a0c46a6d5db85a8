"""--compile on the CPU (inductor's C++ backend): the compiled step against the eager step, the regions,
the fallback to eager in one line, and gradients reaching the buckets while backward runs (gloo)."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from launch_helpers import spawn

from fasttrain.buckets import GradBuckets
from fasttrain.compile import CompiledModel, compile_regions
from fasttrain.config import make_config
from fasttrain.models import create_model
from fasttrain.models.inception_v3 import Inception3
from fasttrain.optim import FusedMomentum
from fasttrain.precision import Precision
from fasttrain.schedule import LRSchedule
from fasttrain.step import TrainStep, classification_loss

CPU = torch.device("cpu")
FP32 = Precision("fp32", channels_last=False, cuda_graph=False)


def _batches(n, batch=2, size=32, classes=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=gen),
            torch.randint(0, classes, (batch,), generator=gen),
        )
        for _ in range(n)
    ]


def _model(name):
    torch.manual_seed(0)
    if name == "inception_v3":  # reduced: a tenth of the channels (299 px: the aux head needs it)
        return Inception3(5, depth_multiplier=0.1)
    return create_model(name, 5, base_channels=8)


def _step(model, compiled=None, buckets=None, world=1, precision=FP32, ddp=None):
    cfg = make_config(initial_learning_rate=0.05, learning_rate_decay_factor=1.0)
    opt = FusedMomentum(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, impl="torch")
    if compiled is not None:
        compiled = CompiledModel(model, "default", log=compiled.append)
    ddp_model = None
    if ddp is not None:  # torch DDP around the model (its blocks compiled first, as fasttrain.run does)
        from fasttrain.distributed import wrap_ddp

        ddp_model = wrap_ddp(model, ddp)
    if buckets is not None:
        buckets = GradBuckets(opt.flat, buckets, bucket_cap_mb=0.05, first_bucket_mb=0.01, enabled=True)
    return TrainStep(
        model, optimizer=opt, precision=precision, device=CPU, world_size=world, buckets=buckets,
        schedule=LRSchedule(cfg, steps_per_epoch=100, global_batch=2, device=CPU),
        loss_fn=lambda out, y: classification_loss(out, y, label_smoothing=0.1, aux_weight=0.4),
        preprocess="inception", compiled=compiled, ddp_model=ddp_model,
    )  # fmt: skip


# How close is close enough, per model, one step deep (as tests/test_step.py compares the eager step
# with torch.optim). inductor computes BatchNorm's batch statistics in its own blocked reduction order
# and fuses the elementwise ops, so its activations differ from eager's in the last bits (2e-7 relative,
# measured on a region alone), and backward amplifies that by the network's conditioning:
# - ResNets, 64 px, 4 images (at 32 px and 2 images their last BN normalises 2 values per channel and
#   one step grew the difference to 7e-3 of a gradient): measured, every momentum buffer (the step's
#   gradient) within 1e-6 (resnet18) and 1.4e-5 (resnet18_v2) of its tensor's largest value. Bound:
#   2e-4 of each tensor's scale.
# - Inception v3 at a tenth of its channels, 299 px, 8 images: fp32 itself is the limit. Measured when
#   this was written: eager fp32 gradients are 1.7% (L2) from the same net in float64, compiled fp32
#   1.6% from eager fp32, and compiled vs eager both in float64 agree to 2e-12, so the compiled code is
#   the same arithmetic. Bound: 5% L2 on the whole gradient, 1e-3 L2 on weights and BN statistics.
# A missing or doubled update, a wrong statistic or a stale weight moves values by far more.
_PER_TENSOR, _WHOLE = "max-abs per tensor", "L2 over the step's state"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, size, images, bound, stem",
    [
        ("resnet18", 64, 4, _PER_TENSOR, 3),
        ("resnet18", 64, 4, _PER_TENSOR, 4),  # the compiled stem on 4 channels (--pad_stem), eager on 3
        ("resnet18_v2", 64, 4, _PER_TENSOR, 3),
        ("inception_v3", 299, 8, _WHOLE, 3),
    ],
)
def test_compiled_step_equals_the_eager_step(name, size, images, bound, stem):
    eager_model = _model(name)
    compiled_model = copy.deepcopy(eager_model)
    eager, log = _step(eager_model), []
    compiled = _step(compiled_model, compiled=log, precision=dataclasses.replace(FP32, stem_channels=stem))
    assert compiled.compiled.active and len(compiled.compiled.regions) == len(compile_regions(eager_model))
    for k, batch in enumerate(_batches(3, batch=images, size=size)):
        # Dropout (Inception) draws from torch's generator: both steps draw the same masks.
        torch.manual_seed(100 + k)
        eager([batch])
        torch.manual_seed(100 + k)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            compiled([batch])
        if k > 0:  # (the first step's compile traces ATen's ops too)
            # The stems' max pools run inside compiled regions (ATen's max pool, run between regions,
            # took 5 ms of Inception v3's 34 ms step on an H200): no max pool of ATen's runs.
            eager_pools = {e.name for e in profile.events() if e.name.startswith("aten::max_pool")}
            assert not eager_pools, eager_pools
        ours, theirs = (
            compiled.optimizer._buffers["momentum_buffer"],
            eager.optimizer._buffers["momentum_buffer"],
        )
        states = [
            (k_, a, b)
            for (k_, a), b in zip(eager_model.state_dict().items(), compiled_model.state_dict().values())
        ]
        for key, a, b in states:
            if not a.is_floating_point():
                assert torch.equal(a, b), key  # num_batches_tracked: the warm-up's forward is undone
        floats = [(key, a, b) for key, a, b in states if a.is_floating_point()]
        if bound == _PER_TENSOR:
            for key, a, b in [*floats, ("momentum", theirs, ours)]:
                worst = (a - b).abs().max().item()
                assert worst <= 2e-4 * a.abs().max().item() + 1e-7, f"step {k}, {key}: {worst:.2e}"
        else:
            assert (ours - theirs).norm() <= 5e-2 * theirs.norm(), f"step {k}: gradient"
            a = torch.cat([a.flatten() for _, a, _ in floats])
            b = torch.cat([b.flatten() for _, _, b in floats])
            assert (a - b).norm() <= 1e-3 * a.norm(), f"step {k}: weights and BN statistics"
        assert compiled.last_loss.item() == pytest.approx(eager.last_loss.item(), rel=1e-5)
        with torch.no_grad():  # start the next step from the same state
            for a, b in zip(eager_model.state_dict().values(), compiled_model.state_dict().values()):
                b.copy_(a)
            ours.copy_(theirs)
    n = len(compiled.compiled.regions)
    assert len(log) == 2, log  # the start-up line before the compile (it can take minutes), then its time
    assert log[0].startswith(f"fasttrain: compiling {n} regions") and "--no-compile" in log[0]
    assert log[1].startswith(f"fasttrain: compiled {n} regions")


def _compiles() -> dict:
    counters = torch._dynamo.utils.counters
    return {"frames": dict(counters["frames"]), "graphs": counters["stats"]["unique_graphs"]}


@pytest.mark.slow
def test_the_steps_after_the_warm_up_compile_nothing():
    """Every region's graph comes from the warm-up: a compile during the CUDA-graph capture would launch
    and synchronise, which the capture refuses. With the GPU policy's input (bf16 autocast,
    channels_last, 3 channels: --pad_stem is off by default since the third GPU run; the compiled
    4-channel stem is checked above), the non-graph step on the CPU runs the same forward and backward
    as the capture."""
    model = _model("resnet18")
    gpu_policy = Precision("bf16", channels_last=True, cuda_graph=False, stem_channels=3)
    step = _step(model, compiled=[], precision=gpu_policy)
    after_warm_up, warm_up = [], step.compiled.warm_up

    def counted(*args):
        warm_up(*args)
        after_warm_up.append(_compiles())

    step.compiled.warm_up = counted
    for batch in _batches(3, batch=4, size=64):
        step([batch])
    assert after_warm_up and after_warm_up[0]["graphs"] > 0
    assert _compiles() == after_warm_up[0]


def test_regions_are_the_blocks():
    with torch.device("meta"):
        names = {
            name: [n for n, _ in compile_regions(create_model(name, 1001))]
            for name in ("resnet50", "resnet50_v2", "inception_v3")
        }
    assert names["resnet50"][:3] == ["stem", "layer1.0", "layer1.1"] and len(names["resnet50"]) == 1 + 16
    assert names["resnet50_v2"][:2] == ["stem", "layer1.0"] and len(names["resnet50_v2"]) == 1 + 16
    assert names["inception_v3"][:5] == [
        "Conv2d_1a_3x3",
        "Conv2d_2a_3x3",
        "conv_pool1",  # Conv2d_2b_3x3 and maxpool1
        "Conv2d_3b_1x1",
        "conv_pool2",  # Conv2d_4a_3x3 and maxpool2
    ]
    assert "AuxLogits" in names["inception_v3"] and "Mixed_7c" in names["inception_v3"]
    assert len(names["inception_v3"]) == 5 + 11 + 1


def test_the_meta_device_stays_eager_and_says_so():
    log = []
    with torch.device("meta"):
        model = create_model("resnet18", 5, base_channels=8)
    compiled = CompiledModel(model, "default", log=log.append)
    assert not compiled.active
    assert log == [
        "fasttrain: --compile: running the model eagerly: the meta device runs nothing (the step is "
        "traced there uncompiled)"
    ]


def test_a_model_that_stays_eager_never_runs_the_compile_warm_up(monkeypatch):
    # A GPU inductor cannot compile for (a P40, the ResNet seed's, is sm_61) keeps --compile's default
    # on, and its regions stay eager: the step must not run the compile warm-up (a zero batch's
    # forward and backward) on every step. Checked when this was written: without the test of
    # `active` in TrainStep.__call__, it ran at each of the three steps.
    import fasttrain.compile

    monkeypatch.setattr(fasttrain.compile, "why_not_compiled", lambda device: "an sm_61 GPU (test)")
    model, log = _model("resnet18"), []
    step = _step(model, compiled=log)
    assert not step.compiled.active
    warm_ups = []
    real = step._compile_now
    monkeypatch.setattr(step, "_compile_now", lambda batch: (warm_ups.append(1), real(batch)))
    for batch in _batches(3):
        step([batch])
    assert warm_ups == [] and log == ["fasttrain: --compile: running the model eagerly: an sm_61 GPU (test)"]


@pytest.mark.slow
def test_a_model_inductor_cannot_compile_runs_eagerly_with_one_line():
    # No C++ compiler: inductor's CPU backend fails while compiling the first region.
    import torch._inductor.config as inductor_config

    # torch's own config.patch, not monkeypatch: force_disable_caches is an alias of
    # torch.compiler.config's, and pytest 9.2's monkeypatch undid it by deleting the alias (every later
    # compile in the session then failed: "torch._inductor.config.force_disable_caches does not exist").
    no_compiler = inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++"), "force_disable_caches": True})
    torch._dynamo.reset()
    model, log = _model("resnet18"), []
    reference = copy.deepcopy(model)
    step, eager = _step(model, compiled=log), _step(reference)
    try:
        with no_compiler:
            for batch in _batches(2):
                step([batch])
                eager([batch])
    finally:
        torch._dynamo.reset()
    assert not step.compiled.active
    assert len(log) == 2 and log[0].startswith("fasttrain: compiling "), log  # then one line says why
    assert log[1].startswith(
        "fasttrain: --compile: inductor could not compile the model, running it eagerly: "
    )
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)  # eager, bit for bit


def _overlap(info, out):
    # Does a bucket's all-reduce start before backward reaches layer1? The blocks are compiled, the
    # code between them is eager: a hook on the gradient of layer1's output fires when layer2's
    # backward is done and layer1's (and the stem's) is still to run. Checked when this was written:
    # with GradBuckets launching nothing before wait() (the end of backward), this test fails.
    events = []
    launch = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        events.append("all_reduce")
        return launch(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    try:
        torch.manual_seed(0)
        model = create_model("resnet18", 5, base_channels=8)

        def mark(_module, _inputs, output) -> None:
            if output.requires_grad:
                output.register_hook(lambda grad: events.append("layer1"))

        model.layer1.register_forward_hook(mark)
        step = _step(model, compiled=[], buckets=info, world=info.world_size)
        for batch in _batches(3, seed=info.rank):
            events.clear()
            step([batch])
        torch.save(dict(events=events, buckets=len(step.buckets.bucket_ranges)), f"{out}.{info.rank}")
    finally:
        dist.all_reduce = launch


@pytest.mark.slow
def test_compiled_regions_hand_gradients_to_the_buckets_during_backward(tmp_path):
    spawn(_overlap, 2, str(tmp_path / "events"))
    for rank in range(2):
        result = torch.load(tmp_path / f"events.{rank}")
        events = result["events"]
        assert result["buckets"] >= 3 and events.count("all_reduce") == result["buckets"], result
        before = events[: events.index("layer1")].count("all_reduce")
        assert before >= 2, f"rank {rank}: {events}"  # layer4's and layer3's buckets at least


def _ddp(info, out):
    # --grad_sync ddp with the compiled blocks (the default on CUDA now): torch DDP around the model
    # whose blocks inductor compiled, as fasttrain.run builds them, against the same DDP step eager.
    model = _model("resnet18")
    reference = copy.deepcopy(model)
    log = []
    compiled = _step(model, compiled=log, world=info.world_size, ddp=info)
    eager = _step(reference, world=info.world_size, ddp=info)
    for batch in _batches(3, size=64, batch=4, seed=info.rank):
        compiled([batch])
        eager([batch])
    torch.save(
        dict(
            compiled={k: v.detach().clone() for k, v in model.state_dict().items()},
            eager={k: v.detach().clone() for k, v in reference.state_dict().items()},
            active=compiled.compiled.active,
            log=log,
        ),
        f"{out}.{info.rank}",
    )


@pytest.mark.slow
def test_compiled_blocks_under_torch_ddp_train_as_the_eager_ddp_step(tmp_path):
    spawn(_ddp, 2, str(tmp_path / "ddp"))
    results = [torch.load(tmp_path / f"ddp.{rank}") for rank in range(2)]
    for rank, result in enumerate(results):
        assert result["active"], result["log"]  # compiled, not fallen back to eager
        for key, a in result["eager"].items():
            b = result["compiled"][key]
            if not a.is_floating_point():
                assert torch.equal(a, b), key
                continue
            worst = (a - b).abs().max().item()  # the per-tensor bound of the single-process test above
            assert worst <= 2e-4 * a.abs().max().item() + 1e-7, f"rank {rank}, {key}: {worst:.2e}"
    for key, a in results[0]["compiled"].items():  # DDP averaged the gradients: the same weights
        if key.endswith("weight") or key.endswith("bias"):
            assert torch.equal(a, results[1]["compiled"][key]), key


@pytest.mark.parametrize(
    "flag, device, deterministic, wanted",
    [
        (None, "cuda", False, True),
        (None, "cpu", False, False),
        (None, "cuda", True, False),
        (False, "cuda", False, False),
        (True, "cpu", False, True),
        (True, "cuda", True, True),
    ],
)
def test_compile_is_the_default_on_cuda_only(flag, device, deterministic, wanted):
    # Measured faster on CUDA (bench/results/2026-11-27-h200-second-run/); on the CPU inductor's code is
    # no faster and compiles for minutes; --deterministic keeps the eager kernels unless --compile is
    # given. --compile / --no-compile decide where given.
    from fasttrain.compile import compile_wanted

    assert compile_wanted(flag, torch.device(device), deterministic) is wanted
