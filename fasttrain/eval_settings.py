"""`python -m fasttrain.evaluate`'s settings, apart from the evaluation (fasttrain/evaluate.py): its
arguments, the run's config as the command reads it, where the results may go, and the value every
rank evaluates."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch


def _seconds(text: str) -> float:
    value = float(text)  # argparse turns a ValueError into its one-line usage error
    if not 0 <= value < 1e6:  # -1, nan and inf reached time.sleep after the first evaluation
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, got {text}")
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fasttrain.evaluate",
        description="Evaluate a run's checkpoints on the validation split, raw and EMA weights.",
    )
    parser.add_argument("run_dir", help="the trainer's --train_dir (config.json and ckpt-<step>.pt)")
    parser.add_argument("--checkpoint", default="", help="this checkpoint instead of the newest")
    parser.add_argument(
        "--watch", type=_seconds, default=0.0, metavar="SECONDS", help="poll for new checkpoints"
    )
    parser.add_argument("--data_dir", default="", help="the shards, if not where the run read them")
    parser.add_argument("--device", default="", help="auto, cuda or cpu (default: the run's)")
    parser.add_argument(
        "--recipe", default="", help="for a TensorFlow train directory (no config.json): its model's recipe"
    )
    parser.add_argument(
        "--metrics_out",
        default="",
        help="append results to this JSONL file instead of RUN_DIR/metrics.jsonl (needed to keep the "
        "result of another run's --checkpoint)",
    )
    return parser.parse_args(argv)


def run_config(run_dir: Path, args: argparse.Namespace):
    from fasttrain.config import Config, ConfigError
    from fasttrain.run_config import upgrade_saved_config

    path = run_dir / "config.json"
    if not path.is_file() and args.recipe:  # a TensorFlow run: the recipe says what a config.json would
        from fasttrain.config import make_config
        from fasttrain.tf.checkpoint import open_checkpoint
        from fasttrain.tf.state import config_for

        given = {k: v for k, v in vars(args).items() if k in ("data_dir", "device") and v}
        # num_classes and the ResNet width from the checkpoint: the recipe's may differ from the run's
        return config_for(make_config(recipe=args.recipe, **given), open_checkpoint(run_dir))
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a fasttrain run directory (no config.json); name a --train_dir")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} ({exc})") from None
    known = {f.name for f in dataclasses.fields(Config)}
    saved = {k: v for k, v in saved.items() if k in known}
    saved.update({k: v for k, v in (("data_dir", args.data_dir), ("device", args.device)) if v})
    where = saved.get("data_dir") or ""
    if not args.data_dir and where and saved.get("data_backend") != "synthetic" and not Path(where).is_dir():
        relative = "" if Path(where).is_absolute() else ", relative to where the run was started"
        raise ConfigError(
            f"the run's data directory {where!r} (from {path}{relative}) is not a directory here; "
            "pass --data_dir"
        )
    if saved.get("data_backend") == "dali":  # resolved for the run's device: this machine's may differ
        saved["data_backend"] = "auto"
    if saved.get("data_backend") == "synthetic":  # a demo's run: random batches, which mean nothing
        if args.data_dir:  # --data_dir was ignored: the "validation" was a random batch, repeated
            saved["data_backend"] = "auto"
        else:
            print(
                f"note: {run_dir} trained on synthetic data: its evaluation is of random batches; pass "
                "--data_dir to evaluate it on shards",
                flush=True,
            )
    if args.recipe:
        print(f"note: --recipe is for a TensorFlow train directory; {path} sets this run's", flush=True)
    return Config(**upgrade_saved_config(saved))


def check_metrics_out(path: Path, given: bool) -> None:
    """Refuse, before any evaluation, a results file that is not JSON lines or cannot be written: a
    --metrics_out naming the run's config.json or a checkpoint had a JSON line appended to it (the run
    could no longer be read, or resumed), and an unwritable one ended in a traceback after the whole
    evaluation, its result lost."""
    from fasttrain.config import ConfigError

    flag = "--metrics_out " if given else ""
    if given and path.suffix != ".jsonl":
        raise ConfigError(f"--metrics_out {path} is not a .jsonl file (one JSON line is appended per result)")
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        other = "" if given else "; pass --metrics_out FILE.jsonl to write the result elsewhere"
        raise ConfigError(f"cannot write {flag}{path} ({exc.strerror}){other}") from None


def agreed(value, info):
    """Rank 0's value on every rank: all ranks evaluate the same checkpoint."""
    if info.world_size == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
