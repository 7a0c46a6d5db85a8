"""FusedRMSPropTF and FusedMomentum: torch.optim.Optimizer classes over flat buffers.

Both lay the parameters out in a `FlatParameters` (`.flat`: params become views of one fp32 buffer,
grads views of another) and update each hyperparameter group with one kernel launch that reads w, g
and every state once and writes them once, EMA included. Equations: kernels/rmsprop_tf.py and
kernels/momentum.py (TensorFlow's RMSPropOptimizer and MomentumOptimizer, L2 decay as a loss term,
tf.train.ExponentialMovingAverage with num_updates).

    step(grad_scale=None, found_inf=None)
        g_used = p.grad * grad_scale (+ weight_decay * w); when found_inf != 0 nothing changes, bit
        for bit, including `applied_steps`, the device-side counter that EMA's n is derived from.

lr (`param_groups[i]["lr"]`), grad_scale and found_inf may be 0-d device tensors: the kernels read
them on the device, so `step()` makes no host sync and can be captured in a CUDA graph (a float lr
is baked into a captured graph; hand a tensor and update it in place instead).

Implementation (one dispatch point, `select_impl`): "auto" runs the Triton kernels on CUDA devices
of compute capability >= 7.0 where Triton imports, and "chunked" elsewhere (CPU, P40): the same
update in in-place torch ops over cache-sized chunks (kernels/chunked.py; faster than torch.optim's
foreach RMSprop/SGD + a foreach EMA on the CPU, numbers in the README). "triton" on CPU tensors
needs TRITON_INTERPRET=1 (how the tests run the kernels); "torch" runs the readable multi-pass
reference, the specification both fast paths are tested against.

State: `state_dict()` is per parameter (keys "step", the buffers' names, "ema"), independent of the
flat layout; `optimizer.state` itself stays empty because the state lives in the flat buffers.
"""

import contextlib
import functools

import torch

from fasttrain.flat import FlatParameters
from fasttrain.kernels import chunked
from fasttrain.kernels import momentum as momentum_kernel
from fasttrain.kernels import rmsprop_tf as rmsprop_tf_kernel
from fasttrain.kernels.common import HAVE_TRITON, ema_one_minus_decay, interpreter_enabled

IMPLS = ("auto", "triton", "chunked", "torch")


def select_impl(impl: str, device: torch.device) -> str:
    """ "triton", "chunked" or "torch" for parameters on `device` (the module docstring gives the rule)."""
    if impl not in IMPLS:
        raise ValueError(f"optimizer impl must be one of {IMPLS}, got {impl!r}.")
    if impl in ("chunked", "torch"):
        return impl
    if impl == "triton":
        if not HAVE_TRITON:
            raise RuntimeError("impl='triton' needs the triton package; install it or use impl='torch'.")
        # On the meta device the kernels' custom ops run their fake implementations (tracing).
        if device.type not in ("cuda", "meta") and not interpreter_enabled():
            raise RuntimeError(
                f"impl='triton' with parameters on {device} needs TRITON_INTERPRET=1 (Triton's CPU "
                "interpreter, for tests); use impl='auto' or 'chunked' to run the fast torch path."
            )
        return "triton"
    supported = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (7, 0)
    return "triton" if HAVE_TRITON and supported else "chunked"


