"""Training curves as a picture, from metrics.jsonl, for when no TensorBoard is at hand.

  python -m fasttrain.plot RUN_DIR [RUN_DIR ...] [--out PNG]

One PNG (default RUN_DIR/curves.png of the first run) with four panels against the optimizer step:
loss (each step's, and the mean since the previous log line), learning rate, images/s, and top-1
(validation raw and EMA, and the training batches'). Several runs are overlaid, one colour each, each
run's lines drawn thinner than the previous run's, so runs with identical curves (the same seed, a
copied run) stay visible as a band around a line instead of the last one covering the others. The
learning rate is drawn as steps holding each logged value until the next log line: the seeds'
schedules are staircases (exponential with staircase=True, piecewise), which a straight line between
log points would show as slopes.
Needs matplotlib (pip install 'fasttrain[plot]').
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fasttrain.cli_parser import Parser

PANELS = ("loss", "learning rate", "images/s", "top-1")


class PlotError(RuntimeError):
    """A run directory without readable metrics, or no matplotlib: printed in one line."""


def read_metrics(run_dir: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """(log records, evaluation records) by step; a step written twice (a resumed run redoing the steps
    after its checkpoint, or the evaluator after the trainer) keeps its last record."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PlotError(f"cannot read {path} ({exc.strerror}); name a run directory (--train_dir)") from None
    except UnicodeDecodeError as exc:
        raise PlotError(f"{path} is not UTF-8 text (byte {exc.start}): not a run's metrics") from None
    train, evals = {}, {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):  # the last line of a run killed while writing it
                continue
            raise PlotError(f"{path} line {number} is not JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise PlotError(f"{path} line {number} is not a metrics row (a JSON object with its step)")
        if "loss" in record:
            train[record["step"]] = record
        elif record.get("split") == "validation":
            evals[record["step"]] = record
    if not train and not evals:
        raise PlotError(f"{path} holds no log step yet")
    return train, evals


def _series(records: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    steps = [s for s in sorted(records) if records[s].get(key) is not None]
    return steps, [records[s][key] for s in steps]


def plot_runs(run_dirs: list[Path], out: Path):
    """Write the PNG; returns the matplotlib figure (closed), for tests to inspect."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("python -m fasttrain.plot needs matplotlib: pip install 'fasttrain[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    ax_loss, ax_lr, ax_speed, ax_top1 = axes.flat
    for ax, title in zip(axes.flat, PANELS):
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run_dir in enumerate(run_dirs):
        train, evals = read_metrics(run_dir)
        colour, name = colours[i % len(colours)], Path(run_dir).name or str(run_dir)
        width = 1.5 + 2.0 * (len(run_dirs) - 1 - i)  # the first run widest, underneath
        line = dict(color=colour, linewidth=width, zorder=2 + i)
        ax_loss.plot(*_series(train, "loss"), **line, alpha=0.35, label=f"{name} (step)")
        ax_loss.plot(*_series(train, "loss_avg"), **line, label=f"{name} (mean since last line)")
        ax_lr.step(*_series(train, "lr"), where="post", **line, label=name)
        ax_speed.plot(*_series(train, "examples_per_sec"), **line, label=name)
        ax_top1.plot(*_series(evals, "top1"), "o-", **line, label=f"{name} validation")
        ax_top1.plot(*_series(evals, "ema_top1"), "s--", **line, label=f"{name} validation EMA")
        ax_top1.plot(*_series(train, "train_top1"), ":", **line, alpha=0.6, label=f"{name} train batches")
    ax_top1.set_ylim(-0.02, 1.02)
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100, format="png")
    except OSError as exc:
        raise PlotError(f"cannot write {out} ({exc.strerror}); pass --out PNG somewhere writable") from None
    finally:
        plt.close(fig)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m fasttrain.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=None, help="the PNG (default: RUN_DIR/curves.png)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out or args.run_dirs[0] / "curves.png"
    if out.suffix.lower() != ".png" or out.is_dir():  # savefig wrote name.png beside a path without one
        sys.stderr.write(f"fasttrain.plot: error: --out {out} is not a .png file path\n")
        return 2
    try:
        plot_runs(args.run_dirs, out)
    except PlotError as err:
        sys.stderr.write(f"fasttrain.plot: error: {err}\n")
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
