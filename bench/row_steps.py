"""Each throughput row's training step, built from scratch (a fresh model initialised from seed 0):
what the rows (a)-(g) of bench/throughput.py, bench/run.py and bench/gpu_run.py are.

Every row trains the same model at the same batch and image size on the same input, with the recipe's
loss (label smoothing, Inception aux head), L2 weight decay, and an EMA of the weights and of the BN
statistics (decay 0.9999, the Inception seed's, in every row so that all rows do the same work):

    a  fasttrain: TrainStep + build_optimizer + create_model + resolve_precision, as train.py wires
       them: the whole step in a CUDA graph (eager on the CPU), the flat-buffer fused optimizer+EMA
       (Triton on sm70+, its torch reference elsewhere), channels_last and autocast by the precision
       policy (bf16 on sm80+), LR and loss scale on the device; without --compile (the trainer's
       default on CUDA since the second GPU run: that is (f))
    b  eager PyTorch, the best conventional recipe: autocast (the policy's dtype, GradScaler for fp16)
       + channels_last (by the same policy) + torch.optim with foreach=True (SGD momentum for ResNets,
       RMSprop for Inception) + an EMA by torch._foreach_lerp_
    c  plain eager PyTorch, the seeds' setting: fp32, NCHW, torch.optim with foreach=False, the EMA
       as a loop over tensors, cudnn.benchmark off (PyTorch's defaults, TF32 convolutions included)
    d  (b) with the model under torch.compile(mode=compile_mode) and optimizer.step under
       torch.compile (unless fp16 loss scaling calls it), when compilation works
    e  (a) without the CUDA graph (the trainer's --no-cuda_graph): the step run eagerly, everything
       else as in (a); (a) / (e) is what the graph buys
    f  (a) with --compile: the model's blocks compiled by inductor (mode compile_mode, "default" or
       "max-autotune-no-cudagraphs") inside the whole-step graph (fasttrain/compile.py); the trainer's
       CLI as it runs on CUDA
    g  (f) with --pad_stem: the model's first convolution on the images' 3 channels and a fourth, zero
       one (fasttrain/models/stem.py); (g) / (f) is what the 4-channel stem buys the whole step (on an
       H200, nothing: 1.00x, so it is off by default since 2026-11-28; before, (g) was (f) without it)
    h  (a) with --bn_kernels=triton: every BatchNorm of the blocks (ResNets, Inception v3), with the
       residual add and the ReLU after it, in fasttrain's Triton kernels (kernels/batch_norm.py: 8
       passes over the activations, 11 with the add), no compile; (h) / (f) is what they buy against
       inductor's fusion

The optimizer step alone (Row.optimizer_step, Row.optimizer_bytes): bench/throughput.py's docstring.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fasttrain.bn_buffers import BufferEMA
from fasttrain.compile import COMPILE_MODES, CompiledModel, compile_wanted
from fasttrain.config import make_config
from fasttrain.data.normalize import normalize_images
from fasttrain.models import param_groups
from fasttrain.models.bn_act import use_bn_kernels
from fasttrain.precision import Precision, resolve_precision
from fasttrain.run import build_model, build_optimizer, make_loss
from fasttrain.schedule import LRSchedule
from fasttrain.step import TrainStep

ROWS = ("a", "b", "c", "d", "e", "f", "g", "h")
ROW_TITLES = {
    "a": "fasttrain --no-compile (graph, fused optimizer+EMA, policy precision)",
    "b": "eager PyTorch: AMP + channels_last + foreach optim + foreach EMA",
    "c": "plain eager PyTorch: fp32 NCHW, TF32 convolutions as PyTorch ships (the seeds' setting)",
    "d": "torch.compile of (b)",
    "e": "fasttrain without the CUDA graph (eager step, otherwise as (a))",
    "f": "fasttrain --compile (inductor regions inside the whole-step graph; the CLI's default on CUDA)",
    "g": "fasttrain --compile --pad_stem (the first convolution on 4 channels, the fourth zero)",
    "h": "fasttrain --bn_kernels=triton (graph, BatchNorm + add + ReLU in fasttrain's kernels, no compile)",
}
# A row's recipe by model: the seed's for its v2 models, the 2018 v1.5 program's for the rest.
RECIPE_OF = {
    "inception_v3": "inception_v3",
    "resnet101": "resnet101_v1.5",
    "resnet50_v2": "resnet50",
    "resnet101_v2": "resnet101",
}
EMA_DECAY = 0.9999


@dataclass
class RowSpec:
    """What one row trains; JSON-able so that bench.run can hand it to a subprocess."""

    row: str
    model: str
    batch: int
    image_size: int
    base_channels: int = 64
    input: str = "synthetic"
    """synthetic (one uint8 batch made on the device), torch or dali (the input pipelines)."""
    data_dir: str = ""
    num_workers: int = 8
    compile_mode: str = "max-autotune"
    precision: str = ""
    """fp32, fp16 or bf16 for rows a, b, d and e ("": the policy's for the device); (c) is fp32."""


@dataclass
class Row:
    step: Callable[[torch.Tensor, torch.Tensor], None]
    optimizer_step: Callable[[], None]
    setting: dict
    num_params: int
    optimizer_bytes: int
    """Minimum bytes one update moves (bench/throughput.py's docstring)."""
    extra_warmup: int = 0


def config_for(spec: RowSpec, device: torch.device):
    """The recipe's Config for this row (resnet50_v1.5's for the ResNets RECIPE_OF does not name)."""
    return make_config(
        recipe=RECIPE_OF.get(spec.model, "resnet50_v1.5"),
        model=spec.model,
        batch_size=spec.batch,
        image_size=spec.image_size,
        base_channels=spec.base_channels,
        ema_decay=EMA_DECAY,
        data_backend=spec.input,
        data_dir=spec.data_dir,
        num_workers=spec.num_workers,
        device=device.type,
        max_steps=1,
        precision=spec.precision or "auto",
    )


def _model(cfg, device: torch.device, channels_last: bool) -> torch.nn.Module:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return build_model(cfg).to(device, memory_format=fmt).train()


def _update_bytes(states: int, ema: bool) -> int:
    return 4 * (3 + 2 * states + (2 if ema else 0))


def build_fasttrain_row(cfg, device: torch.device) -> Row:
    """Rows (a), (e), (f): fasttrain's own pieces, wired as train.train() wires them for one device."""
    precision = resolve_precision(cfg, device)
    model = _model(cfg, device, precision.channels_last)
    if cfg.bn_kernels == "triton":
        use_bn_kernels(model, device)
    optimizer = build_optimizer(cfg, model)
    wanted = compile_wanted(cfg.compile, device, cfg.deterministic, cfg.bn_kernels)
    compiled = CompiledModel(model, cfg.compile_mode) if wanted else None
    bn_ema = BufferEMA(model, cfg.ema_decay) if cfg.ema_decay else None
    schedule = LRSchedule(cfg, steps_per_epoch=1000, global_batch=cfg.batch_size, device=device)
    step_fn = TrainStep(
        model,
        optimizer=optimizer,
        precision=precision,
        device=device,
        schedule=schedule,
        loss_fn=make_loss(cfg),
        preprocess=cfg.preprocess,
        world_size=1,
        bn_ema=bn_ema,
        compiled=compiled,
    )
    one = torch.ones((), dtype=torch.float32, device=device)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    states = 2 if cfg.optimizer == "rmsprop" else 1
    return Row(
        step=lambda images, labels: step_fn([(images, labels)]),
        optimizer_step=lambda: optimizer.step(grad_scale=one, found_inf=zero),
        setting=dict(
            precision=precision.name,
            channels_last=precision.channels_last,
            cuda_graph=precision.cuda_graph,
            optimizer=f"{type(optimizer).__name__} (impl {optimizer.impl})",
            compile=f"{len(compiled.regions)} regions, mode {cfg.compile_mode}" if compiled else "no",
            stem_channels=precision.stem_channels,
            bn_kernels=cfg.bn_kernels,
        ),
        num_params=sum(p.numel() for p in model.parameters()),
        optimizer_bytes=_update_bytes(states, ema=True),
        # TrainStep runs warmup_steps eager steps, then captures (and replays) on the next call.
        extra_warmup=step_fn.warmup_steps + 1,
    )


def build_eager_row(
    cfg, device: torch.device, precision: Precision, foreach: bool, compile_mode: str = ""
) -> Row:
    """Rows (b), (c) and (d): the conventional PyTorch training step."""
    model = _model(cfg, device, precision.channels_last)
    groups = param_groups(model, cfg.weight_decay, cfg.no_decay_bn_bias, cfg.no_decay_bn)
    lr = cfg.initial_learning_rate
    if cfg.optimizer == "rmsprop":
        opt = torch.optim.RMSprop(
            groups, lr=lr, alpha=cfg.rmsprop_decay, eps=cfg.rmsprop_epsilon, momentum=cfg.momentum,
            foreach=foreach,
        )  # fmt: skip
        states = 2
    else:
        opt = torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, foreach=foreach)
        states = 1
    scaler = torch.amp.GradScaler(device.type, enabled=precision.loss_scaling)
    params = [p for g in groups for p in g["params"]]
    bn_stats = [b for b in model.buffers() if b.is_floating_point()]
    ema_params = [p.detach().clone() for p in params]
    ema_stats = [b.detach().clone() for b in bn_stats]
    forward = torch.compile(model, mode=compile_mode) if compile_mode else model
    opt_step = opt.step
    if compile_mode and not precision.loss_scaling:
        opt_step = torch.compile(fullgraph=False)(lambda: opt.step())  # PyTorch's compiled-optimizer recipe
    loss_fn, decay, applied = make_loss(cfg), cfg.ema_decay, [0]

    @torch.no_grad()
    def ema_update(targets, sources) -> None:
        # tf.train.ExponentialMovingAverage with num_updates, the weight computed on the host.
        n = applied[0]
        weight = 1.0 - min(decay, (1 + n) / (10 + n))
        if foreach:
            torch._foreach_lerp_(targets, sources, weight)
        else:
            for t, s in zip(targets, sources):
                t.lerp_(s, weight)

    def optimizer_step() -> None:
        if precision.loss_scaling:
            scaler.step(opt)
            scaler.update()
        else:
            opt_step()
        applied[0] += 1
        ema_update(ema_params, params)

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        if compile_mode:
            # One training iteration per call: cudagraph trees (max-autotune) may then reuse the
            # previous step's output memory instead of failing on an overwritten output.
            torch.compiler.cudagraph_mark_step_begin()
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        if images.is_floating_point():  # DALI's normalised NHWC batch
            x = images.permute(0, 3, 1, 2)
            x = x if precision.channels_last else x.contiguous()
        else:
            x = normalize_images(images, cfg.preprocess, torch.float32, precision.channels_last)
        with torch.autocast(device.type, dtype=precision.dtype, enabled=precision.autocast):
            loss = loss_fn(forward(x), labels)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        optimizer_step()
        ema_update(ema_stats, bn_stats)

    setting = dict(
        precision=precision.name,
        channels_last=precision.channels_last,
        cuda_graph=False,
        optimizer=f"torch.optim.{type(opt).__name__}(foreach={foreach})",
    )
    if compile_mode:
        setting["compile"] = f"model: torch.compile(mode={compile_mode!r}); optimizer.step: " + (
            "eager (GradScaler)" if precision.loss_scaling else "torch.compile()"
        )
    # Compiled code recompiles on the second call (optimizer state appears after the first step).
    extra_warmup = 2 if compile_mode else 0
    num_params = sum(p.numel() for p in params)
    return Row(step, optimizer_step, setting, num_params, _update_bytes(states, True), extra_warmup)


