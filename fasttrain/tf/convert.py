"""Convert checkpoints between TensorFlow (the seeds' runs) and fasttrain.

    python -m fasttrain.tf.convert from-tf PREFIX_OR_DIR --model NAME [--num_classes N] [--weights raw|ema]
                                           --out FILE.pt [--overwrite]
    python -m fasttrain.tf.convert to-tf CKPT_OR_RUN_DIR --out PREFIX [--model NAME] [--overwrite]

from-tf reads a V1 or V2 checkpoint (a prefix, or a TF train directory whose `checkpoint` file names
the newest) and writes a fasttrain checkpoint {"model": state_dict, "step": global_step, "config":
{"model", "num_classes"}}: `--weights ema` puts the ExponentialMovingAverage shadows in "model" (what
the Inception seed's eval program restores). --pretrained_model_checkpoint_path and fasttrain.evaluate
load it. num_classes defaults to the checkpoint's classifier width.

to-tf reads a fasttrain checkpoint (a ckpt-<step>.pt, or a run directory's newest) and writes the V2
checkpoint PREFIX.index + PREFIX.data-00000-of-00001 and the directory's `checkpoint` file, with the
seed's variable names, shapes and dtypes: weights, BN statistics, the optimizer's slots, EMA shadows
(of the weights and of the BN statistics) and global_step (fasttrain.tf.state's table); for
inception_v3 also each moving statistic's zero-debias state (float32 local_step from the layer's
count, biased = moving * (1 - decay^local_step)), so that the seed's Saver restores every variable of
its graph (checked with TF: tests/data/check_tf_restore_inception.py). A checkpoint without optimizer
state (a from-tf file) gives weights, BN statistics and zero-debias state only: enough for the seed's
--pretrained_model_checkpoint_path, not for its --checkpoint_dir or eval program (no slots, no
shadows). The model comes from the checkpoint's config (--model for one without).

Neither replaces a file that exists (a run's ckpt-<step>.pt, an earlier export), nor to-tf a `checkpoint`
file that is not TF's, unless --overwrite is given (a TF `checkpoint` file keeps the checkpoints it lists,
PREFIX the newest, as TF's Saver does); an --out that cannot be written is refused, in one line, before
the conversion's work, and one that names a directory (it exists, or ends in '/') as a bad flag (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from fasttrain import checkpoint as ckpt_io
from fasttrain.checkpoint import CheckpointError
from fasttrain.cli_parser import Parser
from fasttrain.errors import FasttrainError, SettingError, exit_code, print_error


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = Parser(prog="python -m fasttrain.tf.convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    from_tf = sub.add_parser("from-tf", help="a TensorFlow checkpoint -> a fasttrain .pt")
    from_tf.add_argument("source", help="TF checkpoint prefix (model.ckpt-N) or its train directory")
    from_tf.add_argument(
        "--model", required=True, help="fasttrain model name (inception_v3, resnet50_v2, ...)"
    )
    from_tf.add_argument("--num_classes", type=int, default=0, help="default: the checkpoint's")
    from_tf.add_argument("--weights", choices=("raw", "ema"), default="raw", help="raw or EMA shadows")
    from_tf.add_argument("--out", required=True, help="the .pt file to write")
    from_tf.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    to_tf = sub.add_parser("to-tf", help="a fasttrain checkpoint -> a TensorFlow V2 checkpoint")
    to_tf.add_argument("source", help="ckpt-<step>.pt, or a run directory (its newest)")
    to_tf.add_argument("--out", required=True, help="the TF prefix to write, e.g. out/model.ckpt-1000")
    to_tf.add_argument("--model", default="", help="model name, for a checkpoint without a config")
    to_tf.add_argument(
        "--overwrite", action="store_true", help="replace the checkpoint at --out if it exists"
    )
    return parser.parse_args(argv)


def check_out_names_a_file(out: str, example: str) -> None:
    """Refuse an --out that names a directory (one that exists, or any ending in '/'), as a bad flag: to-tf
    wrote DIR.index and DIR.data-* beside the directory, and the parent's `checkpoint` file; from-tf a
    file named DIR. `example`: what to give instead."""
    if out.endswith(("/", os.sep)) or Path(out).is_dir():
        raise SettingError(f"--out {out} is a directory; give {example}")


def check_out(targets: list[Path], overwrite: bool) -> None:
    """Refuse --out before any work: a directory, a path under a file, or (without --overwrite) a file
    that exists (a run's own ckpt-<step>.pt, replaced, left its old .sha256 beside it and the run could
    not resume from it)."""
    for target in targets:
        if target.is_dir():
            raise FasttrainError(f"--out {target} is a directory; give the path of a file to write")
        if target.exists() and not overwrite:
            raise FasttrainError(
                f"--out {target} exists; pick another --out, or pass --overwrite to replace it"
            )
    for folder in targets[0].parents:  # the nearest that exists must be a directory
        if folder.exists():
            if not folder.is_dir():
                raise FasttrainError(f"cannot write --out {targets[0]}: {folder} is a file, not a directory")
            break


def from_tf(args: argparse.Namespace) -> Path:
    from fasttrain.models import create_model
    from fasttrain.tf.checkpoint import open_checkpoint
    from fasttrain.tf.state import model_state, network_widths, read_global_step

    example = Path(args.out) / "model.pt"
    check_out_names_a_file(args.out, f"the path of the .pt file to write, such as {example}")
    out = Path(args.out)
    check_out([out], args.overwrite)
    reader = open_checkpoint(args.source)
    width, base_channels = network_widths(reader, args.model)
    num_classes = args.num_classes or width
    model = create_model(args.model, num_classes, base_channels=base_channels)
    state = model_state(reader, args.model, model, ema=args.weights == "ema")
    step = read_global_step(reader) if "global_step" in reader.shapes() else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    saved = {
        "model": state,
        "step": step,
        "config": {"model": args.model, "num_classes": num_classes, "base_channels": base_channels},
        "source": f"TensorFlow {reader.version} {reader.prefix} ({args.weights} weights)",
    }
    _write_pt(out, saved)
    print(
        f"wrote {out}: {args.model}, {num_classes} classes, step {step}, "
        f"{args.weights} weights of {reader.prefix}"
    )
    return out


def _write_pt(out: Path, saved: dict) -> None:
    """torch.save `saved` as `out`, whole or not at all: into a temporary file beside it, fsynced, then
    renamed over it. A failure (a full disk) is a CheckpointError naming `out`, any old `out` as it was.
    A run's checksum beside a file --overwrite replaces describes the old file: removed once the new
    file is complete, just before the rename (the old file without a sum still loads; the new file
    beside the old sum would not)."""
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            ckpt_io.torch_save_to(f, saved)  # a full disk's OSError, not torch's "unexpected pos"
            f.flush()
            os.fsync(f.fileno())
        out.with_name(out.name + ".sha256").unlink(missing_ok=True)
        os.replace(tmp, out)
    except BaseException as exc:
        left = "" if ckpt_io.remove_file(tmp) else f"; {tmp} could not be removed"
        if isinstance(exc, OSError):
            kept = "it is as it was" if out.exists() else "nothing was written"
            raise CheckpointError(
                f"cannot write {out} ({ckpt_io.os_error_text(exc)}): {kept}{left}"
            ) from None
        raise


def _saved_config(state: dict, model: str):
    """The checkpoint's Config (its saved fields over the base's defaults); --model overrides."""
    from fasttrain.config import Config
    from fasttrain.run_config import upgrade_saved_config

    known = {f.name for f in dataclasses.fields(Config)}
    saved = {k: v for k, v in (state.get("config") or {}).items() if k in known}
    if model:
        saved.update(model=model, resnet_size=0)
    if "model" not in saved:
        raise CheckpointError("the checkpoint names no model (no config): pass --model")
    if "max_steps" not in saved and "train_epochs" not in saved:  # a from-tf file: Config wants a length
        saved["max_steps"] = 1
    return Config(**upgrade_saved_config(saved))


def _check_state_file(prefix: Path, overwrite: bool) -> None:
    """Refuse a `checkpoint` in --out's directory that is not a TF `checkpoint` file (a directory always;
    a file naming no model_checkpoint_path unless --overwrite): to-tf would replace it. One that is keeps
    the checkpoints it lists (fasttrain.tf.checkpoint.write_state_file)."""
    from fasttrain.tf.checkpoint import newest_in_directory

    state = prefix.parent / "checkpoint"
    if state.is_dir():
        raise FasttrainError(f"{state} is a directory; give --out in another directory")
    if overwrite or not state.exists():
        return
    try:
        newest_in_directory(prefix.parent)
    except CheckpointError:
        raise FasttrainError(
            f"{state} is not a TensorFlow `checkpoint` file (it names no model_checkpoint_path), and to-tf "
            "would replace it; give --out in another directory, or pass --overwrite to replace it"
        ) from None


def to_tf(args: argparse.Namespace) -> Path:
    from fasttrain.bn_buffers import BufferEMA
    from fasttrain.run import build_model, build_optimizer, load_weights
    from fasttrain.tf.checkpoint import write_checkpoint
    from fasttrain.tf.export import export_tensors

    example = Path(args.out) / "model.ckpt-N"
    check_out_names_a_file(args.out, f"a TensorFlow checkpoint prefix in it, such as {example} (N: the step)")
    check_out([Path(f"{args.out}.index"), Path(f"{args.out}.data-00000-of-00001")], args.overwrite)
    _check_state_file(Path(args.out), args.overwrite)
    source = Path(args.source)
    if source.is_dir():
        found = ckpt_io.load_latest(source, log=lambda m: print(m, file=sys.stderr))
        if found is None:
            raise CheckpointError(f"{source} holds no usable ckpt-<step>.pt")
        state, source = found
    else:
        state = ckpt_io.load_checkpoint(source)
    cfg = _saved_config(state, args.model)
    model = build_model(cfg)
    optimizer = bn_ema = None
    try:
        if "optimizer" in state:
            optimizer = build_optimizer(dataclasses.replace(cfg, optimizer_impl="chunked"), model)
            bn_ema = BufferEMA(model, cfg.ema_decay) if cfg.ema_decay else None
            load_weights(state, model, optimizer, bn_ema)
        else:
            model.load_state_dict(state["model"])
    except (KeyError, RuntimeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0]
        raise CheckpointError(f"{source} does not fit model {cfg.model_name} ({reason})") from None
    tensors, notes = export_tensors(
        cfg.model_name, model, optimizer, bn_ema, int(state["step"]), cfg.optimizer
    )
    prefix = write_checkpoint(args.out, tensors)
    for note in notes:
        print(note, file=sys.stderr)
    print(f"wrote {prefix}.index and {prefix}.data-00000-of-00001: {len(tensors)} variables of {source}")
    return prefix


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        (from_tf if args.command == "from-tf" else to_tf)(args)
    except OSError as err:  # a full disk, a permission: one line naming the file
        where = f" {err.filename}" if err.filename else ""
        print_error(FasttrainError(f"cannot read or write{where} ({err.strerror or err})"))
        return 1
    except Exception as err:
        if (code := exit_code(err)) is None:
            raise
        print_error(err)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
