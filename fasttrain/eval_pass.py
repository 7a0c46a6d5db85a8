"""Top-1 / top-5 evaluation over the validation split, summed across ranks, with raw and EMA weights:
the pass the trainer makes (fasttrain/train.py) and the one `python -m fasttrain.evaluate` makes on a
checkpoint (fasttrain/evaluate.py), and the line and TensorBoard tags of its result."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fasttrain.accuracy import correct, top1_is_first_max
from fasttrain.bn_buffers import BufferEMA, broadcast_statistics
from fasttrain.precision import Precision
from fasttrain.step import model_input

if TYPE_CHECKING:
    from fasttrain.config import Config
    from fasttrain.data import Loader
    from fasttrain.optim import FlatOptimizer


# A progress line at most this often (wall time): an ImageNet validation pass takes minutes on a CPU.
PROGRESS_EVERY_S = 10.0


class EvaluationInterrupted(Exception):
    """evaluate() stopped early: its `interrupted()` said so (a stop signal), at a batch boundary."""


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader: Loader,
    *,
    precision: Precision,
    device: torch.device,
    preprocess: str,
    max_batches: int = 0,
    world_size: int = 1,
    progress: Callable[[str], None] | None = None,
    label: str = "",
    interrupted: Callable[[], bool] | None = None,
    first_max_top1: bool = False,
) -> dict:
    """{'top1', 'top5', 'count'} over every record of the loader (all ranks together; counted as
    `correct` says, first_max_top1 its top-1 rule), and
    'max_eval_batches' when max_batches left batches out (the result is of part of the split). progress: where
    a line 'evaluating the {label} weights: 120/391 batches (31%), ...' goes every PROGRESS_EVERY_S.
    interrupted: asked before each batch; True raises EvaluationInterrupted on every rank (the ranks'
    sums carry it, all-reduced as always: every rank makes that collective once, however early it
    stopped, and all agree on whether to go on)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # correct@1, correct@5, count, stopped, cut
    count = 0
    cut = False  # a batch was left out by max_batches: the result covers part of the split
    total = min(len(loader), max_batches) if max_batches else len(loader)
    started = shown = time.perf_counter()
    stopped = False
    for i, (images, labels) in enumerate(loader):
        if max_batches and i >= max_batches:
            cut = True
            break
        if interrupted is not None and interrupted():
            stopped = True
            break
        if progress is not None and (now := time.perf_counter()) - shown >= PROGRESS_EVERY_S:
            # Batches handed out by the loader (no host sync: on a GPU the last may still be running).
            shown, rate = now, (i + 1) * len(labels) / max(now - started, 1e-9)
            left = (total - i - 1) * (now - started) / (i + 1)
            progress(
                f"evaluating the {label} weights: {i + 1}/{total} batches ({(i + 1) / total:.0%}), "
                f"{rate:.1f} images/s, {left:.0f} s left"
            )
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        x = model_input(images, preprocess, precision)
        with torch.autocast(device.type, dtype=precision.dtype, enabled=precision.autocast):
            logits = model(x)
        top1, top5 = correct(logits, labels, first_max_top1)
        sums[:2] += torch.stack([top1.sum(), top5.sum()])
        count += len(labels)  # on the host: a tensor of it would be a copy the CPU waits for, each batch
    sums[2] += count
    sums[3] += stopped  # summed with the rest: every rank stops if any rank did, or none does
    sums[4] += cut
    if world_size > 1:
        torch.distributed.all_reduce(sums)
    model.train(was_training)
    correct1, correct5, count, stops, cuts = sums.tolist()  # note: host sync, once per evaluation
    if stops:
        raise EvaluationInterrupted
    result = {"top1": correct1 / max(count, 1.0), "top5": correct5 / max(count, 1.0), "count": int(count)}
    if cuts:
        result["max_eval_batches"] = max_batches  # part of the split only: describe() says so
    return result


def evaluate_raw_and_ema(
    model: torch.nn.Module,
    loader: Loader,
    *,
    optimizer: FlatOptimizer,
    bn_ema: BufferEMA | None,
    precision: Precision,
    device: torch.device,
    cfg: Config,
    world_size: int,
    progress: Callable[[str], None] | None = None,
    interrupted: Callable[[], bool] | None = None,
) -> dict:
    """{'top1', 'top5', 'count'} of the raw weights, and 'ema_top1', 'ema_top5' when EMA is on
    (EvaluationInterrupted as evaluate() raises it, the raw weights back in place)."""
    settings = dict(
        precision=precision,
        device=device,
        preprocess=cfg.preprocess,
        max_batches=cfg.max_eval_batches,
        world_size=world_size,
        progress=progress,
        interrupted=interrupted,
        first_max_top1=top1_is_first_max(cfg.model_name),
    )
    if world_size > 1:  # every rank scores the model the checkpoint holds: rank 0's BN statistics
        broadcast_statistics(model, bn_ema)
    raw = evaluate(model, loader, **settings, label="raw")
    result = {k: raw[k] for k in ("top1", "top5", "count", "max_eval_batches") if k in raw}
    if cfg.ema_decay:
        with ema_weights(optimizer, bn_ema):
            ema = evaluate(model, loader, **settings, label="EMA")
        result.update(ema_top1=ema["top1"], ema_top5=ema["top5"])
    return result


def eval_scalars(result: dict) -> dict:
    """TensorBoard tags of an evaluation result: eval/top1, eval/top5, eval/ema_top1, eval/ema_top5."""
    keys = ("top1", "top5", "ema_top1", "ema_top5")
    return {f"eval/{k}": result[k] for k in keys if k in result}


def describe(result: dict) -> str:
    """'validation top-1 0.812 (EMA 0.820), top-5 0.990 on 1280 images', and when --max_eval_batches
    left part of the split out: '... on 1280 images, the first 10 batches of each rank
    (--max_eval_batches)'."""
    ema = f" (EMA {result['ema_top1']:.3f})" if "ema_top1" in result else ""
    part = ""
    if result.get("max_eval_batches"):
        part = f", the first {result['max_eval_batches']} batches of each rank (--max_eval_batches)"
    return (
        f"validation top-1 {result['top1']:.3f}{ema}, top-5 {result['top5']:.3f} on {result['count']} "
        f"images{part}"
    )


@contextlib.contextmanager
def ema_weights(optimizer, bn_ema):
    """Evaluate with the EMA of the weights and of the BN statistics swapped in, then swap back."""
    with optimizer.swap_ema():
        if bn_ema is not None:
            bn_ema.swap()
        try:
            yield
        finally:
            if bn_ema is not None:
                bn_ema.swap()
