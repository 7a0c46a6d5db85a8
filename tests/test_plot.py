"""python -m fasttrain.plot: a PNG of the curves in metrics.jsonl, runs overlaid."""

from __future__ import annotations

import json

import pytest

from fasttrain.plot import PANELS, main, plot_runs

pytest.importorskip("matplotlib")


def _write_run(run_dir, scale, resumed=False):
    run_dir.mkdir()
    lines = []
    for step in range(10, 101, 10):
        loss = scale * 2.0 / step
        lines.append(
            dict(step=step, loss=loss, loss_avg=loss * 1.1, lr=0.1 if step <= 50 else 0.01)
            | dict(examples_per_sec=100.0 * scale, train_top1=step / 200)
        )
        if step % 50 == 0:
            lines.append(dict(step=step, split="validation", top1=step / 100, top5=1.0, ema_top1=step / 110))
    if resumed:  # a run that died after step 60 and resumed from step 50 writes 60 again
        lines.insert(6, dict(step=60, loss=99.0, lr=0.01, examples_per_sec=1.0))
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")


def test_png_with_four_panels_and_each_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write_run(a, 1.0, resumed=True)
    _write_run(b, 2.0)
    out = tmp_path / "out" / "curves.png"
    fig = plot_runs([a, b], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(out) as image:
        assert image.size == (1200, 800)
        image.verify()
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert tuple(axes) == PANELS
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    for run in ("a", "b"):
        assert {f"{run} (step)", f"{run} validation", f"{run} validation EMA", f"{run} train batches"} <= set(
            lines
        )
    step_loss = lines["a (step)"]
    assert list(step_loss.get_xdata()) == list(range(10, 101, 10))
    assert 99.0 not in list(step_loss.get_ydata()), "the re-run step's record replaces the killed run's"
    assert list(lines["b validation EMA"].get_xdata()) == [50, 100]
    assert [line.get_label() for line in axes["learning rate"].get_lines()] == ["a", "b"]


def test_identical_runs_stay_visible_and_the_lr_is_a_staircase(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write_run(a, 1.0)
    _write_run(b, 1.0)  # the same curves: b drawn the same width over a hid a entirely
    fig = plot_runs([a, b], tmp_path / "curves.png")
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    under, over = lines["a (mean since last line)"], lines["b (mean since last line)"]
    assert list(under.get_ydata()) == list(over.get_ydata())
    assert under.get_linewidth() > over.get_linewidth() and under.get_zorder() < over.get_zorder()
    lr = {line.get_label(): line for line in fig.axes[1].get_lines()}["a"]
    # 0.1 up to step 50, 0.01 from step 60: drawn flat until the next log point, then a vertical drop
    assert lr.get_drawstyle() == "steps-post"
    path = lr.get_path().vertices.tolist()
    assert [50.0, 0.1] in path and [60.0, 0.1] in path and [60.0, 0.01] in path


def test_cli_default_output_and_one_line_error(tmp_path, capsys):
    a = tmp_path / "a"
    _write_run(a, 1.0)
    assert main([str(a)]) == 0
    assert (a / "curves.png").stat().st_size > 10_000
    assert main([str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl" in err


@pytest.mark.parametrize(
    "content, words",
    [
        # Each was a traceback: AttributeError/TypeError on rows that are no objects, KeyError 'step',
        # UnicodeDecodeError.
        (b'[1, 2]\n{"step": 1, "loss": 1.0}\n', "line 1 is not a metrics row"),
        (b'null\n{"step": 1, "loss": 1.0}\n', "line 1 is not a metrics row"),
        (b'{"loss": 1.0}\n{"step": 1, "loss": 1.0}\n', "line 1 is not a metrics row"),
        (b'{"step": 1, "loss": 1.0}\n\xff\xfe\n', "is not UTF-8 text"),
    ],
)
def test_metrics_that_are_no_metrics_are_one_line(tmp_path, capsys, content, words):
    (tmp_path / "metrics.jsonl").write_bytes(content)
    assert main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_an_out_that_is_no_png_path_is_refused_and_an_unwritable_one_is_one_line(tmp_path, capsys):
    run = tmp_path / "a"
    _write_run(run, 1.0)
    (tmp_path / "a_file").write_text("")
    for out in (tmp_path / "x.txt", tmp_path / "name", tmp_path):  # a ValueError; name.png and dir.png
        assert main([str(run), "--out", str(out)]) == 2
        assert f"--out {out} is not a .png file path" in capsys.readouterr().err
    assert main([str(run), "--out", str(tmp_path / "a_file" / "x.png")]) == 1  # a FileExistsError
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err and "pass --out PNG" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a_file"]