class FlatOptimizer(torch.optim.Optimizer):
    """Shared machinery; subclasses set `_state_fills`, `_updates` and `_update_group`."""

    _state_fills: dict[str, float]
    _updates: dict  # impl -> the update function (all take the same arguments)

    def __init__(self, params, defaults: dict, ema_decay: float | None, ema_warmup: bool, impl: str):
        if ema_decay is not None and not 0.0 <= ema_decay <= 1.0:
            raise ValueError(f"ema_decay must be in [0, 1] or None, got {ema_decay}.")
        super().__init__(params, defaults)
        self.flat = FlatParameters(self.param_groups)
        self.impl = select_impl(impl, self.flat.device)
        self._update = self._updates[self.impl]
        if self.impl == "chunked":  # its scratch, allocated once: no allocation per step
            self._update = functools.partial(self._update, scratch=chunked.new_scratch(self.flat.device))
        self.ema_decay = ema_decay
        self.ema_warmup = ema_warmup
        self._buffers = {key: self.flat.new_state(fill) for key, fill in self._state_fills.items()}
        if ema_decay is not None:
            self._buffers["ema"] = self.flat.new_state(0.0)
            self._buffers["ema"].copy_(self.flat.params)  # TF: the shadow starts at the weights
        # (w, g, {state name: buffer}) slices per group; `reorder` keeps group ranges, so they last.
        self._group_slices = [
            None
            if start == end
            else (
                self.flat.params[start:end],
                self.flat.grad[start:end],
                {"ema": None, **{key: buffer[start:end] for key, buffer in self._buffers.items()}},
            )
            for start, end in self.flat.group_ranges
        ]
        # Steps applied so far (skipped ones excluded), on the device so no step reads the host.
        self.applied_steps = torch.zeros((), dtype=torch.int64, device=self.flat.device)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "flat", None) is not None:
            raise RuntimeError(
                f"{type(self).__name__} lays parameters out in flat buffers when it is built: "
                "pass every parameter group to the constructor."
            )
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffer in place. `set_to_none` is ignored: the `.grad` views must
        survive for backward to keep writing into the flat buffer."""
        self.flat.zero_grad()

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        """Apply one update from `p.grad` (see the module docstring for grad_scale and found_inf)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.flat.adopt_grads()
        ema_weight = None
        if "ema" in self._buffers:
            ema_weight = ema_one_minus_decay(self.applied_steps, self.ema_decay, self.ema_warmup)
        for group, slices in zip(self.param_groups, self._group_slices):
            if slices is not None:
                self._update_group(group, *slices, grad_scale, found_inf, ema_weight)
        # add_, not +=: the same in-place update without assigning the attribute, which torch.compile
        # (fullgraph) refused on torch 2.11, the GPU machine's ("setattr on a user-defined object").
        if found_inf is None:
            self.applied_steps.add_(1)
        else:  # 0-d or one element (GradScaler's shape): a (1,) flag broke this after the update
            self.applied_steps.add_((found_inf.reshape(()) == 0).to(torch.int64))
        return loss

    @torch.no_grad()
    def l2_term(self) -> torch.Tensor:
        """The weight decay as the seeds' loss holds it, sum over groups of wd * sum(tf.nn.l2_loss(w)) =
        0.5 * wd * ||w||^2, a device scalar (the update adds its gradient, wd * w; the loss fasttrain
        computes leaves the term out). One dot product per decayed group's slice of the flat weights (the
        pads between parameters are zeros)."""
        total = torch.zeros((), dtype=torch.float32, device=self.flat.params.device)
        for group, slices in zip(self.param_groups, self._group_slices):
            if slices is not None and group["weight_decay"]:
                w = slices[0]
                total += 0.5 * group["weight_decay"] * torch.dot(w, w)
        return total

    def ema_parameters(self, params=None) -> list[torch.Tensor]:
        """The EMA of each of `params` (default: every parameter in `param_groups` order; pass
        `model.parameters()` to match `model.named_parameters()` when groups regroup them). Views,
        valid until `flat.reorder`."""
        return self.flat.views(self._ema_buffer(), params)

    @contextlib.contextmanager
    def swap_ema(self):
        """Within the block the parameters hold their EMA (for evaluation); restored on exit. Only
        parameters: the trainer swaps BN running statistics itself."""
        ema = self._ema_buffer()
        self._swap(ema)
        try:
            yield
        finally:
            self._swap(ema)

    def state_dict(self) -> dict:
        state_dict = super().state_dict()  # param_groups; `self.state` is empty
        views = {key: self.flat.views(buffer) for key, buffer in self._buffers.items()}
        state_dict["state"] = {
            i: {"step": self.applied_steps.clone(), **{key: v[i].clone() for key, v in views.items()}}
            for i in range(len(self.flat.registration_order))
        }
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        # Before anything changes: torch's loader replaces each group's settings with the saved ones,
        # so a momentum optimizer fed an RMSProp checkpoint would lose "nesterov" and fail mid-step.
        for i, (ours, saved) in enumerate(zip(self.param_groups, state_dict.get("param_groups", []))):
            if missing := sorted(set(ours) - set(saved) - {"params"}):
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: parameter group {i} has no {missing}; the "
                    "checkpoint was saved with other optimizer settings (optimizer kind): match them or "
                    "start the optimizer afresh."
                )
        old_lrs = [group["lr"] for group in self.param_groups]
        # The settings this optimizer was built with (the run's flags) stay: a checkpoint carries the
        # state, not the hyperparameters, as TF's Saver restores variables into the graph the flags built
        # (a resume with another --weight_decay was noted as changed, then trained with the old value).
        built = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in self.param_groups]
        super().load_state_dict(state_dict)  # checks group sizes, moves tensors to the params' device
        for group, settings in zip(self.param_groups, built):
            group.update(settings)
        for group, old_lr in zip(self.param_groups, old_lrs):
            if isinstance(old_lr, torch.Tensor):
                # Keep the caller's lr tensor (a captured CUDA graph reads its address).
                # copy_, not fill_: fill_ takes a 0-d value only, and a one-element lr broke a round trip
                saved_lr = torch.as_tensor(group["lr"], dtype=old_lr.dtype)
                group["lr"] = old_lr.copy_(saved_lr.reshape(old_lr.shape))
            elif isinstance(group["lr"], torch.Tensor):
                group["lr"] = group["lr"].to(self.flat.device)
        views = {key: self.flat.views(buffer) for key, buffer in self._buffers.items()}
        for i, p in enumerate(self.flat.registration_order):
            saved = self.state.get(p, {})
            for key in ("step", *views):
                if key not in saved:
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: no {key!r} for parameter {i} "
                        f"{tuple(p.shape)}; the checkpoint was saved with other optimizer settings "
                        "(optimizer kind or EMA on/off): match them or start the optimizer afresh."
                    )
            for key, v in views.items():
                # copy_ broadcasts: a scalar or a smaller tensor in a foreign file filled the whole
                # state without a word.
                value = saved[key]
                if not isinstance(value, torch.Tensor) or value.shape != v[i].shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: {key!r} of parameter {i} is {got}, not "
                        f"{tuple(v[i].shape)}; the checkpoint was saved for another model"
                    )
                v[i].copy_(value)
        if self.flat.registration_order:
            self.applied_steps.copy_(self.state[self.flat.registration_order[0]]["step"])
        self.state.clear()

    def _ema_buffer(self) -> torch.Tensor:
        if "ema" not in self._buffers:
            raise RuntimeError(f"{type(self).__name__} was built with ema_decay=None: there is no EMA.")
        return self._buffers["ema"]

    @torch.no_grad()
    def _swap(self, other: torch.Tensor) -> None:
        held = self.flat.params.clone()
        self.flat.params.copy_(other)
        other.copy_(held)

    def _update_group(self, group, w, g, buffers, grad_scale, found_inf, ema_weight) -> None:
        raise NotImplementedError


