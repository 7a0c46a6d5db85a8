"""One training step, run eagerly or captured once into a CUDA graph and replayed.

A step is, with everything on the device and no host synchronisation:
  zero the flat gradient buffer
  for each micro-batch: normalise (uint8 NHWC -> float, channels_last), forward under autocast,
      loss (label smoothing, Inception aux head), backward of loss * scale / accum
      (the gradient buckets all-reduce as they fill; only the last micro-batch communicates)
  wait for the all-reduces
  found_inf = loss or any gradient not finite        # one read of the gradient buffer; on several
                                                      # ranks a loss not finite on any of them
                                                      # (its NaN rides the all-reduce)
  lr = schedule(step)                                 # from the device step counter
  fused optimizer + EMA with grad_scale = 1 / (scale * world), skipped bit-for-bit on found_inf
  on found_inf, the BN running statistics back to their values before the forward (fasttrain/bn_buffers.py)
  BN running-statistics EMA, loss-scale update, step counter += 1
The loss and the training top-1 are read back to the host only when the trainer logs.

CUDA graphs: the first `warmup_steps` steps run eagerly on a side stream (as PyTorch's CUDA-graph
notes require, and so that the bucketer can observe the backward order), then the next step is
captured into static input buffers and every step after that is `copy inputs; replay`. The warm-up
steps are real steps on real batches, so a graph run is numerically the same as an eager one.

Inputs of a replayed step: a batch in pinned host memory is copied to the device on a copy stream,
into a staging buffer, as soon as the trainer hands it over, which is while the previous step still
replays (the CPU runs a step ahead); the step then only waits for that copy and moves the staging
buffer into the graph's static inputs, a device-to-device copy (38 MB at batch 256 and 224 px:
about 20 us at the H200's 4.2 TB/s, against about 1.5 ms for the host copy over PCIe that it takes off
the step's critical path). Events order the streams: the copy of batch n+1 waits until batch n has
left the staging buffer, and the step waits for the copy, so the loader's release event for a slot
(recorded on the step's stream when the next batch is asked for) also covers the copy out of it.

Compiled model (--compile, fasttrain/compile.py): before the first step the regions are compiled by
one forward and backward of a zero batch of the training shape, on the stream the step runs on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fasttrain.bn_buffers import BufferEMA, BufferGuard
from fasttrain.data.normalize import normalize_images, pad_channels
from fasttrain.precision import DynamicLossScaler, Precision, grads_not_finite
from fasttrain.schedule import LRSchedule


def classification_loss(
    output, labels: torch.Tensor, label_smoothing: float = 0.0, aux_weight: float = 0.0
) -> torch.Tensor:
    """Cross-entropy in fp32 with label smoothing; Inception's aux logits weighted by aux_weight."""
    if isinstance(output, tuple):
        logits, aux = output
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)
        return loss + aux_weight * F.cross_entropy(aux.float(), labels, label_smoothing=label_smoothing)
    return F.cross_entropy(output.float(), labels, label_smoothing=label_smoothing)


def model_input(images: torch.Tensor, preprocess: str, precision: Precision) -> torch.Tensor:
    """A loader batch (N, H, W, C) as the model's (N, C, H, W) input in the policy's layout.

    uint8 batches (torch pipeline) are normalised here on the device; float batches come normalised
    from DALI, and their NHWC storage already is the channels_last layout: a permute, no copy. With
    precision.stem_channels 4 (--pad_stem) a fourth, zero channel follows the image's three.
    """
    channels = precision.stem_channels
    if not images.is_floating_point():
        return normalize_images(images, preprocess, precision.dtype, precision.channels_last, channels)
    x = images.permute(0, 3, 1, 2)
    if channels != x.shape[1]:
        return pad_channels(x, channels, precision.channels_last)
    return x if precision.channels_last else x.contiguous()


LOSS_AVERAGE_WEIGHT = 0.1  # 1 - decay of the Inception seed's loss_averages (decay 0.9)
# Eager steps on the side stream before the whole step is captured: PyTorch's CUDA-graph notes warm
# up with three iterations (lazy initialisation, cuBLAS/cuDNN workspaces, autograd's streams), and the
# bucketer re-lays the gradient buffer in the backward order it saw in the first one.
GRAPH_WARMUP_STEPS = 3
# The same notes, "Usage with DistributedDataParallel": "your warmup must run at least 11
# DDP-enabled eager iterations before capture".
DDP_GRAPH_WARMUP_STEPS = 11


