"""Flat fp32 buffers for parameters, gradients and optimizer state.

Layout (one 1-D buffer per kind, all with the same layout):

    [ group 0 | pad | group 1 | pad | ... ]      groups in order, each starting at a multiple of
                                                 ALIGN elements (128 B) so kernels and NCCL see
                                                 aligned slices; the pad stays 0 (or the state fill)
    group i = p_k pad ... p_1 pad p_0 pad        its parameters in REVERSE registration order, an
                                                 estimate of the order gradients become ready in
                                                 backward (`reorder` installs the observed order),
                                                 each starting at a multiple of SEGMENT_ALIGN
                                                 elements (64 B)

Why every parameter starts on 64 bytes: cuDNN and cuBLAS pick vectorised engines by the address of
each operand, and one odd-length tensor (the 1001-class fc.bias) first in a packed buffer left every
later view only 4-byte aligned. On an H200 (cuDNN 9.19, torch 2.11) fp32 convolutions on such views
failed with "misaligned address" / CUDNN_STATUS_EXECUTION_FAILED (bench/results/2026-11-27-h200-*);
aligned, they get the same engines as ordinary tensors. The padding costs at most 15 elements per
parameter (2.4 kB for ResNet-50's 161).

Each parameter occupies `numel` consecutive elements holding its memory layout as it was (a
channels_last conv weight stays channels_last): `p.data` becomes a view of `params` with the
parameter's own strides, and `p.grad` a view of `grad` with the same strides, so autograd, which
accumulates in place into an existing `.grad` (`grad += new_grad` when not building a graph), writes
straight into the flat buffer and a channels_last gradient is never copied. Gradients are therefore
accumulated, never stolen: call `zero_grad()` (in place; the views survive) before each backward.
The one exception is the eager one-process step (fasttrain/step.py): `release_grads()` sets every
`p.grad` to None before its backward, so autograd hands its gradients over without an accumulate
kernel per parameter, and `adopt_grads()` copies them in with a few foreach kernels after it (one
more gradient's worth of memory until then).

Every address is fixed for the lifetime of the object (`reorder` permutes data in place), which is
what CUDA graph replay and the NCCL bucket views need.
"""

import torch

