"""A training run's parts, built from its Config, and what of them a checkpoint holds.

    run = build_run(cfg, info, precision, schedule, loader, pretrained=True, log=print)
    run.step(batches)            # one optimizer step (fasttrain.step.TrainStep)
    run.state_dict()             # the model's state, the same on every rank (rank 0 saves it)
    run.rank_state()             # this rank's data position and RNG states

fasttrain.resume saves and restores a Run (save_run, restore_run); fasttrain.train drives it.
`load_weights` and `ema_state` are the model-state half of a checkpoint, shared with fasttrain.evaluate
and the TF converter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fasttrain.bn_buffers import BufferEMA
from fasttrain.buckets import GradBuckets
from fasttrain.compile import CompiledModel, compile_wanted
from fasttrain.config import Config
from fasttrain.data import Loader
from fasttrain.dist_info import DistInfo
from fasttrain.distributed import broadcast_module, maybe_sync_bn, wrap_ddp
from fasttrain.epoch_clock import EpochClock
from fasttrain.models import create_model, param_groups
from fasttrain.models.bn_act import use_bn_kernels
from fasttrain.optim import FlatOptimizer, FusedMomentum, FusedRMSPropTF
from fasttrain.precision import Precision
from fasttrain.pretrained import restore_pretrained
from fasttrain.rng import get_rng_state, set_rng_state
from fasttrain.schedule import LRSchedule
from fasttrain.step import TrainStep, classification_loss


@dataclass
class Run:
    """This rank's share of a training run: what a checkpoint saves and a resume restores.

    The model's state (weights, optimizer buffers, BN EMA, the step's device state) is the same on
    every rank and rank 0 writes it (`state_dict`); the data position and RNG states are per rank
    (`rank_state`), gathered into the checkpoint by save_run.
    """

    info: DistInfo
    model: torch.nn.Module
    optimizer: FlatOptimizer
    bn_ema: BufferEMA | None
    step: TrainStep
    loader: Loader
    epoch_clock: EpochClock = field(default_factory=EpochClock)  # set by a resume (fasttrain/resume.py)

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "bn_ema": self.bn_ema.state_dict() if self.bn_ema is not None else {},
            "ema": ema_state(self.model, self.optimizer),
            "train_step": self.step.state_dict(),
            "epoch_clock": self.epoch_clock.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """KeyError, RuntimeError or ValueError when the checkpoint does not fit this run."""
        load_weights(state, self.model, self.optimizer, self.bn_ema)
        self.step.load_state_dict(state["train_step"])

    def rank_state(self) -> dict:
        return {"data": self.loader.state_dict(), "rng": get_rng_state()}

    def load_rank_state(self, data: list[dict], rng: list) -> None:
        """This rank's entries of a checkpoint's per-rank lists: its own when the world size is the
        same, else rank 0's data position (and the RNG states as they are)."""
        rank, world_size = self.info.rank, self.info.world_size
        self.loader.load_state_dict(data[rank] if len(data) == world_size else data[0])
        if len(rng) == world_size:
            set_rng_state(rng[rank])