class TrainStep:
    """Owns the device-side step state: step counter, LR, loss scale, last loss and training top-1,
    non-finite streak."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        optimizer,
        precision: Precision,
        device: torch.device,
        schedule: LRSchedule,
        loss_fn: Callable,
        preprocess: str,
        world_size: int = 1,
        buckets=None,
        ddp_model: torch.nn.Module | None = None,
        bn_ema: BufferEMA | None = None,
        warmup_steps: int | None = None,
        stream: torch.cuda.Stream | None = None,
        compiled=None,
    ):
        """warmup_steps: eager steps before the CUDA-graph capture (default: GRAPH_WARMUP_STEPS, or
        DDP_GRAPH_WARMUP_STEPS with a ddp_model). compiled: the model's CompiledModel (--compile),
        warmed up before the first step."""
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.device, self.schedule, self.loss_fn = device, schedule, loss_fn
        self.preprocess, self.buckets, self.bn_ema = preprocess, buckets, bn_ema
        self.bn_guard = BufferGuard(model)  # a skipped step's forward leaves no trace in the BN statistics
        self.compiled = compiled
        self.forward_model = ddp_model or model
        # torch DDP averages over ranks itself; fasttrain's buckets sum and fold 1/world in here.
        self.world_size = world_size
        self.world_divisor = 1.0 if ddp_model is not None else float(world_size)
        # An eager step (no graph) on one process lets autograd hand its gradients over and copies
        # them into the flat buffer after backward (FlatParameters.release_grads); a captured step
        # keeps the views, which the graph's static addresses and the buckets' hooks need.
        self._release_grads = (
            not precision.cuda_graph and buckets is None and ddp_model is None and world_size == 1
        )
        self.scaler = DynamicLossScaler(device, enabled=precision.loss_scaling)
        self.step_count = torch.zeros((), dtype=torch.int64, device=device)
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.last_loss = torch.zeros((), dtype=torch.float32, device=device)
        self.last_top1 = torch.zeros((), dtype=torch.float32, device=device)  # of the step's batch
        # 1 / (loss scale x world divisor) as the step's gradients were made: the scale is updated at the
        # step's end, so read after it, it is twice this on a growth step (the histograms' unscaling).
        self.last_grad_scale = torch.ones((), dtype=torch.float32, device=device)
        # The Inception seed's smoothed loss curve: tf.train.ExponentialMovingAverage(0.9) of each
        # step's loss, its shadow starting at 0 (no zero-debiasing, the seed's default).
        self.loss_average = torch.zeros((), dtype=torch.float32, device=device)
        # Sums of every step's loss and top-1 since the trainer last read them (it zeroes them at its
        # log steps), added inside the step so the graph captures them: the log window's means.
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.top1_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.nonfinite_streak = torch.zeros((), dtype=torch.int64, device=device)
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        self.flat_grad = optimizer.flat.grad
        if warmup_steps is None:
            warmup_steps = DDP_GRAPH_WARMUP_STEPS if ddp_model is not None else GRAPH_WARMUP_STEPS
        self.warmup_steps = warmup_steps if precision.cuda_graph else 0
        self.eager_steps_done = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._staging: list[_Staging] = []  # per micro-batch: the host copies' device buffers
        # One side stream for the eager warm-up steps and the capture (and, passed in by the trainer,
        # for DDP's construction): autograd's AccumulateGrad nodes remember the stream they first ran
        # on, and whole-step captures that mixed streams failed (Megatron-LM #6021, pytorch #187745).
        self.stream = None
        self.copy_stream = None
        self.timeline = None  # the trainer's, on CUDA: fasttrain.input_stall's events around each step
        if precision.cuda_graph:
            self.stream = stream or torch.cuda.Stream(device)
            self.copy_stream = torch.cuda.Stream(device)

    # --- the step itself -----------------------------------------------------------------------

    def _forward_backward(
        self, images: torch.Tensor, labels: torch.Tensor, inv_accum: float, communicate: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = model_input(images, self.preprocess, self.precision)
        if self.buckets is not None:
            self.buckets.begin(communicate=communicate)
        with self._autocast():
            output = self.forward_model(x)
            loss = self.loss_fn(output, labels)
        if self.world_size > 1:
            # A loss that is not finite on this rank alone (its gradients may be finite: a
            # log-probability of -inf has the gradient softmax - target) must skip the step on every
            # rank, or the others would update and the replicas part. loss * 0 is NaN then and 0
            # otherwise; added to the first gradient element before backward, it travels in the
            # all-reduce (buckets' or DDP's) to every rank's found_inf. No extra communication.
            self.flat_grad[:1].add_(loss.detach().float() * 0.0)
        (loss * (self.scaler.scale * inv_accum)).backward()
        logits = output[0] if isinstance(output, tuple) else output  # Inception: (logits, aux)
        top1 = (logits.detach().argmax(dim=1) == labels).float().mean()
        return loss.detach(), top1

    def _autocast(self):
        # The autocast weight cache must be off for graph capture (PyTorch's CUDA-graph notes). No
        # autocast context at all for fp32: torch.autocast refuses the meta device even disabled, and
        # the step is traced there (tests/test_step_capturable.py).
        if not self.precision.autocast:
            return contextlib.nullcontext()
        return torch.autocast(
            self.device.type, dtype=self.precision.dtype, cache_enabled=not self.precision.cuda_graph
        )

    def _body(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        release = self._release_grads and len(batches) == 1
        if release:
            self.optimizer.flat.release_grads()
        else:
            self.flat_grad.zero_()
        self.bn_guard.save()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        total_top1 = torch.zeros((), dtype=torch.float32, device=self.device)
        ddp = self.forward_model is not self.model
        for i, (images, labels) in enumerate(batches):
            last = i == len(batches) - 1
            if ddp and not last:
                with self.forward_model.no_sync():
                    loss, top1 = self._forward_backward(images, labels, 1.0 / len(batches), False)
            else:
                loss, top1 = self._forward_backward(images, labels, 1.0 / len(batches), last)
            total += loss
            total_top1 += top1
        if self.buckets is not None:
            self.buckets.wait()
        if release:
            self.optimizer.flat.adopt_grads()
        loss = total / len(batches)
        found_inf = grads_not_finite(self.flat_grad, loss)
        self.schedule.on_device(self.step_count, self.lr)
        # Into last_grad_scale itself: the histograms read it, and no copy kernel joins the step.
        grad_scale = torch.reciprocal(self.scaler.scale * self.world_divisor, out=self.last_grad_scale)
        self.optimizer.step(grad_scale=grad_scale, found_inf=found_inf)
        self.bn_guard.restore(found_inf)
        if self.bn_ema is not None:
            self.bn_ema.update(self.optimizer.applied_steps, found_inf)
        self.scaler.update(found_inf)
        self.step_count += 1
        self.nonfinite_streak.add_(1).mul_(found_inf.to(torch.int64))
        self.last_loss.copy_(loss)
        self.last_top1.copy_(total_top1 / len(batches))
        self.loss_sum.add_(self.last_loss)
        self.top1_sum.add_(self.last_top1)
        # TF's update, shadow -= (1 - decay) * (shadow - loss); a non-finite loss (a skipped fp16
        # step) is left out rather than turning the curve into NaN for good.
        average = self.loss_average - (self.loss_average - loss) * LOSS_AVERAGE_WEIGHT
        self.loss_average.copy_(torch.where(torch.isfinite(loss), average, self.loss_average))

    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run one optimizer step over grad_accum micro-batches [(images, labels), ...]."""
        if self.compiled is not None and self.compiled.active and not self.compiled.warmed_up:
            self._compile_now(batches[0])  # once: warmed_up is set then, active cleared on failure
        timeline = self.timeline
        if not self.precision.cuda_graph:
            if timeline is not None:
                timeline.started()
            self._body(
                [
                    (i.to(self.device, non_blocking=True), lb.to(self.device, non_blocking=True))
                    for i, lb in batches
                ]
            )
            if timeline is not None:
                timeline.ended()
            if self.buckets is not None:
                self.buckets.rebuild_from_observed_order()  # once, after the first step; then a no-op
            return
        if self.eager_steps_done < self.warmup_steps:
            self._warmup_step(batches)
        elif self.graph is None:
            self._capture(batches)
        for k, ((static_images, static_labels), (images, labels)) in enumerate(
            zip(self.static_batches, batches)
        ):
            staging = self._staged(k, images, labels) if images.device.type == "cpu" else None
            if staging is not None:
                images, labels = staging.images, staging.labels
            static_images.copy_(images, non_blocking=True)
            static_labels.copy_(labels, non_blocking=True)
            if staging is not None:
                staging.free.record()  # this staging buffer may be refilled from here on
        if self.graph is not None:
            if timeline is not None:  # after the waits for this batch's copy: a late batch is a gap
                timeline.started()
            self.graph.replay()
            if timeline is not None:
                timeline.ended()

    def _staged(self, k: int, images: torch.Tensor, labels: torch.Tensor) -> _Staging:
        """Micro-batch k copied host -> device on the copy stream into its staging buffers; the
        current stream waits for the copy."""
        while len(self._staging) <= k:
            self._staging.append(_Staging(images, labels, self.device))
        staging, copy_stream = self._staging[k], self.copy_stream
        copy_stream.wait_event(staging.free)  # the previous batch has left this buffer
        with torch.cuda.stream(copy_stream):
            staging.images.copy_(images, non_blocking=True)
            staging.labels.copy_(labels, non_blocking=True)
            staging.ready.record()
        torch.cuda.current_stream(self.device).wait_event(staging.ready)
        return staging

    def _compile_now(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Compile (and autotune) the model's regions on a zero batch of the training shape, on the
        stream the steps run on, before any step: never during the graph capture."""
        images, labels = batch
        images = torch.zeros_like(images, device=self.device)
        labels = torch.zeros_like(labels, device=self.device)

        def forward_backward() -> None:
            x = model_input(images, self.preprocess, self.precision)
            with self._autocast():
                loss = self.loss_fn(self.model(x), labels)
            (loss * self.scaler.scale).backward()

        buffers = list(self.model.buffers())  # BN statistics and num_batches_tracked: put back after
        side = self.stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            # The raw model, not DDP's wrapper: its reducer expects no backward outside a DDP forward.
            # The gradients it leaves are zeroed as the first step starts (_body).
            self.compiled.warm_up(forward_backward, buffers)
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)

    # --- CUDA graph ------------------------------------------------------------------------------

    def _warmup_step(self, batches) -> None:
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._body(
                [
                    (i.to(self.device, non_blocking=True), lb.to(self.device, non_blocking=True))
                    for i, lb in batches
                ]
            )
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.eager_steps_done += 1
        if self.buckets is not None and self.eager_steps_done == 1:
            self.buckets.rebuild_from_observed_order()

    def _capture(self, batches) -> None:
        self.static_batches = [
            (torch.empty_like(i, device=self.device), torch.empty_like(lb, device=self.device))
            for i, lb in batches
        ]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)  # note: a one-off host sync, before capture only
        try:
            # thread_local: the DataLoader's pin-memory thread may allocate pinned host memory while
            # this thread captures; the default "global" mode would invalidate the capture for it.
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self._body(self.static_batches)
        except Exception as exc:
            raise RuntimeError(
                f"this training step cannot be captured in a CUDA graph ({exc}); run with cuda_graph=false"
            ) from exc
        self.graph = graph

    def release_graph(self) -> None:
        """Drop the captured graph and its memory. Before leaving a NCCL process group: destroying
        the communicator waits for every graph that captured its collectives to be destroyed first
        (pytorch/pytorch#115388). The next step captures again."""
        if self.graph is not None:
            torch.cuda.synchronize(self.device)  # note: a one-off host sync, after the last replay
            self.graph = None
            self.static_batches = []
            self._staging = []

    # --- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {
            "step_count": self.step_count.clone(),
            "nonfinite_streak": self.nonfinite_streak.clone(),
            "scaler": self.scaler.state_dict(),
            "loss_average": self.loss_average.clone(),
        }
        if self.buckets is not None and self.buckets.order is not None:
            state["bucket_order"] = list(self.buckets.order)  # the flat buffer's layout (buckets.py)
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.buckets is not None and state.get("bucket_order"):
            self.buckets.apply_order(state["bucket_order"])
        self.step_count.copy_(state["step_count"])
        self.nonfinite_streak.copy_(state["nonfinite_streak"])
        self.scaler.load_state_dict(state["scaler"])
        if "loss_average" in state:  # checkpoints written before it existed restart the curve at 0
            self.loss_average.copy_(state["loss_average"])


class _Staging:
    """A micro-batch's device buffers for its host copy, and the events that order their reuse."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, device: torch.device):
        self.images = torch.empty_like(images, device=device)
        self.labels = torch.empty_like(labels, device=device)
        self.ready = torch.cuda.Event()  # the host copy into these buffers is done
        self.free = torch.cuda.Event()  # the step's copy out of them is done
        self.free.record()  # nothing to wait for before the first copy
