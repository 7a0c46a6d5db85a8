"""The seed's separate evaluation program (under torchrun too), on a run's checkpoints; the evaluation
itself, top-1 / top-5 over the validation split with raw and EMA weights, is fasttrain/eval_pass.py:

  python -m fasttrain.evaluate RUN_DIR [--checkpoint PATH] [--watch SECONDS] [--data_dir DIR] [--device D]
  python -m fasttrain.evaluate TF_TRAIN_DIR --recipe inception_v3 --data_dir DIR    # a TensorFlow run
  (the seed's inception_eval.py flags too: --checkpoint_dir, --eval_interval_secs, ...; eval_settings.py)

evaluates RUN_DIR's newest checkpoint (or PATH) with the run's config.json (model, eval transform,
validation split, --max_eval_batches), raw and EMA weights, prints top-1/top-5 and the image count, and
appends the result to RUN_DIR/metrics.jsonl ("source": "evaluate") and to TensorBoard in RUN_DIR/eval
(the seed's eval_dir: a second run beside the trainer's, same tags). --watch re-evaluates each new
checkpoint, every SECONDS, until the run's final step or Ctrl-C. PATH may be a TensorFlow checkpoint
(its raw weights and ExponentialMovingAverage shadows, as the seed's eval program restores them) or a
`fasttrain.tf.convert from-tf` file; a TensorFlow train directory has no config.json: --recipe names one.
A --checkpoint of another run (not in RUN_DIR, and the run.json beside it, or else its own run_id, not
RUN_DIR's; or nothing tells: fasttrain/lock.py's checkpoint_run) is evaluated with RUN_DIR's config and
printed, with a note saying why, but written nowhere, unless --metrics_out FILE says where to append its
result (then no TensorBoard); one that RUN_DIR's model does not fit ends in one line giving the command
that evaluates it with its own run's config. Nothing is written before the checkpoint has loaded.
--metrics_out also redirects RUN_DIR's own results.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path

import torch

from fasttrain.bn_buffers import BufferEMA
from fasttrain.distributed import first_rank_error, from_rank0
from fasttrain.errors import exit_code, print_error
from fasttrain.eval_pass import describe, eval_scalars, evaluate_raw_and_ema
from fasttrain.eval_settings import check_metrics_out, parse, run_config


class _Evaluator:
    """The run's model, optimizer (whose flat buffers hold the EMA) and BN EMA, built once; a
    checkpoint is loaded into them as a resume would, then evaluated as the trainer does. Where results
    go (`outputs`) is opened once a checkpoint has loaded: a checkpoint that failed to load left an empty
    TensorBoard file in RUN_DIR/eval."""

    def __init__(self, run_dir: Path, cfg, info):
        from fasttrain.data import build_loader
        from fasttrain.precision import resolve_precision
        from fasttrain.run import build_model, build_optimizer

        self.run_dir, self.cfg, self.info = run_dir, cfg, info
        self.total_steps = 0  # the run's last step, as its newest loaded checkpoint records it
        # whether the last checkpoint loaded is the run's (None: nothing tells), and the evidence
        self.belongs: tuple[bool | None, str] = (True, "")
        self.outputs: tuple[Path | None, bool] = (run_dir / "metrics.jsonl", True)  # (metrics_out, curves)
        self.metrics = self.curves = None
        self.on_read = None  # called with `belongs` once a checkpoint is read, before its weights are loaded
        self.precision = resolve_precision(cfg, info.device)
        layout = torch.channels_last if self.precision.channels_last else torch.contiguous_format
        self.model = build_model(cfg).to(info.device, memory_format=layout)
        self.optimizer = build_optimizer(cfg, self.model)
        self.bn_ema = BufferEMA(self.model, cfg.ema_decay) if cfg.ema_decay else None
        self.loader = build_loader(
            dataclasses.replace(cfg, batch_size=cfg.eval_batch_per_process),  # the trainer's eval batch
            "validation",
            training=False,
            rank=info.rank,
            world_size=info.world_size,
            device=info.device,
            precision=self.precision,
            reuse_buffers=True,  # evaluate() is done with a batch before it asks for the next
        )

    def _open_outputs(self) -> None:
        """The results' MetricsLog and TensorBoard writer, as `outputs` says, made once."""
        from fasttrain.curves import Curves
        from fasttrain.monitor import MetricsLog

        if self.metrics is not None:
            return
        metrics_out, curves = self.outputs
        # metrics_out None: a foreign checkpoint's result is printed only (MetricsLog disabled).
        self.metrics = MetricsLog(
            metrics_out or self.run_dir / "metrics.jsonl",
            enabled=self.info.is_main and metrics_out is not None,
        )
        on = curves and self.cfg.tensorboard and self.info.is_main
        self.curves = Curves(self.run_dir / "eval", on, start_step=None)

    def load(self, path: Path) -> int:
        from fasttrain.checkpoint import CheckpointError, load_checkpoint
        from fasttrain.lock import checkpoint_run
        from fasttrain.resume import changed_settings, shaping_changes
        from fasttrain.run import load_weights

        if _is_tf_checkpoint(path):
            self._read(checkpoint_run(self.run_dir, path, None))
            return _load_tf(self, path)
        state = load_checkpoint(path, map_location="cpu")
        written_by = state.get("run_id")
        self._read(checkpoint_run(self.run_dir, path, written_by if isinstance(written_by, str) else None))
        if "optimizer" not in state:  # written by python -m fasttrain.tf.convert from-tf: weights only
            return _load_tf(self, path, state)
        try:
            load_weights(state, self.model, self.optimizer, self.bn_ema)
        except (KeyError, RuntimeError, ValueError) as exc:
            changes = shaping_changes(changed_settings(state.get("config"), self.cfg))
            reason = "; ".join(changes) or str(exc).strip().splitlines()[0]
            if self.belongs[0]:
                raise CheckpointError(
                    f"{path} is not a checkpoint of the run in {self.run_dir} ({reason}); name one of its "
                    "own ckpt-<step>.pt files"
                ) from None
            # Another run's checkpoint (the note before said so) is evaluated with this run's config,
            # which does not fit it: its own run directory's does.
            home = path.parent if (path.parent / "config.json").is_file() else "ITS_RUN_DIR"
            raise CheckpointError(
                f"{path} does not fit the model of {self.run_dir}'s config ({reason}); evaluate it with the "
                f"config of the run that wrote it: python -m fasttrain.evaluate {home} --checkpoint {path}"
            ) from None
        self.total_steps = int(state.get("total_steps") or 0)  # 0: a checkpoint from before it was kept
        return int(state["step"])

    def _read(self, belongs: tuple[bool | None, str]) -> None:
        self.belongs = belongs
        if self.on_read is not None:
            self.on_read(belongs)

    def __call__(self, path: Path) -> dict:
        return self.evaluate(path, self.load_on_every_rank(path))

    def evaluate(self, path: Path, step: int) -> dict:
        """Evaluate the checkpoint loaded from `path`; its result written as `outputs` says."""
        self._open_outputs()
        result = evaluate_raw_and_ema(
            self.model,
            self.loader,
            optimizer=self.optimizer,
            bn_ema=self.bn_ema,
            precision=self.precision,
            device=self.info.device,
            cfg=self.cfg,
            world_size=self.info.world_size,
            progress=(lambda line: print(line, flush=True)) if self.info.is_main else None,
        )
        # An evaluation done again (a second command on the same checkpoint) gets its row, but not a
        # second TensorBoard point at the step: the curve would double back on itself there.
        again = self.curves.writer is not None and self.metrics.has_row(
            step, split="validation", source="evaluate"
        )
        self.metrics.write(step=step, split="validation", source="evaluate", checkpoint=str(path), **result)
        if not again:
            self.curves.scalars(step, eval_scalars(result))
        if self.info.is_main:
            print(f"{path}: step {step}, {describe(result)}", flush=True)
        return {"step": step, **result}

    def load_on_every_rank(self, path: Path) -> int:
        """load(path), and CheckpointError on every rank when any rank could not load it: a rank alone
        going back to wait for the next checkpoint left the others in the evaluation's all-reduce for ever
        (a file pruned or unreadable on one node only). total_steps becomes rank 0's."""
        from fasttrain.checkpoint import CheckpointError

        error, step = None, 0
        try:
            step = self.load(path)
        except CheckpointError as exc:
            error = exc
        failed = first_rank_error(str(error or ""), self.info)
        # where --watch ends, the same on every rank
        self.total_steps = from_rank0(self.total_steps, self.info)
        if failed is not None:
            raise error if error is not None else CheckpointError(f"rank {failed[0]}: {failed[1]}")
        return step


