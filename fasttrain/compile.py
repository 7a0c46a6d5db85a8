"""The model compiled by inductor inside fasttrain's step (--compile): which regions, when, and the fallback.

Regions. Each residual block (ResNet v1.5 BasicBlock / Bottleneck, the seed's v2 PreActBasicBlock /
PreActBottleneck) and each Inception v3 block (Mixed_5b ... Mixed_7c, the aux head and the stem's
conv + BN + ReLU layers) is compiled on its own with `nn.Module.compile`; the stems' layers that end in
a max pool are compiled with it as methods of the model (torch.compile): ResNet v1.5's `stem` (conv1,
BN, ReLU, max pool over the largest activations of the net: 64 x 112 x 112 per image), the seed's v2
`stem` (conv1 and the SAME max pool: the padding fused into the pool), Inception v3's `conv_pool1` and
`conv_pool2` (the conv + BN + ReLU before each stem max pool: ATen's max pool and its backward took
5 ms of a 34 ms step at batch 128 on an H200 while the rest was compiled). What lies between them (the
heads) stays eager. Why regions and not one graph of the whole model:
  - gradients reach the buckets while backward runs. A compiled backward hands its parameters'
    gradients to autograd's AccumulateGrad nodes only when it ends; for one whole-model graph that is
    the end of backward, and every all-reduce would start after it (torch's DDPOptimizer splits a
    whole-model graph at bucket boundaries for this reason). With a graph per block, each block's
    gradients land, and fasttrain's bucket hooks fire, as that block's backward ends: the overlap of
    the eager step, at block granularity (tests/test_compile.py measures it on gloo).
  - compile time: identical blocks share one compiled graph (ResNet-50's 16 bottlenecks need 8).
  - inside the whole-step CUDA graph the eager ops between regions cost no launch time; what inductor
    adds is the fusion of the memory-bound passes (BatchNorm statistics and apply, ReLU, the residual
    add, and their backward) within each block.
Mode: inductor's "default" or "max-autotune-no-cudagraphs"; the modes with CUDA graphs of their own are
refused (config.py): fasttrain captures the whole step, forward, backward, all-reduce and optimizer.

When. `CompiledModel.warm_up` runs one forward and backward of a zero batch of the training shape
before the first step, so every region is compiled (and, in max-autotune, autotuned) then, never
during the CUDA-graph capture; BatchNorm statistics, gradients and the RNG states are put back after
it, so the run trains exactly as if it had not happened. Where inductor cannot compile (no C++
compiler on a CPU, a GPU older than sm_70, a failure inside inductor) the regions go back to eager
and the run says why in one line.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from fasttrain.models.inception_v3 import (
    BasicConv2d,
    Inception3,
    InceptionA,
    InceptionAux,
    InceptionB,
    InceptionC,
    InceptionD,
    InceptionE,
)
from fasttrain.models.resnet import BasicBlock, Bottleneck, ResNet
from fasttrain.models.resnet_v2 import PreActBasicBlock, PreActBottleneck, ResNetV2

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
_BLOCKS = (
    BasicBlock, Bottleneck, PreActBasicBlock, PreActBottleneck,
    InceptionA, InceptionB, InceptionC, InceptionD, InceptionE, InceptionAux,
)  # fmt: skip
# Inception v3's stem layers followed by a max pool: compiled with the pool, as the model's methods.
_INCEPTION_CONV_POOLS = {"Conv2d_2b_3x3": "conv_pool1", "Conv2d_4a_3x3": "conv_pool2"}
# Graphs dynamo may keep per block class: ResNet-50's bottlenecks come in 8 shapes, and evaluation
# (eval mode, no grad) adds as many again; past the limit dynamo would run the block eagerly, silently.
_RECOMPILE_LIMIT = 64


def compile_regions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every region `model` is compiled in, in forward order: (name, model) stands
    for the model's method `name` (ResNet v1.5's stem), the others are modules (in registration order)."""
    regions = [("stem", model)] if isinstance(model, (ResNet, ResNetV2)) else []
    for name, module in model.named_modules():
        if isinstance(model, Inception3) and isinstance(module, BasicConv2d) and "." not in name:
            method = _INCEPTION_CONV_POOLS.get(name)
            regions.append((method, model) if method else (name, module))
        elif isinstance(module, _BLOCKS):
            regions.append((name, module))
    return regions