ALIGN = 32  # elements; 128 bytes of fp32: where each group starts
SEGMENT_ALIGN = 16  # elements; 64 bytes of fp32: where each parameter starts


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class FlatParameters:
    """Parameters of torch.optim-style `param_groups` (dicts with a "params" list) moved into flat
    buffers. Attributes: `params` and `grad` (1-D fp32 buffers), `segments` [(param, offset, numel)]
    in buffer order, `group_ranges` [(start, end)] per group."""

    def __init__(self, param_groups: list[dict]):
        groups = [list(group["params"]) for group in param_groups]
        self.registration_order: list[torch.Tensor] = [p for ps in groups for p in ps]
        _check_params(self.registration_order)
        self.device = self.registration_order[0].device if self.registration_order else torch.device("cpu")
        self._group_of = {id(p): i for i, ps in enumerate(groups) for p in ps}
        # Strides each parameter keeps (a dense layout: its own, or the one empty_like would pick).
        self._strides = {id(p): torch.empty_like(p, device="meta").stride() for p in self.registration_order}

        self.group_ranges: list[tuple[int, int]] = []
        self.segments: list[tuple[torch.Tensor, int, int]] = []
        offset = 0
        for ps in groups:
            offset = _round_up(offset, ALIGN)
            start = offset
            for p in reversed(ps):
                self.segments.append((p, offset, p.numel()))
                offset = _round_up(offset + p.numel(), SEGMENT_ALIGN)
            self.group_ranges.append((start, offset))
        total = _round_up(offset, ALIGN)

        self.params = torch.zeros(total, dtype=torch.float32, device=self.device)
        self.grad = torch.zeros(total, dtype=torch.float32, device=self.device)
        self._states: list[tuple[torch.Tensor, float]] = []  # (buffer, what its pads hold)
        for p, offset, _ in self.segments:
            view = self._view(self.params, p, offset)
            view.copy_(p.detach())
            if p.grad is not None:
                self._view(self.grad, p, offset).copy_(p.grad)
            p.data = view
        self._grad_views: dict[int, torch.Tensor] = {}
        self._point_grads()

    def new_state(self, fill: float) -> torch.Tensor:
        """A 1-D fp32 buffer of this layout filled with `fill`, kept in step by `reorder`."""
        state = torch.full_like(self.params, fill)
        self._states.append((state, fill))
        return state

    def views(self, buffer: torch.Tensor, params: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Per-parameter views of a buffer of this layout, each with its parameter's shape and
        strides, for `params` (default: registration order, group by group as the params were
        listed). Valid until the next `reorder`."""
        offsets = {id(p): offset for p, offset, _ in self.segments}
        params = self.registration_order if params is None else list(params)
        for p in params:
            if id(p) not in offsets:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is not in these flat buffers.")
        return [self._view(buffer, p, offsets[id(p)]) for p in params]

    def zero_grad(self) -> None:
        """Zero every gradient in place (one fill of the grad buffer); the `.grad` views survive."""
        self.grad.zero_()
        for p, _, _ in self.segments:
            view = self._grad_views[id(p)]
            if p.grad is not view:  # someone set it to None or to another tensor
                p.grad = view

    def adopt_grads(self) -> None:
        """Make every `p.grad` the flat view again: gradients someone assigned as fresh tensors (or
        that autograd created after `p.grad = None`, see `release_grads`) are copied in, missing ones
        count as zero; a few foreach kernels for all of them, not one per parameter."""
        targets, sources, zeros = [], [], []
        for p, _, _ in self.segments:
            view = self._grad_views[id(p)]
            grad = p.grad
            if grad is view:  # the usual case, decided without reading addresses (torch.compile traces it)
                continue
            if grad is None:
                zeros.append(view)
            elif grad.data_ptr() != view.data_ptr() or grad.stride() != view.stride():
                targets.append(view)
                sources.append(grad)
            else:
                continue
            p.grad = view
        if zeros:
            torch._foreach_zero_(zeros)
        if targets:
            torch._foreach_copy_(targets, sources)

    def release_grads(self) -> None:
        """`p.grad = None` for every parameter, so that the next backward hands autograd's gradient
        tensors over as they are instead of adding each into its flat view (a kernel per parameter:
        314 a step for ResNet-101 v2, each a launch on a GPU); `adopt_grads` then copies them in. Only
        where nothing reads the views during backward (no gradient buckets, no DDP) and one backward
        fills them (no gradient accumulation). Autograd's gradients then live until adopt_grads: one
        more gradient's worth of memory at the end of backward (ResNet-50: 102 MB)."""
        for p, _, _ in self.segments:
            p.grad = None

    def reorder(self, params_in_ready_order: list[torch.Tensor]) -> None:
        """Lay parameters out within each group in the given order (those not listed follow, in
        their current order); groups keep their ranges. Moves the data of `params`, `grad` and every
        state buffer in place and re-points `p.data` and `p.grad`. Not during CUDA graph capture."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FlatParameters.reorder moves buffers: call it before CUDA graph capture.")
        rank = {}
        for p in params_in_ready_order:
            if id(p) not in self._group_of:
                raise ValueError(f"reorder: a parameter of shape {tuple(p.shape)} is not in these buffers.")
            if id(p) in rank:
                raise ValueError(f"reorder: a parameter of shape {tuple(p.shape)} is listed twice.")
            rank[id(p)] = len(rank)
        old_segments = self.segments
        current = {id(p): i for i, (p, _, _) in enumerate(old_segments)}
        new_segments = []
        for group, (start, _) in enumerate(self.group_ranges):
            members = [p for p, _, _ in old_segments if self._group_of[id(p)] == group]
            # Listed ones first in the given order, then the others in their current order.
            members.sort(key=lambda p: (0, rank[id(p)]) if id(p) in rank else (1, current[id(p)]))
            offset = start
            for p in members:
                new_segments.append((p, offset, p.numel()))
                offset = _round_up(offset + p.numel(), SEGMENT_ALIGN)
        old_offset = {id(p): offset for p, offset, _ in old_segments}
        for buffer, pad in ((self.params, 0.0), (self.grad, 0.0), *self._states):
            old = buffer.clone()
            buffer.fill_(pad)  # pads hold their fill, never a moved parameter's old values
            for p, offset, numel in new_segments:
                buffer[offset : offset + numel].copy_(old[old_offset[id(p)] : old_offset[id(p)] + numel])
        self.segments = new_segments
        for p, offset, _ in self.segments:
            p.data = self._view(self.params, p, offset)
        self._point_grads()

    def _point_grads(self) -> None:
        self._grad_views = {id(p): self._view(self.grad, p, offset) for p, offset, _ in self.segments}
        for p, _, _ in self.segments:
            p.grad = self._grad_views[id(p)]

    def _view(self, buffer: torch.Tensor, p: torch.Tensor, offset: int) -> torch.Tensor:
        return buffer.as_strided(p.shape, self._strides[id(p)], buffer.storage_offset() + offset)


def _check_params(params: list[torch.Tensor]) -> None:
    seen = set()
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"FlatParameters: parameter {i} is a {type(p).__name__}, not a tensor.")
        if p.dtype != torch.float32:
            raise ValueError(
                f"FlatParameters: parameter {i} {tuple(p.shape)} is {p.dtype}; keep parameters fp32 "
                "(use autocast for lower precision) and build the optimizer before any conversion."
            )
        if p.device != params[0].device:
            raise ValueError(
                f"FlatParameters: parameter {i} is on {p.device}, parameter 0 on {params[0].device}."
            )
        if id(p) in seen:
            raise ValueError(f"FlatParameters: parameter {i} {tuple(p.shape)} appears twice.")
        if not p.requires_grad:
            # Its missing gradient would count as zero: weight decay, momentum and the EMA would move a
            # frozen parameter, where torch.optim and TF's apply_gradients leave it alone.
            raise ValueError(
                f"FlatParameters: parameter {i} {tuple(p.shape)} has requires_grad=False; leave frozen "
                "parameters out of the optimizer's groups (fasttrain.models.param_groups does)."
            )
        seen.add(id(p))