def build_row(spec: RowSpec, device: torch.device) -> Row:
    """The row's training step, built from scratch (a fresh model initialised from seed 0)."""
    if spec.row not in ROWS:
        raise ValueError(f"row {spec.row!r} is not one of {', '.join(ROWS)}")
    cfg = config_for(spec, device)
    torch.manual_seed(0)
    policy = resolve_precision(dataclasses.replace(cfg, cuda_graph=False), device)
    # cudnn.benchmark (per-shape algorithm search, untimed in warm-up) for the tuned rows; (c) keeps
    # PyTorch's default. fasttrain's train.py sets it too (unless --deterministic).
    torch.backends.cudnn.benchmark = spec.row != "c"
    if spec.row == "a":  # without --compile, the CLI's default on CUDA: (f) is that
        row = build_fasttrain_row(dataclasses.replace(cfg, compile=False), device)
    elif spec.row == "h":
        if device.type == "cpu":  # the CPU dry run: the kernels run only in Triton's interpreter there
            os.environ.setdefault("TRITON_INTERPRET", "1")
        row = build_fasttrain_row(dataclasses.replace(cfg, compile=False, bn_kernels="triton"), device)
    elif spec.row == "e":
        row = build_fasttrain_row(dataclasses.replace(cfg, cuda_graph=False, compile=False), device)
    elif spec.row in ("f", "g"):
        mode = spec.compile_mode if spec.compile_mode in COMPILE_MODES else "default"
        pad = {"pad_stem": True} if spec.row == "g" else {}  # (f): the policy's, as the CLI runs
        row = build_fasttrain_row(dataclasses.replace(cfg, compile=True, compile_mode=mode, **pad), device)
    elif spec.row == "c":
        row = build_eager_row(cfg, device, Precision("fp32", False, False), foreach=False)
    else:
        compile_mode = spec.compile_mode if spec.row == "d" else ""
        row = build_eager_row(cfg, device, policy, foreach=True, compile_mode=compile_mode)
    row.setting["cudnn_benchmark"] = torch.backends.cudnn.benchmark
    return row