class FusedRMSPropTF(FlatOptimizer):
    """TensorFlow's RMSPropOptimizer (ms starts at ones, eps inside the sqrt, lr inside the momentum)
    with L2 weight decay and an EMA of the weights, one fused pass per group.
    State names: "square_avg" (ms), "momentum_buffer" (mom), "ema"."""

    _state_fills = {"square_avg": 1.0, "momentum_buffer": 0.0}
    _updates = {
        "triton": rmsprop_tf_kernel.rmsprop_tf_update,
        "chunked": chunked.rmsprop_tf_update_chunked,
        "torch": rmsprop_tf_kernel.rmsprop_tf_update_reference,
    }

    def __init__(
        self,
        params,
        lr=0.1,
        decay: float = 0.9,
        momentum: float = 0.9,
        eps: float = 1.0,
        weight_decay: float = 0.0,
        ema_decay: float | None = 0.9999,
        ema_warmup: bool = True,
        impl: str = "auto",
    ):
        _check_hyperparameters(lr=lr, momentum=momentum, weight_decay=weight_decay, eps=eps)
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"RMSProp decay must be in [0, 1], got {decay}.")
        defaults = dict(lr=lr, decay=decay, momentum=momentum, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, ema_decay, ema_warmup, impl)

    def _update_group(self, group, w, g, buffers, grad_scale, found_inf, ema_weight) -> None:
        self._update(
            w, g, buffers["square_avg"], buffers["momentum_buffer"], buffers["ema"],
            lr=group["lr"], decay=group["decay"], momentum=group["momentum"], eps=group["eps"],
            weight_decay=group["weight_decay"], grad_scale=grad_scale, found_inf=found_inf,
            ema_weight=ema_weight,
        )  # fmt: skip


class FusedMomentum(FlatOptimizer):
    """TensorFlow's MomentumOptimizer (= torch.optim.SGD with dampening 0, optional Nesterov) with L2
    weight decay and an optional EMA of the weights, one fused pass per group.
    State names: "momentum_buffer", "ema"."""

    _state_fills = {"momentum_buffer": 0.0}
    _updates = {
        "triton": momentum_kernel.momentum_update,
        "chunked": chunked.momentum_update_chunked,
        "torch": momentum_kernel.momentum_update_reference,
    }

    def __init__(
        self,
        params,
        lr,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        ema_decay: float | None = None,
        ema_warmup: bool = True,
        impl: str = "auto",
    ):
        _check_hyperparameters(lr=lr, momentum=momentum, weight_decay=weight_decay)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
        super().__init__(params, defaults, ema_decay, ema_warmup, impl)

    def _update_group(self, group, w, g, buffers, grad_scale, found_inf, ema_weight) -> None:
        self._update(
            w, g, buffers["momentum_buffer"], buffers["ema"],
            lr=group["lr"], momentum=group["momentum"], nesterov=group["nesterov"],
            weight_decay=group["weight_decay"], grad_scale=grad_scale, found_inf=found_inf,
            ema_weight=ema_weight,
        )  # fmt: skip


def _check_hyperparameters(**values) -> None:
    for name, value in values.items():
        # A tensor lr is checked by whoever fills it; reading it here would sync with the device.
        if not isinstance(value, torch.Tensor) and not value >= 0.0:
            raise ValueError(f"optimizer {name} must be >= 0, got {value}.")
