"""A model's BatchNorm running statistics, as the training step keeps them.

- `BufferGuard`: a step whose update is skipped (found_inf: a non-finite loss or gradient) leaves the
  statistics (and every other buffer: the update counts) as they were before it, as it leaves the
  weights, the optimizer state and the EMAs. Its forward pass had updated them already, with
  non-finite values when the loss was not finite; from then on every evaluation read NaN, and so did
  the checkpoints, in a run that trained on.
- `BufferEMA`: the Inception seed's ExponentialMovingAverage of moving_mean / moving_variance,
  shadow -= (1 - d) * (shadow - buffer), d = min(decay, (1 + n) / (10 + n)), n = applied steps.

Both work on flat copies of the model's buffers (one per dtype), gathered by one torch.cat each: a
few kernels a step whatever the number of BN layers (a kernel per buffer was about 100 launches a step
for ResNet-50, each a few microseconds of a replayed graph). The buffers themselves stay the module's
own tensors: views into one flat tensor would be aliased inputs to a compiled region that mutates them.

- `broadcast_statistics`: rank 0's statistics and BN-EMA shadows on every rank, before an evaluation.
"""

from __future__ import annotations

import torch


def float_buffers(model: torch.nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The names and tensors of the model's floating-point buffers (BN's running_mean and running_var;
    not num_batches_tracked)."""
    named = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
    return [n for n, _ in named], [b for _, b in named]


def _flat_like(buffers: list[torch.Tensor]) -> torch.Tensor:
    """An fp32 tensor with room for every buffer (empty when there is none)."""
    device = buffers[0].device if buffers else torch.device("cpu")
    return torch.zeros(sum(b.numel() for b in buffers), dtype=torch.float32, device=device)


def _flat_views(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each buffer as a 1-D view of its own storage, made once: a step that made them anew did two
    view ops per buffer (about 1,600 host-side ops a step for ResNet-101, which the eager step,
    without a graph, pays for on every step). They stay valid as long as the module keeps its buffer
    tensors, which fasttrain only ever updates in place (as `self.buffers` assumes too)."""
    return [b.detach().view(-1) for b in buffers]


def _gather(views: list[torch.Tensor], out: torch.Tensor) -> None:
    torch.cat([v if v.dtype == torch.float32 else v.float() for v in views], out=out)


def _views(flat: torch.Tensor, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    parts = flat.split([b.numel() for b in buffers])
    return [part.view(b.shape) for part, b in zip(parts, buffers)]


class _SavedBuffers:
    """One flat copy of buffers of one dtype: save() before a step, restore(found_inf) after it."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers
        self._flat = _flat_views(buffers)
        total, device = sum(b.numel() for b in buffers), buffers[0].device
        self.saved = torch.zeros(total, dtype=buffers[0].dtype, device=device)
        self.current = torch.zeros_like(self.saved)
        self._current_views = _views(self.current, buffers)

    def save(self) -> None:
        torch.cat(self._flat, out=self.saved)

    def restore(self, found_inf: torch.Tensor) -> None:
        torch.cat(self._flat, out=self.current)
        # where, not lerp: 0 * NaN is NaN, so a blend with weight 0 would keep the step's NaN.
        self.current.copy_(torch.where(found_inf.bool(), self.saved, self.current))
        torch._foreach_copy_(self.buffers, self._current_views)


class BufferGuard:
    """save() before a step's forward, restore(found_inf) once found_inf is known: on a skipped step
    every buffer gets back the value save() read (device-side, no host sync, graph-capturable). Every
    buffer, not only the statistics: the Inception seed's BN (models/inception_v3.SlimBatchNorm) counts
    its updates in num_batches_tracked, TF's zero-debias local_step, and a statistic put back beside a
    count left one ahead would be debiased wrong for thousands of steps."""

    def __init__(self, model: torch.nn.Module):
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in model.buffers():
            by_dtype.setdefault(b.dtype, []).append(b)
        self.parts = [_SavedBuffers(buffers) for buffers in by_dtype.values()]

    def save(self) -> None:
        for part in self.parts:
            part.save()

    def restore(self, found_inf: torch.Tensor) -> None:
        for part in self.parts:
            part.restore(found_inf)


class BufferEMA:
    """EMA of BatchNorm running statistics, the seed's averaging of moving_mean/moving_variance.

    shadow -= (1 - d) * (shadow - buffer), d = min(decay, (1 + n) / (10 + n)), n = applied steps;
    a skipped step (found_inf) leaves the shadows as they were. `shadows` are views into one flat
    tensor, in the order of `names`.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.names, self.buffers = float_buffers(model)
        self._buffer_views = _flat_views(self.buffers)
        self.flat = _flat_like(self.buffers)
        if self.buffers:
            _gather(self._buffer_views, self.flat)
        self.shadows = _views(self.flat, self.buffers)
        self._current = torch.zeros_like(self.flat)

    def update(self, applied_steps: torch.Tensor, found_inf: torch.Tensor) -> None:
        if not self.buffers:
            return
        n = applied_steps.to(torch.float32)
        d = torch.clamp((1 + n) / (10 + n), max=self.decay)
        _gather(self._buffer_views, self._current)
        averaged = self.flat.lerp(self._current, 1 - d)
        self.flat.copy_(torch.where(found_inf.bool(), self.flat, averaged))  # where: see BufferGuard

    def swap(self) -> None:
        """Exchange shadows and live buffers (call twice to undo)."""
        for shadow, buf in zip(self.shadows, self.buffers):
            tmp = buf.clone()
            buf.copy_(shadow)
            shadow.copy_(tmp)

    def state_dict(self) -> dict:
        return {name: shadow.clone() for name, shadow in zip(self.names, self.shadows)}

    def load_state_dict(self, state: dict) -> None:
        for name, shadow in zip(self.names, self.shadows):
            shadow.copy_(state[name])


def broadcast_statistics(model: torch.nn.Module, bn_ema: BufferEMA | None) -> None:
    """Rank 0's BN running statistics and BN-EMA shadows copied into every rank's, in place (one
    broadcast). Each rank's differ (training normalises with batch statistics, so training does not read
    them), and a checkpoint keeps rank 0's: an evaluation with each rank's own scored its shard with
    another model than the checkpoint's (2 ranks, 12 steps: EMA top-1 0.540, the checkpoint 0.500)."""
    _, buffers = float_buffers(model)
    if not buffers:
        return
    own = _flat_like(buffers)
    _gather(_flat_views(buffers), own)
    shadows = bn_ema.flat if bn_ema is not None and bn_ema.buffers else own[:0]
    flat = torch.cat([own, shadows])  # (statistics + shadows,) fp32
    torch.distributed.broadcast(flat, src=0)
    own_part, shadow_part = flat.split([own.numel(), shadows.numel()])
    torch._foreach_copy_(buffers, _views(own_part, buffers))
    shadows.copy_(shadow_part)
