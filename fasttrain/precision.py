"""Precision policy per device class, and dynamic loss scaling that never reads the device.

Policy (DESIGN.md): Pascal (sm_6x): fp32; Volta/Turing (sm_7x): fp16 with dynamic loss scaling;
Ampere and later (sm_80+): bf16; CPU: fp32. channels_last by default wherever tensor cores exist
(sm_70+), off on the CPU and Pascal. CUDA graphs on by default on CUDA.

Loss scaling (fp16 only) follows torch.amp.GradScaler's state machine, kept entirely on the device:
  found_inf = any(!isfinite(grad))        # one read of the flat gradient buffer
  if found_inf: scale *= 0.5, growth_tracker = 0, the optimizer step is skipped (the kernel's flag)
  else: growth_tracker += 1; if growth_tracker == 2000: scale *= 2, growth_tracker = 0
The unscale itself is folded into the optimizer kernel's grad multiplier (1 / scale / world_size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fasttrain.config import Config
from fasttrain.errors import SettingError

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    name: str
    """fp32, fp16 or bf16."""
    channels_last: bool
    """NHWC activations and weights."""
    cuda_graph: bool
    """Capture the whole step in a CUDA graph."""
    stem_channels: int = 3
    """Channels of the model's input: 4 with --pad_stem (a zero one after the image's 3;
    fasttrain.models.stem)."""

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def autocast(self) -> bool:
        return self.name != "fp32"

    @property
    def loss_scaling(self) -> bool:
        return self.name == "fp16"


def default_precision(device: torch.device) -> str:
    if device.type != "cuda":
        return "fp32"
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 8:
        return "bf16"
    return "fp16" if major == 7 else "fp32"


def resolve_precision(cfg: Config, device: torch.device) -> Precision:
    """The policy for this device, with --precision / --channels_last / --cuda_graph overrides."""
    name = default_precision(device) if cfg.precision == "auto" else cfg.precision
    tensor_cores = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 7
    channels_last = tensor_cores if cfg.channels_last is None else cfg.channels_last
    graph = device.type == "cuda" if cfg.cuda_graph is None else cfg.cuda_graph
    if graph and device.type != "cuda":
        raise SettingError(
            "cuda_graph needs a CUDA device; leave it unset or pass cuda_graph=false",
            settings=("cuda_graph",),
        )
    if name == "fp16" and device.type == "cpu":
        raise SettingError(
            "precision=fp16 is for CUDA devices; use bf16 or fp32 on the CPU", settings=("precision",)
        )
    # --pad_stem is off unless asked for. It was on by default for CUDA with bf16 and channels_last,
    # from ResNet-50's conv1 alone (batch 256, H200: 6.147 ms forward and backward with 3 channels,
    # 4.705 ms with 4), but that backward computed the input's gradient, which a training step never
    # does; in the whole step on an H200 the 4-channel stem gained nothing (ResNet-50 bf16 batch 256
    # 6,705 img/s padded, 6,708 not; ResNet-101 v2 bf16 batch 32 2,637 and 2,639; the same conv1
    # forward kernel either way: bench/results/2026-11-28-h200-third-run).
    stem_channels = 4 if cfg.pad_stem else 3
    return Precision(name=name, channels_last=channels_last, cuda_graph=graph, stem_channels=stem_channels)


class DynamicLossScaler:
    """GradScaler's scale/growth state machine on the device, with no host synchronisation.

    Disabled (fp32/bf16) it keeps scale 1 and never changes it.
    """

    def __init__(
        self,
        device: torch.device,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.enabled = enabled
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.scale = torch.full((), init_scale if enabled else 1.0, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, found_inf: torch.Tensor) -> None:
        """found_inf: 0-d float32 (1.0 when this step's gradients were not finite)."""
        self.skipped_steps += found_inf.to(torch.int64)
        if self.enabled:
            torch._amp_update_scale_(
                self.scale,
                self.growth_tracker,
                found_inf,
                self.growth_factor,
                self.backoff_factor,
                self.growth_interval,
            )

    def state_dict(self) -> dict:
        return {
            "enabled": self.enabled,
            "scale": self.scale.clone(),
            "growth_tracker": self.growth_tracker.clone(),
            "skipped_steps": self.skipped_steps.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """The saved scale and growth count where the saved scaler scaled as this one does; across a
        change of precision (a bf16 run resumed on a GPU where auto picks fp16) this one keeps its
        own: a bf16 run's scale of 1 loaded into fp16 lost small gradients to underflow for the 32,000
        steps growth takes back to 2^16 (torch's GradScaler refuses a disabled one's state)."""
        saved_enabled = state.get("enabled")
        if saved_enabled is None:  # written before the flag: a disabled scaler is at 1 with tracker 0
            # note: host reads, once at resume
            saved_enabled = not (float(state["scale"]) == 1.0 and int(state["growth_tracker"]) == 0)
        if saved_enabled == self.enabled:
            self.scale.copy_(state["scale"])
            self.growth_tracker.copy_(state["growth_tracker"])
        self.skipped_steps.copy_(state["skipped_steps"])


def grads_not_finite(flat_grad: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """1.0 (0-d float32 on the device) when the loss or any gradient is inf/NaN, else 0.0.

    One read of the gradient buffer; no host sync. The loss is checked too so that fp32/bf16 runs
    skip a non-finite step rather than write NaNs into the weights.
    """
    bad = torch.logical_not(torch.isfinite(flat_grad).all()) | torch.logical_not(torch.isfinite(loss))
    return bad.to(torch.float32)