def why_not_compiled(device: torch.device) -> str | None:
    """Why inductor cannot compile for this device, or None."""
    if device.type == "meta":
        return "the meta device runs nothing (the step is traced there uncompiled)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (7, 0):
        return "inductor's Triton kernels need a GPU of compute capability 7.0 or newer"
    return None


def compile_wanted(
    compile_flag: bool | None, device: torch.device, deterministic: bool = False, bn_kernels: str = "torch"
) -> bool:
    """--compile as set, else its default: on for CUDA, where the regions inside the whole-step graph
    measured 1.09-1.40x the graph without them (bench/results/2026-11-27-h200-second-run/), off on the
    CPU (inductor's CPU code is no faster there and its compile takes minutes), and off with
    --deterministic (inductor picks among its reduction kernels' configurations by timing them, and
    another pick sums in another order), and off with --bn_kernels=triton (whose kernels replace what
    inductor would fuse)."""
    if compile_flag is not None:
        return bool(compile_flag)
    return device.type == "cuda" and not deterministic and bn_kernels == "torch"


class CompiledModel:
    """The regions of `model` compiled in place (model keeps its modules, names and state_dict)."""

    def __init__(self, model: nn.Module, mode: str, log: Callable[[str], None] = print):
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
        self.model, self.mode, self.log = model, mode, log
        self.regions = compile_regions(model)
        self.active = False
        self.warmed_up = False
        device = next(model.parameters()).device
        why = why_not_compiled(device) or (None if self.regions else f"{type(model).__name__} has no regions")
        if why:
            self.log(f"fasttrain: --compile: running the model eagerly: {why}")
            return
        _raise_recompile_limit()
        for name, module in self.regions:
            if module is model:  # a method: an instance attribute over the class's
                setattr(model, name, torch.compile(getattr(model, name), mode=mode, dynamic=False))
            else:
                module.compile(mode=mode, dynamic=False, fullgraph=False)
        self.active = True

    def warm_up(self, forward_backward: Callable[[], None], buffers: list[torch.Tensor]) -> None:
        """Compile every region now: `forward_backward()` runs the step's forward and backward once
        (on a zero batch); `buffers` (BN statistics) and the RNG states are restored after it (the
        gradients it leaves, the step zeroes as it starts). On failure the regions run eagerly (one
        line says why)."""
        if not self.active or self.warmed_up:
            return
        self.warmed_up = True
        self.log(
            f"fasttrain: compiling {len(self.regions)} regions of the model (inductor, mode {self.mode}): "
            "a minute or more the first time on a machine (ResNet-50: about a minute on an H200; "
            "Inception v3 took over 3 minutes there beside other work), seconds from inductor's cache after; "
            "--no-compile runs the model eagerly"
        )
        saved = [b.detach().clone() for b in buffers]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        start = time.perf_counter()
        try:
            forward_backward()
        except Exception as exc:  # inductor's errors have many types; any of them means: run eagerly
            self._uncompile()
            reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:300]
            self.log(
                f"fasttrain: --compile: inductor could not compile the model, running it eagerly: {reason}"
            )
        else:
            seconds = time.perf_counter() - start
            self.log(
                f"fasttrain: compiled {len(self.regions)} regions of the model (inductor, mode {self.mode}) "
                f"in {seconds:.0f} s"
            )
        finally:
            with torch.no_grad():
                for buffer, value in zip(buffers, saved):
                    buffer.copy_(value)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)

    def _uncompile(self) -> None:
        # nn.Module.compile() keeps the compiled callable in _compiled_call_impl; without it, calls
        # go to forward again.
        for name, module in self.regions:
            if module is self.model:
                delattr(self.model, name)  # the class's method again
            else:
                module._compiled_call_impl = None
        self.active = False


def _raise_recompile_limit() -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed in torch 2.6
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), _RECOMPILE_LIMIT))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 16 * _RECOMPILE_LIMIT)
    elif hasattr(config, "accumulated_cache_size_limit"):
        config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 16 * _RECOMPILE_LIMIT)
