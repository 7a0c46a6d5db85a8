"""`python -m fasttrain.evaluate`'s settings, apart from the evaluation (fasttrain/evaluate.py and
fasttrain/eval_pass.py): its arguments, the run's config as the command reads it, where the results may
go, and the value every rank evaluates."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from pathlib import Path

from fasttrain.cli_parser import Parser


def _seconds(text: str) -> float:
    value = float(text)  # argparse turns a ValueError into its one-line usage error
    if not 0 <= value < 1e6:  # -1, nan and inf reached time.sleep after the first evaluation
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, got {text}")
    return value


def _subset(text: str) -> str:
    if text != "validation":  # the train split is not one the evaluator's loader reads
        raise argparse.ArgumentTypeError(f"{text!r}: fasttrain.evaluate evaluates the validation split only")
    return text


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a number of images, 1 or more, got {text}")
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    """The arguments; the seed's eval program's flags (inception_eval.py: --checkpoint_dir, --eval_dir,
    --eval_interval_secs, --run_once, --num_examples, --subset) in fasttrain's terms."""
    parser = Parser(
        prog="python -m fasttrain.evaluate",
        description="Evaluate a run's checkpoints on the validation split, raw and EMA weights.",
        epilog="The seed's flags (inception_eval.py) are taken too: --checkpoint_dir DIR (RUN_DIR), "
        "--eval_interval_secs S (--watch S), --run_once (the default here; the seed's was to loop every "
        "300 s), --num_examples N, --subset validation, --eval_dir (noted: the results' places are fixed).",
    )
    parser.add_argument(
        "run_dir", nargs="?", default="", help="the trainer's --train_dir (config.json and ckpt-<step>.pt)"
    )
    parser.add_argument("--checkpoint_dir", default="", help="the seed's name for RUN_DIR")
    parser.add_argument("--checkpoint", default="", help="this checkpoint instead of the newest")
    parser.add_argument(
        "--watch", type=_seconds, default=0.0, metavar="SECONDS", help="poll for new checkpoints"
    )
    parser.add_argument(
        "--eval_interval_secs", type=_seconds, metavar="SECONDS", help="the seed's name for --watch"
    )
    parser.add_argument(
        "--run_once", action="store_true", help="evaluate once (the default here; the seed's looped)"
    )
    parser.add_argument(
        "--num_examples",
        type=_count,
        default=0,
        metavar="N",
        help="evaluate the first ceil(N / batch) whole batches, as the seed did (default: the whole split)",
    )
    parser.add_argument("--subset", type=_subset, default="validation", help="validation (the only one)")
    parser.add_argument("--eval_dir", default="", help="the seed's; noted: see RUN_DIR/eval, --metrics_out")
    parser.add_argument("--batch_size", type=_count, help="the seed's; noted: the run's batch is used")
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
    args = parser.parse_args(argv)
    if args.checkpoint_dir:
        if args.run_dir and Path(args.run_dir).resolve() != Path(args.checkpoint_dir).resolve():
            parser.error(f"RUN_DIR {args.run_dir} and --checkpoint_dir {args.checkpoint_dir} differ")
        args.run_dir = args.run_dir or args.checkpoint_dir
    if not args.run_dir:
        parser.error("name the run to evaluate: RUN_DIR (or the seed's --checkpoint_dir DIR)")
    if args.eval_interval_secs is not None and not args.run_once:  # the seed's --run_once wins over it
        if args.watch and args.watch != args.eval_interval_secs:
            given = f"--watch {args.watch:g} and --eval_interval_secs {args.eval_interval_secs:g}"
            parser.error(f"{given} differ: give one of them")
        args.watch = args.eval_interval_secs
    if args.run_once and args.watch:
        parser.error("--run_once evaluates once and --watch polls; give one of them")
    if args.eval_dir and os.environ.get("RANK", "0") == "0":
        where = (
            f"its rows go to {args.metrics_out}, and no TensorBoard files are written"
            if args.metrics_out
            else f"the evaluation's TensorBoard files go to {Path(args.run_dir) / 'eval'}, its rows to the "
            "run's metrics.jsonl (--metrics_out FILE.jsonl: another file)"
        )
        print(f"note: --eval_dir {args.eval_dir} is not written: {where}", flush=True)
    if args.batch_size and os.environ.get("RANK", "0") == "0":
        print(
            f"note: --batch_size {args.batch_size} is not used: the evaluation batches are the run's "
            "--batch_size (results do not depend on it)",
            flush=True,
        )
    return args


def run_config(run_dir: Path, args: argparse.Namespace):
    """The run's Config as the evaluator reads it; --num_examples N as --max_eval_batches, the whole
    batches of each rank that hold N (the seed's: num_iter = ceil(num_examples / batch_size) batches)."""
    cfg = _saved_config(run_dir, args)
    if not args.num_examples:
        return cfg
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's: each rank evaluates its share
    batches = math.ceil(args.num_examples / (cfg.eval_batch_per_process * ranks))  # the evaluator's batch
    return dataclasses.replace(cfg, max_eval_batches=batches)


def _saved_config(run_dir: Path, args: argparse.Namespace):
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
        from fasttrain.tf.checkpoint import is_tf_checkpoint

        if is_tf_checkpoint(run_dir):  # what is missing is the recipe, not another directory
            raise ConfigError(
                f"{run_dir} is a TensorFlow train directory, which has no config.json: name its recipe "
                "with --recipe (inception_v3, resnet50, resnet101, ...)"
            )
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
    given = {k for k in ("data_dir", "device") if getattr(args, k)}
    try:
        Config(**upgrade_saved_config({k: v for k, v in saved.items() if k not in given}))
    except ConfigError as exc:  # the run's own setting, not a flag of this command: name the file
        text = re.sub(r"--(\w+)", lambda m: m.group(1) if m.group(1) in known else m.group(0), str(exc))
        raise ConfigError(f"{path} does not load: {text}; correct it there") from None
    return Config(**upgrade_saved_config(saved))  # a ConfigError here: --data_dir's or --device's


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
