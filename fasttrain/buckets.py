"""Gradient buckets: all-reduce slices of the flat gradient buffer while backward is still running.

Layout. `FlatParameters` keeps every gradient in one fp32 buffer `flat.grad`, with
`flat.segments = [(param, offset, numel), ...]` in buffer order and each `param.grad` a view of it.
A bucket is the slice `flat.grad[start:end]` over whole consecutive segments of one parameter group;
the all-reduce runs on that view, so nothing is copied and every address is static (CUDA graphs).
Buckets are cut in buffer order: the first closes once it holds >= first_bucket_mb MiB, each later
one once it holds >= bucket_cap_mb MiB, and a bucket always closes at the end of a group.

Readiness. A post-accumulate-grad hook per parameter counts arrivals; a bucket is complete when each
of its parameters has arrived once. Buckets are launched, `all_reduce(SUM, async_op=True)`, in one
fixed launch order that is the same on every rank: a complete bucket whose predecessors in that order
are not all launched yet is launched by the hook that completes the last of them. Collectives are
matched by their position in each rank's sequence, so this fixed order is what rules out deadlock
(rank a's k-th collective always pairs with rank b's k-th, on the same slice) whatever order the hooks
fire in; no hook ever blocks, so a rank that is ahead only queues work.

Averaging. The reduction is a plain sum, g = sum_r g_r. The optimizer is given
grad_scale = 1 / (loss_scale * world_size) and forms the mean inside its own kernel: no extra pass.

Order. Before the rebuild, buffer order is reverse registration order within each group, roughly the
order backward produces gradients. `rebuild_from_observed_order()` takes the arrival order rank 0
observed in a step, broadcasts it, calls `flat.reorder(order)`, re-cuts the buckets and sets the
launch order to the order in which the buckets' last gradients arrived (buckets of different groups
interleave as they did in backward). Cutting at group ends keeps a group's late gradients out of the
next group's early bucket.

CUDA graphs. Hooks are Python, so they run once, during capture: the begin/launch/wait logic and its
checks run at capture time and the collectives are recorded into the graph. This needs NCCL >= 2.9.6,
one device per process, the communicator created before capture (init_process_group(device_id=...)
or any eager collective does that), every rank capturing the same step, eager warm-up steps on a side
stream before capture, and TORCH_NCCL_BLOCKING_WAIT unset (a blocking wait polls events, which capture
forbids). `async_op=True` puts each collective on the process group's NCCL stream, joined to the
capture by an event from the current stream; `wait()` joins it back, which capture also requires.

Profiling (profile=True, the trainer's --profile_comm): fasttrain/comm_profile.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fasttrain.comm_profile import CommProfiler
from fasttrain.dist_info import DistInfo

_MIB = 1 << 20


class GradSyncError(RuntimeError):
    """The gradients of a step cannot be reduced correctly (a parameter missing or counted twice)."""


def plan_buckets(
    segments: Sequence[tuple[torch.Tensor, int, int]],
    group_ranges: Sequence[tuple[int, int]],
    first_bytes: float,
    cap_bytes: float,
    elem_size: int = 4,
) -> list[tuple[int, int, list[int]]]:
    """Cut segments (in buffer order) into buckets [(start, end, [segment indices]), ...].

    A bucket closes once its parameters hold >= first_bytes (the first bucket) or >= cap_bytes (the
    others), and at the end of each group of group_ranges (element ranges [start, end)). Sizes count
    the parameters' own elements, not the pads between them (flat.py aligns each to 64 bytes), so the
    cuts are DDP's for the same order.
    """

    def group_of(offset: int) -> int:
        for g, (lo, hi) in enumerate(group_ranges):
            if lo <= offset < hi:
                return g
        return -1

    buckets: list[tuple[int, int, list[int]]] = []
    members: list[int] = []
    start = end = size = 0
    group = None
    for i, (_, offset, numel) in enumerate(segments):
        g = group_of(offset)
        if members and g != group:
            buckets.append((start, end, members))
            members = []
        if not members:
            start, group, size = offset, g, 0
        members.append(i)
        end = offset + numel
        size += numel
        if size * elem_size >= (cap_bytes if buckets else first_bytes):
            buckets.append((start, end, members))
            members = []
    if members:
        buckets.append((start, end, members))
    return buckets


class GradBuckets:
    """Bucketed, backward-overlapped SUM all-reduce of `flat.grad` (see the module docstring).

    Per step: `begin(communicate)` before each backward (only the last micro-step of gradient
    accumulation communicates), backward, then `wait()` before the optimizer. After the first step,
    on every rank: `rebuild_from_observed_order()`. With world_size 1 every method is a no-op unless
    `enabled=True` is passed.
    """

    def __init__(
        self,
        flat,
        info: DistInfo,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        group: dist.ProcessGroup | None = None,
        profile: bool = False,
        names: dict[torch.Tensor, str] | None = None,
        enabled: bool | None = None,
    ):
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError(
                f"bucket sizes must be positive, got bucket_cap_mb={bucket_cap_mb}, "
                f"first_bucket_mb={first_bucket_mb}"
            )
        self.flat, self.info, self.group = flat, info, group
        self.bucket_cap_mb, self.first_bucket_mb = bucket_cap_mb, first_bucket_mb
        # enabled=True runs the collectives even on one rank (the single-GPU check of graph capture).
        self.enabled = info.world_size > 1 if enabled is None else enabled
        self.params = [p for p, _, _ in flat.segments]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        names = names or {}
        self._names = [
            names.get(p, f"parameter #{i} of shape {tuple(p.shape)}") for i, p in enumerate(self.params)
        ]
        self._active = False  # between begin(communicate=True) and wait()
        self._rebuilt = False
        self._observing = True  # record arrival order until the rebuild
        self._observed: list[int] = []
        self._last_order: list[int] | None = None
        self._order: list[int] | None = None  # the order the buffer was re-laid in
        self._profiler = CommProfiler(info.device) if profile and self.enabled else None
        self._handles = []
        self._cut()
        if self.enabled:
            self._handles = [
                p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
            ]

    # --- layout ----------------------------------------------------------------------------------

    def _cut(self) -> list[list[int]]:
        """Cut the current layout into buckets, in launch order = buffer order; returns the members."""
        segments = self.flat.segments
        grad = self.flat.grad
        if grad.dim() != 1 or grad.dtype != torch.float32:
            raise ValueError(f"flat.grad must be a 1-D float32 buffer, got {grad.dtype} {tuple(grad.shape)}")
        planned = plan_buckets(
            segments,
            self.flat.group_ranges,
            self.first_bucket_mb * _MIB,
            self.bucket_cap_mb * _MIB,
            grad.element_size(),
        )
        self.bucket_ranges = [(start, end) for start, end, _ in planned]
        self._views = [grad[start:end] for start, end in self.bucket_ranges]  # static views, no copies
        self._bucket_of = [0] * len(self.params)
        for b, (_, _, members) in enumerate(planned):
            for s in members:
                self._bucket_of[self._index[id(segments[s][0])]] = b
        self._sizes = [len(members) for _, _, members in planned]
        self.launch_order = list(range(len(planned)))
        self._grad_ptrs = [grad.data_ptr() + offset * grad.element_size() for _, offset, _ in segments]
        self._check_views()
        self._views_verified = False  # verified again after the first backward into this layout
        return [members for _, _, members in planned]

    def _check_views(self) -> None:
        for (p, _, _), ptr in zip(self.flat.segments, self._grad_ptrs, strict=True):
            if p.grad is None or p.grad.data_ptr() != ptr:
                i = self._index[id(p)]
                raise GradSyncError(
                    f"the gradient of {self._names[i]} is not its view of the flat gradient "
                    "buffer (was .grad set to None or replaced?); zero flat.grad instead"
                )

    # --- per step --------------------------------------------------------------------------------

    def _make_hook(self, i: int):
        def hook(_param: torch.Tensor) -> None:
            if self._active:
                self._arrived(i)

        return hook

    def begin(self, communicate: bool = True) -> None:
        """Call before each backward; communicate=False makes this backward only accumulate."""
        if not self.enabled:
            return
        if self._active:
            raise GradSyncError(
                "GradBuckets.begin() was called again before wait() of the communicating "
                "backward; call wait() after every backward begun with communicate=True"
            )
        if not communicate:
            return
        self._active = True
        self._arrivals = [0] * len(self.params)
        self._pending = list(self._sizes)
        self._next = 0
        self._works: list = []
        self._observed = []
        if self._profiler is not None:
            self._profiler.begin()

    def _arrived(self, i: int) -> None:
        self._arrivals[i] += 1
        if self._observing:
            self._observed.append(i)
        b = self._bucket_of[i]
        self._pending[b] -= 1
        # A count going below zero (a second arrival) never reads as complete again: wait() reports it.
        if self._pending[b] == 0:
            order = self.launch_order
            while self._next < len(order) and self._pending[order[self._next]] == 0:
                self._launch(order[self._next])
                self._next += 1

    def _launch(self, b: int) -> None:
        if self._profiler is not None:
            self._profiler.before_launch()
        work = dist.all_reduce(self._views[b], op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._works.append(work)
        if self._profiler is not None:
            self._profiler.after_launch(work)

    def wait(self) -> None:
        """Wait for every bucket's all-reduce (on CUDA: make the current stream wait, no host sync)."""
        if not self._active:
            return
        self._active = False
        if self._profiler is not None:
            self._profiler.backward_ended()
        if self._next < len(self.launch_order) or any(a != 1 for a in self._arrivals):
            raise self._arrival_error()
        for work in self._works:
            work.wait()
        if self._profiler is not None:
            self._profiler.step_done(self.launch_order)
        if not self._views_verified:
            self._check_views()  # the backward accumulated into the views, not into new tensors
            self._views_verified = True
        if self._observing:
            self._last_order = self._observed

    def _arrival_error(self) -> GradSyncError:
        missing = [self._names[i] for i, a in enumerate(self._arrivals) if a == 0]
        repeated = [f"{self._names[i]} ({a} times)" for i, a in enumerate(self._arrivals) if a > 1]
        parts = []
        if missing:
            parts.append(
                f"the gradients of {len(missing)} parameter(s) never arrived in backward: "
                f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''} (unused in the "
                "forward? freeze them with requires_grad=False before building the flat buffers)"
            )
        if repeated:
            parts.append(
                f"gradients arrived more than once in one backward: {', '.join(repeated[:10])} "
                "(a second backward without begin()? reentrant checkpointing?)"
            )
        return GradSyncError(
            "; ".join(parts) + "; every parameter needs exactly one gradient per communicating backward"
        )

    # --- the one-off rebuild --------------------------------------------------------------------

    def rebuild_from_observed_order(self) -> bool:
        """Re-lay the buffer in rank 0's observed gradient order and re-cut the buckets (once).

        Collective: every rank calls it at the same point, after at least one communicating step and
        before any CUDA graph capture (the gradient addresses change). Returns whether it rebuilt.
        """
        if not self.enabled or self._rebuilt:
            return False
        if self._active:
            raise GradSyncError("rebuild_from_observed_order() was called between begin() and wait()")
        if self._last_order is None:
            raise GradSyncError("rebuild_from_observed_order() needs one completed communicating step first")
        order = torch.tensor(self._last_order, dtype=torch.int64, device=self.info.device)
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(order, src=src, group=self.group)
        self._relay(order.tolist())  # note: a host sync, once per run
        return True

    def apply_order(self, order: list[int]) -> None:
        """Re-lay the buffer in the order a checkpoint holds (`order`), before a resumed run's first
        step: that step then sums its gradients in the layout the uninterrupted run had by then. Every
        rank reads the same checkpoint, so nothing is broadcast. (Without it the first resumed step ran
        in the first-step layout, and with three or more ranks gloo's ring summed in another order:
        a resumed --deterministic run was no longer bit-identical.)"""
        if self.enabled and not self._rebuilt:
            self._relay([int(i) for i in order])

    @property
    def order(self) -> list[int] | None:
        """The order the buffer was re-laid in (what a checkpoint keeps), or None before that."""
        return self._order

    def _relay(self, order_list: list[int]) -> None:
        if sorted(order_list) != list(range(len(self.params))):
            raise GradSyncError(
                "rank 0's gradient order is not a permutation of this rank's parameters; "
                "every rank must build the same model"
            )
        self._order = order_list
        self.flat.reorder([self.params[i] for i in order_list])
        position = {i: k for k, i in enumerate(order_list)}
        segments = self.flat.segments
        last_arrival = [
            max(position[self._index[id(segments[s][0])]] for s in members) for members in self._cut()
        ]
        self.launch_order = sorted(range(len(last_arrival)), key=last_arrival.__getitem__)
        self._rebuilt, self._observing, self._observed = True, False, []
        if self._profiler is not None:
            self._profiler.reset()

    # --- reporting and teardown ------------------------------------------------------------------

    def comm_stats(self) -> dict | None:
        """Profiled all-reduce timings averaged over the steps since the last call (then reset).

        {'steps', 'comm_ms' (busy time per step), 'exposed_ms', 'hidden_fraction',
         'buckets': [{'bucket', 'start', 'end', 'mib', 'ms'}, ...]}; None without profile=True or
        profiled steps. On CUDA this synchronizes the device: call it only when logging.
        """
        if self._profiler is None:
            return None
        stats = self._profiler.collect(len(self.bucket_ranges))
        if stats is not None:
            stats["buckets"] = [
                {"bucket": b, "start": s, "end": e, "mib": (e - s) * 4 / _MIB, "ms": ms}
                for b, ((s, e), ms) in enumerate(zip(self.bucket_ranges, stats["buckets"], strict=True))
            ]
        return stats

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