def _is_tf_checkpoint(path: Path) -> bool:
    from fasttrain.tf.checkpoint import is_tf_checkpoint

    return is_tf_checkpoint(path)


def _load_tf(evaluator: _Evaluator, path: Path, converted: dict | None = None) -> int:
    """A TensorFlow checkpoint (raw weights and its ExponentialMovingAverage shadows, as the seed's eval
    program restores them), or the `converted` state of a `fasttrain.tf.convert from-tf` file (weights
    only: its EMA is the weights), loaded into the evaluator (fasttrain.tf.state); returns the step."""
    from fasttrain.checkpoint import CheckpointError
    from fasttrain.tf.checkpoint import open_checkpoint
    from fasttrain.tf.state import load_eval_weights, load_tf_for_eval

    parts = (evaluator.model, evaluator.optimizer, evaluator.bn_ema)
    if converted is None:
        return load_tf_for_eval(open_checkpoint(path), evaluator.cfg.model_name, *parts)
    try:
        load_eval_weights(*parts, converted["model"], None)
    except (KeyError, RuntimeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0]
        raise CheckpointError(f"{path} does not fit model {evaluator.cfg.model_name} ({reason})") from None
    return int(converted["step"])


def evaluate_run(args: argparse.Namespace) -> list[dict]:
    """Evaluate as the command line asks; the results, one per checkpoint."""
    from fasttrain.checkpoint import CheckpointError
    from fasttrain.distributed import init_distributed

    run_dir = Path(args.run_dir)
    cfg = run_config(run_dir, args)

    info = init_distributed(cfg.device)
    if info.is_main and args.metrics_out:
        check_metrics_out(Path(args.metrics_out), given=True)
    if not args.checkpoint and info.is_main and not args.metrics_out:
        check_metrics_out(run_dir / "metrics.jsonl", given=False)
    evaluator = _Evaluator(run_dir, cfg, info)
    given_out = Path(args.metrics_out) if args.metrics_out else None
    evaluator.outputs = (given_out or run_dir / "metrics.jsonl", not args.metrics_out)
    if args.checkpoint:
        path = Path(args.checkpoint)

        def whose(belongs: tuple[bool | None, str]) -> None:
            """Said once the checkpoint is read (a missing or garbage file, a directory: its one-line error
            alone), before its weights are loaded (another run's that does not fit: the note, then why)."""
            own, evidence = belongs
            if own:
                return
            evaluator.outputs = (given_out, False)
            if info.is_main:
                where = (
                    f"appended to {given_out}"
                    if given_out
                    else "not written anywhere (pass --metrics_out FILE)"
                )
                which = "is not" if own is False else "is not known to be"
                print(
                    f"note: {path} {which} a checkpoint of the run in {run_dir} ({evidence}): evaluating it "
                    f"with {run_dir}'s config; its result is {where}, {run_dir}'s curves are untouched",
                    flush=True,
                )

        evaluator.on_read = whose
        step = evaluator.load_on_every_rank(path)
        if evaluator.belongs[0] and info.is_main and not args.metrics_out:
            check_metrics_out(run_dir / "metrics.jsonl", given=False)
        return [evaluator.evaluate(path, step)]
    tf_dir = args.recipe and _is_tf_checkpoint(run_dir)
    results, done, failed = [], None, None
    while True:
        found = _checkpoints(run_dir, tf_dir) if info.is_main else []
        found = from_rank0(found, info)  # all ranks evaluate the same checkpoints
        if not found and not args.watch:
            raise CheckpointError(f"{run_dir} holds no checkpoint (ckpt-<step>.pt) yet; nothing to evaluate")
        # The newest at the start; then each one newer than the last evaluated, oldest first: taking
        # the newest alone passed over those written between two polls.
        for step, path in found[-1:] if done is None else [(s, p) for s, p in found if s > done]:
            try:
                results.append(evaluator(path))
                failed = None
            except CheckpointError as exc:
                if not args.watch:
                    raise
                # pruned by the trainer's keep-last-K meanwhile, or corrupt: the next one will do
                if info.is_main:
                    print(f"warning: {exc}; waiting for the next checkpoint", file=sys.stderr, flush=True)
                failed = exc
            done = step
        # The run's last step, as its newest checkpoint records it: config.json, read once, may be of
        # an earlier start (a resume with another --max_steps rewrites it). Older checkpoints: --max_steps.
        last = evaluator.total_steps or cfg.max_steps
        if not args.watch or (last and done is not None and done >= last):
            if failed is not None:  # the run's last checkpoint could not be evaluated: not a success
                raise failed
            return results
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:  # Ctrl-C between evaluations ends --watch, a success
            return results


def _checkpoints(run_dir: Path, tf_dir: bool) -> list[tuple[int, Path]]:
    """(step, path) of the run's checkpoints, oldest first: its ckpt-<step>.pt files, or a TensorFlow
    train directory's newest (its `checkpoint` file's, re-read at each poll as the seed's eval does)."""
    from fasttrain.checkpoint import list_checkpoints

    if not tf_dir:
        return list_checkpoints(run_dir)
    from fasttrain.tf.checkpoint import checkpoint_prefix

    prefix = checkpoint_prefix(run_dir)
    number = re.search(r"-(\d+)$", prefix.name)
    return [(int(number.group(1)) if number else 0, prefix)]


def main(argv: list[str] | None = None) -> int:
    from fasttrain.distributed import cleanup

    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        evaluate_run(args)
    except Exception as err:
        if (code := exit_code(err)) is None:
            raise
        print_error(err)
        return code
    except KeyboardInterrupt:  # during an evaluation (--watch's sleep returns): nothing was written
        print("fasttrain.evaluate: interrupted while evaluating; no result written", file=sys.stderr)
        return 130
    finally:
        cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
