"""The whole training step is capturable in a CUDA graph: proven on the meta device, without a GPU.

A CUDA graph replays the kernels and addresses recorded at capture. Three things in a step break
that, and each fails here:
- a host read (`.item()`, `bool(tensor)`, `.tolist()`): a sync inside capture, and a value frozen
  into the graph. A meta tensor has no data, so every host read raises.
- a CPU tensor mixed into the step (a 0-d CPU tensor is accepted by device ops, so this passes
  silently on a GPU and on meta alike): its value is read on the host at capture and baked in.
  `_DeviceOnly`, a dispatch mode, fails every op that takes a tensor off the step's device.
- a persistent buffer reallocated (a parameter, gradient, optimizer state, EMA shadow, loss scale,
  step counter... rebound to a new tensor): the graph keeps writing the old address. `_storages`
  records every tensor reachable from the TrainStep by name with its storage and view geometry, and
  two steps must leave each exactly where it was.

What runs is `TrainStep._body`, the part `torch.cuda.graph` captures, built as the trainer builds
it (build_model, build_optimizer, make_loss, BufferEMA, GradBuckets with the recipe's sizes):
ResNet-50 (momentum) and Inception v3 (RMSProp, aux head) in channels_last, with EMA and BN EMA, two
micro-batches (only the last communicates), fp16 dynamic loss scaling, world size 2 (torch's fake
process group: the gradient buckets' hooks launch every all-reduce on meta views of the flat
gradient buffer, and the optimizer folds 1 / (scale * world) into its grad multiplier), and the
Triton optimizer, whose custom ops trace through their fake implementations.

What meta cannot show: autocast. A meta tensor has no autocast dispatch key (torch.autocast("meta")
is refused), so the forward runs in fp32 here (`_LOSS_SCALED_FP32`): the fp16 casts are not traced,
the loss-scaling state machine is. Replay itself, NCCL in a graph and speed: `fasttrain selfcheck`.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fasttrain.bn_buffers import BufferEMA
from fasttrain.buckets import GradBuckets
from fasttrain.config import make_config
from fasttrain.dist_info import DistInfo
from fasttrain.precision import DynamicLossScaler, Precision
from fasttrain.run import build_model, build_optimizer, make_loss
from fasttrain.schedule import LRSchedule
from fasttrain.step import TrainStep

META = torch.device("meta")
# What a meta tensor raises when read on the host: RuntimeError ("Tensor.item() cannot be called on
# meta tensors") for .item() and bool(), NotImplementedError ("Cannot copy out of meta tensor") for
# .tolist().
_HOST_READ_ON_META = (RuntimeError, NotImplementedError)
MICRO_BATCHES = 2
WORLD_SIZE = 2


@dataclasses.dataclass(frozen=True)
class _LossScaledFp32(Precision):
    """fp16's dynamic loss scaling with an fp32 forward (meta has no autocast; module docstring)."""

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def autocast(self) -> bool:
        return False


# A CUDA fp16 run's policy, with the 4-channel stem (--pad_stem, asked for).
_LOSS_SCALED_FP32 = _LossScaledFp32("fp16", channels_last=True, cuda_graph=False, stem_channels=4)


class _DeviceOnly(TorchDispatchMode):
    """Fails any op (forward, backward, optimizer, custom op) taking a tensor off `device`."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.ops: set[str] = set()  # every op checked, so a test can tell the trace was not vacuous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.add(str(func.overloadpacket))
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.device != self.device:
                raise AssertionError(
                    f"{func} takes a {tuple(t.shape)} tensor on {t.device} inside the step (on {self.device})"
                )
        return func(*args, **kwargs)


def _storages(step: TrainStep) -> dict[str, tuple]:
    """{name: (tensor, storage identity and view geometry)} for every tensor the step keeps between
    steps: the model's parameters, gradients and buffers, and whatever the step, its optimizer (flat
    buffers, states, EMA, param_groups' lr), loss scaler, schedule and BN EMA hold."""
    found = {}

    def walk(name, obj, depth):
        if isinstance(obj, torch.Tensor):
            found[name] = obj
        elif depth == 0 or isinstance(obj, torch.nn.Module):
            return
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(f"{name}[{key!r}]", value, depth - 1)
        elif isinstance(obj, list | tuple):
            for i, value in enumerate(obj):
                walk(f"{name}[{i}]", value, depth - 1)
        elif type(obj).__module__.startswith("fasttrain."):
            for key, value in vars(obj).items():
                walk(f"{name}.{key}", value, depth - 1)

    walk("step", step, 5)
    for key, t in step.model.state_dict(keep_vars=True).items():
        found[f"model.{key}"] = t
    for key, p in step.model.named_parameters():
        found[f"model.{key}.grad"] = p.grad
    geometry = lambda t: (t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride())
    return {name: (t, None if t is None else geometry(t)) for name, t in found.items()}