def build_run(
    cfg: Config,
    info: DistInfo,
    precision: Precision,
    schedule: LRSchedule,
    loader: Loader,
    *,
    pretrained: bool,
    log: Callable[[str], None],
) -> Run:
    """The model on this rank's device (pretrained_model_checkpoint_path's weights when `pretrained`),
    its optimizer and BN EMA, the gradient sync, and the step that runs them."""
    model = build_model(cfg)
    if cfg.pretrained_model_checkpoint_path and pretrained:
        restore_pretrained(model, cfg, log)
    elif cfg.pretrained_model_checkpoint_path and info.is_main:  # the seeds' restore, at step 0 only
        log(
            f"note: pretrained_model_checkpoint_path {cfg.pretrained_model_checkpoint_path} is not read: "
            "this run resumes from a checkpoint, whose weights it continues"
        )
    model = maybe_sync_bn(model, cfg.sync_bn and info.world_size > 1, info)
    if cfg.sync_bn and info.world_size == 1:  # config.json keeps it: say it did nothing here
        log("note: --sync_bn has no effect in one process (the batch's statistics are all there are)")
    memory_format = torch.channels_last if precision.channels_last else torch.contiguous_format
    model = model.to(info.device, memory_format=memory_format)
    if cfg.bn_kernels == "triton":
        use_bn_kernels(model, info.device)
    broadcast_module(model)
    if info.rank:  # dropout masks of their own (every rank had rank 0's); rank 0 draws as one process does
        torch.manual_seed(cfg.seed + 1_000_003 * info.rank)
    optimizer = build_optimizer(cfg, model)
    # After the optimizer: the compiled regions see the parameters as views of its flat buffers.
    wanted = compile_wanted(cfg.compile, info.device, cfg.deterministic, cfg.bn_kernels)
    compiled = CompiledModel(model, cfg.compile_mode, log) if wanted else None
    bn_ema = BufferEMA(model, cfg.ema_decay) if cfg.ema_decay else None
    buckets, ddp_model = None, None
    # The stream of the CUDA graph's warm-up and capture; DDP must be built on it too.
    capture_stream = torch.cuda.Stream(info.device) if precision.cuda_graph else None
    if info.world_size > 1 and cfg.grad_sync == "ddp":
        ddp_model = wrap_ddp(model, info, cfg.bucket_cap_mb, stream=capture_stream)
    elif info.world_size > 1:
        names = {p: n for n, p in model.named_parameters()}
        buckets = GradBuckets(
            optimizer.flat, info, bucket_cap_mb=cfg.bucket_cap_mb, profile=cfg.profile_comm, names=names
        )
    step = TrainStep(
        model,
        optimizer=optimizer,
        precision=precision,
        device=info.device,
        schedule=schedule,
        loss_fn=make_loss(cfg),
        preprocess=cfg.preprocess,
        world_size=info.world_size,
        buckets=buckets,
        ddp_model=ddp_model,
        bn_ema=bn_ema,
        stream=capture_stream,
        compiled=compiled,
    )
    return Run(info=info, model=model, optimizer=optimizer, bn_ema=bn_ema, step=step, loader=loader)


def build_model(cfg: Config) -> torch.nn.Module:
    """The recipe's architecture, on the CPU in NCHW (the caller moves it)."""
    return create_model(
        cfg.model_name,
        cfg.num_classes,
        base_channels=cfg.base_channels,
        zero_init_residual=cfg.zero_init_residual,
        bn_momentum=cfg.bn_momentum,
        bn_eps=cfg.bn_eps,
        inception_bn_gamma=cfg.inception_bn_gamma,
    )


def make_loss(cfg: Config):
    """loss(output, labels): cross-entropy with the recipe's label smoothing and aux-head weight."""
    return lambda out, labels: classification_loss(out, labels, cfg.label_smoothing, cfg.aux_loss_weight)


def build_optimizer(cfg: Config, model: torch.nn.Module):
    groups = param_groups(model, cfg.weight_decay, cfg.no_decay_bn_bias, cfg.no_decay_bn)
    ema = cfg.ema_decay or None
    if cfg.optimizer == "rmsprop":
        return FusedRMSPropTF(
            groups,
            lr=cfg.initial_learning_rate,
            decay=cfg.rmsprop_decay,
            momentum=cfg.momentum,
            eps=cfg.rmsprop_epsilon,
            weight_decay=cfg.weight_decay,
            ema_decay=ema,
            impl=cfg.optimizer_impl,
        )
    return FusedMomentum(
        groups,
        lr=cfg.initial_learning_rate,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        ema_decay=ema,
        impl=cfg.optimizer_impl,
    )


def load_weights(state: dict, model, optimizer, bn_ema) -> None:
    """A checkpoint's model, optimizer and BN EMA (when both have one) into this run's objects;
    KeyError, RuntimeError or ValueError when they do not fit."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if bn_ema is not None and bn_ema.names:
        # Without it, the EMA weights would be evaluated (and the average go on) with the BN statistics
        # as this process built them, not as the run averaged them: a wrong result, not an error.
        if not state.get("bn_ema"):
            raise ValueError("the checkpoint holds no EMA of the BatchNorm statistics ('bn_ema')")
        missing = [name for name in bn_ema.names if name not in state["bn_ema"]]
        if missing:
            raise ValueError(f"the checkpoint's 'bn_ema' lacks {missing[0]}")
        bn_ema.load_state_dict(state["bn_ema"])


def ema_state(model: torch.nn.Module, optimizer) -> dict:
    """The weight EMA by parameter name, as a state_dict-like mapping (empty when EMA is off)."""
    if not optimizer.ema_decay:
        return {}
    names, params = zip(*model.named_parameters())
    return dict(zip(names, optimizer.ema_parameters(list(params))))