def _trace(step: TrainStep, batches, steps: int = 2) -> tuple[set[str], dict]:
    """Run `steps` captured-step bodies on meta under `_DeviceOnly` and fail on any reallocated
    buffer; returns the ops seen and the buffers compared."""
    before = _storages(step)  # holds the tensors: an old address cannot be reused while compared
    with _DeviceOnly(step.device) as mode:
        for _ in range(steps):
            step._body(batches)  # what TrainStep._capture records (its inputs: static device batches)
    after = _storages(step)
    moved = [name for name, (_, key) in before.items() if name not in after or after[name][1] != key]
    assert not moved, f"the step reallocated buffers a CUDA graph would capture: {moved[:8]}"
    return mode.ops, before


def _meta_step(recipe: str, buckets: bool = False, **overrides) -> tuple[TrainStep, list]:
    """The trainer's step for `recipe` on meta; with `buckets`, gradient buckets over the fake
    process group (`fake_world`)."""
    cfg = make_config(recipe=recipe, optimizer_impl="triton", ema_decay=0.9999, **overrides)
    with META:
        model = build_model(cfg).to(memory_format=torch.channels_last)
    optimizer = build_optimizer(cfg, model)
    schedule = LRSchedule(cfg, steps_per_epoch=100, global_batch=cfg.batch_size * WORLD_SIZE, device=META)
    grad_buckets = None
    if buckets:
        info = DistInfo(
            rank=0, world_size=WORLD_SIZE, local_rank=0, device=META, backend="fake", is_main=True
        )
        grad_buckets = GradBuckets(optimizer.flat, info, bucket_cap_mb=cfg.bucket_cap_mb)
    step = TrainStep(
        model,
        optimizer=optimizer,
        precision=_LOSS_SCALED_FP32,
        device=META,
        schedule=schedule,
        loss_fn=make_loss(cfg),
        preprocess=cfg.preprocess,
        world_size=WORLD_SIZE,
        buckets=grad_buckets,
        bn_ema=BufferEMA(model, cfg.ema_decay),
    )
    size = cfg.image_size
    batches = [
        (
            torch.empty((2, size, size, 3), dtype=torch.uint8, device=META),  # (N, H, W, C) loader batch
            torch.empty((2,), dtype=torch.int64, device=META),
        )
        for _ in range(MICRO_BATCHES)
    ]
    return step, batches


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    # make_config refuses --optimizer_impl=triton on a machine without CUDA unless the interpreter is
    # on; on meta the kernels never launch either way (their custom ops' fakes run).
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def fake_world():
    """A two-rank process group whose collectives do nothing (torch's fake backend, registered by
    importing its test module), so the buckets' all-reduces run on meta tensors."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=WORLD_SIZE)
    try:
        yield
    finally:
        dist.destroy_process_group()


RECIPES = [("resnet50", "FusedMomentum"), ("inception_v3", "FusedRMSPropTF")]


@pytest.mark.parametrize("recipe, optimizer", RECIPES)
def test_whole_step_traces_on_meta(recipe, optimizer, fake_world):
    step, batches = _meta_step(recipe, buckets=True)
    assert type(step.optimizer).__name__ == optimizer and step.optimizer.impl == "triton"
    assert step.scaler.enabled and step.world_divisor == WORLD_SIZE and step.bn_ema is not None
    conv_weights = [p for p in step.model.parameters() if p.dim() == 4]
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in conv_weights)
    ops, buffers = _trace(step, batches)
    # Not vacuous: backward, the fused optimizer's custom op, loss scaling, the BN EMA (lerp) and the BN
    # statistics' guard (cat, _foreach_copy_) all ran under the check, and the buffers compared include
    # every kind the graph would capture.
    kernel = "rmsprop_tf_update" if optimizer == "FusedRMSPropTF" else "momentum_update"
    traced = {
        "aten.convolution_backward", f"fasttrain.{kernel}", "aten._amp_update_scale_", "aten.lerp",
        "aten._foreach_copy_", "aten.cat", "c10d.allreduce_",
        "aten.constant_pad_nd",  # the stem's weight padded to 4 channels
    }  # fmt: skip
    assert traced <= ops, sorted(traced - ops)
    assert len(step.buckets.bucket_ranges) >= 3
    assert len(step.buckets._works) == len(step.buckets.bucket_ranges)  # every bucket, last step
    expected = [
        "step.optimizer.flat.params", "step.optimizer.flat.grad", "step.optimizer._buffers['ema']",
        "step.optimizer._buffers['momentum_buffer']", "step.optimizer.applied_steps", "step.lr",
        "step.scaler.scale", "step.step_count", "step.last_loss", "step.loss_average",
        "step.bn_ema.shadows[0]", "step.bn_ema.flat", "step.bn_guard.parts[0].saved",
        "step.bn_guard.parts[0].current", "step.bn_guard.parts[1].saved", "model.fc.weight",
        "model.fc.weight.grad",
    ]  # fmt: skip
    assert set(expected) <= set(buffers), sorted(set(expected) - set(buffers))


def test_whole_step_traces_on_meta_resnet_v2(fake_world):
    # The ResNet seed's pre-activation v2 (TF SAME max-pool by ceil_mode, in-place ReLUs and adds).
    step, batches = _meta_step("resnet50", buckets=True, model="resnet50_v2")
    assert type(step.model).__name__ == "ResNetV2"
    ops, _ = _trace(step, batches)
    assert {"aten.convolution_backward", "aten.max_pool2d_with_indices_backward"} <= ops


# --- each fault, injected, is caught ---------------------------------------------------------------
# A small ResNet (the faults do not depend on the architecture; ResNet-50 costs ~2 s per trace).


def _small_step():
    return _meta_step("resnet50", model="resnet18", base_channels=8, image_size=32)


def test_clean_small_step_passes():
    _trace(*_small_step())  # so that each failure below is the injected fault's


def _loss_with(step, extra):
    original = step.loss_fn
    step.loss_fn = lambda out, labels: extra(original(out, labels))


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda loss: loss * (1.0 if loss.item() < 1e30 else 0.0), id="item"),
        pytest.param(lambda loss: loss if bool(torch.isfinite(loss)) else loss * 0, id="bool"),
        pytest.param(lambda loss: loss * len(loss.detach().reshape(1).tolist()), id="tolist"),
    ],
)
def test_a_host_read_fails(read):
    step, batches = _small_step()
    _loss_with(step, read)
    with pytest.raises(_HOST_READ_ON_META, match="meta tensor"):
        _trace(step, batches)


def test_a_host_read_in_the_loss_scaler_fails(monkeypatch):
    def update(self, found_inf):
        if found_inf:  # bool(tensor): the classic host-side skip decision
            self.scale.mul_(self.backoff_factor)

    monkeypatch.setattr(DynamicLossScaler, "update", update)
    with pytest.raises(_HOST_READ_ON_META, match="meta tensor"):
        _trace(*_small_step())


def test_a_cpu_tensor_mixed_in_fails():
    step, batches = _small_step()
    # A 0-d CPU tensor: device ops accept it, so only the dispatch mode can tell.
    _loss_with(step, lambda loss: loss * torch.tensor(1.0))
    step(batches)  # unchecked, it slips through
    with pytest.raises(AssertionError, match="on cpu inside the step"):
        _trace(step, batches)


def test_a_cpu_tensor_in_the_schedule_fails(monkeypatch):
    step, batches = _small_step()
    # Made on the host, as `torch.tensor(factor)` without device= would be.
    monkeypatch.setattr(step.schedule, "_factor", torch.tensor(step.schedule.factor, dtype=torch.float64))
    with pytest.raises(AssertionError, match="on cpu inside the step"):
        _trace(step, batches)


def test_a_rebound_loss_scale_fails(monkeypatch):
    original = DynamicLossScaler.update

    def update(self, found_inf):
        self.scale = self.scale.clone()  # out of place: the graph would keep the old scale's address
        original(self, found_inf)

    monkeypatch.setattr(DynamicLossScaler, "update", update)
    with pytest.raises(AssertionError, match=r"reallocated buffers.*step\.scaler\.scale"):
        _trace(*_small_step())


def test_out_of_place_bn_ema_shadows_fail(monkeypatch):
    def update(self, applied_steps, found_inf):  # the average into a new flat tensor, not into `flat`
        n = applied_steps.to(torch.float32)
        weight = (1 - torch.clamp((1 + n) / (10 + n), max=self.decay)) * (1 - found_inf)
        current = torch.cat([b.reshape(-1) for b in self.buffers])
        self.flat = torch.lerp(self.flat, current, weight)

    monkeypatch.setattr(BufferEMA, "update", update)
    with pytest.raises(AssertionError, match=r"reallocated buffers.*step\.bn_ema\.flat"):
        _trace(*_small_step())


def test_out_of_place_bn_guard_copies_fail(monkeypatch):
    from fasttrain.bn_buffers import _SavedBuffers

    def save(self):  # a new tensor each step: the captured graph would keep writing the first one
        self.saved = torch.cat([b.reshape(-1) for b in self.buffers])

    monkeypatch.setattr(_SavedBuffers, "save", save)
    with pytest.raises(AssertionError, match=r"reallocated buffers.*step\.bn_guard\.parts\[0\]\.saved"):
        _trace(*_small_step())


def test_gradients_moved_out_of_the_flat_buffer_fail():
    step, batches = _small_step()
    flat = step.optimizer.flat

    def adopt_grads():
        for p, _, _ in flat.segments:
            p.grad = p.grad.clone()  # a fresh gradient tensor each step instead of the flat view

    flat.adopt_grads = adopt_grads
    with pytest.raises(AssertionError, match=r"reallocated buffers.*\.grad"):
        _trace(step, batches)
