"""The report of a bench.run run: derived figures, merging of runs, Markdown tables (bench/plot.py: the PNG).

results.json (everything below; numbers are only ever measured in this run, or are context rows):
    environment   GPU, driver, CUDA, cuDNN, torch, triton, DALI versions, CPU, date, command, commit
                  (bench/common.py's `environment`)
    rates         {"matmul": bf16 TFLOP/s (bench/mfu.py), "copy": GB/s (bench/common.py)}
    flops         {"<model>@<px>": {"counted", "nominal", "used", "source"}} per image
    rows          training rows (bench/throughput.py): spec, setting, seconds per window, images/s
                  {median, min, max, stdev}, and `derived` (added by `derive`):
                      ratio_to_b = images/s / images/s of (b), same model, batch, px and input
                      ratio_to_d = likewise for (d) (None when (d) did not run)
                      ratio_to_e = likewise for (e); on row (a) the CUDA graph's speed-up
                      mfu        = images/s x FLOP per image / (bf16 matmul TFLOP/s x 1e12)
                      optimizer_fraction_of_copy = optimizer effective GB/s / copy GB/s
    pipelines     input pipelines alone (bench/input_rows.py), with derived
                      headroom = pipeline images/s / images/s of (a) on synthetic input
    checks        GPU test and kernel-benchmark runs: status, seconds, output file
    kernels       the optimizer microbenchmarks (bench/bench_optim.py's JSON, `kernel_rows`): per
                  optimizer, parameter set and contender: ms per update, effective GB/s, fraction of
                  the copy bandwidth measured in that run, speed-up over torch-foreach
    context       published figures on other hardware (DESIGN.md), never measured here
    merged_runs   the environments of later runs merged in (`merge`)

    python -m bench.report DIR [MORE_DIR ...]   re-render DIR's results.md and throughput.png, first
                                                merging the results of MORE_DIR into DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONTEXT = [
    # (source, hardware, model, setting, images/s) as DESIGN.md quotes them: other hardware.
    ("TF 1.4 ResNet example (the ResNet seed)", "1x Tesla P40", "resnet101", "fp32, batch 32", 78),
    ("TF 1.4 ResNet example (the ResNet seed)", "4x Tesla P40", "resnet101", "fp32, batch 32/GPU", 204),
    ("NVIDIA DeepLearningExamples (PyTorch)", "1x V100", "resnet50", "AMP", 1200),
    ("NVIDIA DeepLearningExamples (PyTorch)", "1x A100", "resnet50", "AMP", 2470),
    ("NVIDIA MLPerf Training (MXNet + DALI)", "per H100", "resnet50", "heavily fused", 7000),
    ("tf_cnn_benchmarks", "1x P100", "resnet50", "fp32", 219),
    ("tf_cnn_benchmarks", "1x P100", "inception_v3", "fp32", 142),
    ("tf_cnn_benchmarks", "1x P100", "resnet152", "fp32", 92),
]


class MergeError(ValueError):
    """Results that cannot be merged (measured on another GPU)."""


def merge(old: dict, new: dict) -> dict:
    """old's results with new's rows, pipelines and checks replacing those of the same configuration."""
    if old["environment"].get("gpu") != new["environment"].get("gpu"):
        raise MergeError(
            f"{old['environment'].get('gpu') or 'CPU'} results cannot take rows measured on "
            f"{new['environment'].get('gpu') or 'the CPU'}; use another --out"
        )
    merged = dict(old)
    # Same configuration: row, model, shape and input (not flags like workers or the compile mode).
    key = lambda r: tuple(
        r["spec"][k] for k in ("row", "model", "batch", "image_size", "base_channels", "input")
    )
    for part in ("rows", "pipelines"):
        # A row this run did not measure ("not run") leaves an earlier result in place.
        had = {key(r) for r in old[part]}
        fresh = [r for r in new[part] if r["status"] != "not run" or key(r) not in had]
        replaced = {key(r) for r in fresh}
        merged[part] = [r for r in old[part] if key(r) not in replaced] + fresh
    merged["checks"] = {**old.get("checks", {}), **new.get("checks", {})}
    merged["flops"] = {**old["flops"], **new.get("flops", {})}
    if new.get("kernels"):
        merged["kernels"] = new["kernels"]
    merged["merged_runs"] = old.get("merged_runs", []) + [new["environment"]]
    return merged


def _key(spec: dict) -> tuple:
    return (spec["model"], spec["batch"], spec["image_size"], spec["input"])


def derive(results: dict) -> None:
    """Add the derived figures (see the module docstring) to results, in place."""
    rows = results["rows"]
    ok = {(_key(r["spec"]), r["spec"]["row"]): r for r in rows if r["status"] == "ok"}
    matmul = results["rates"]["matmul"]["tflop_per_s"] * 1e12
    copy = results["rates"]["copy"]["gb_per_s"]
    for r in rows:
        derived = {"ratio_to_b": None, "ratio_to_d": None, "ratio_to_e": None, "mfu": None}
        if r["status"] == "ok":
            ips = r["images_per_s"]["median"]
            for ref in ("b", "d", "e"):
                other = ok.get((_key(r["spec"]), ref))
                if other is not None:
                    derived[f"ratio_to_{ref}"] = ips / other["images_per_s"]["median"]
            flops = results["flops"][flop_key(r["spec"])]["used"]
            derived["mfu"] = ips * flops / matmul
            if "optimizer" in r:
                derived["optimizer_fraction_of_copy"] = r["optimizer"]["effective_gb_per_s"] / copy
        r["derived"] = derived
    for p in results.get("pipelines", []):
        train = ok.get(((*_key(p["spec"])[:3], "synthetic"), "a"))
        headroom = None
        if p["status"] == "ok" and train is not None:
            headroom = p["images_per_s"]["median"] / train["images_per_s"]["median"]
        p["derived"] = {"headroom": headroom}


def flop_key(spec: dict) -> str:
    suffix = "" if spec.get("base_channels", 64) == 64 else f"/w{spec['base_channels']}"
    return f"{spec['model']}{suffix}@{spec['image_size']}"


# --- Markdown -----------------------------------------------------------------------------------


def fmt_rate(x: float | None) -> str:
    """Images/s and GB/s as printed in the tables."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _setting(r: dict) -> str:
    s = r.get("setting", {})
    if not s:
        return ""
    parts = [s["precision"], "channels_last" if s["channels_last"] else "NCHW"]
    parts += ["CUDA graph"] if s["cuda_graph"] else []
    parts += [s["optimizer"]] + ([s["compile"]] if "compile" in s else [])
    return ", ".join(parts)


def _status(r: dict) -> str:
    if r["status"] == "ok":
        return ""
    return f"{r['status']}: {r.get('error', '')}".replace("|", "/")


def markdown(results: dict) -> str:
    env, rates = results["environment"], results["rates"]
    where = env.get("gpu") or f"CPU ({env['cpu']}, {env['torch_threads']} threads)"
    lines = [
        f"# fasttrain throughput: {where}, {env['date'][:10]}",
        "",
        f"`{env['command']}` at commit {env.get('git_commit') or 'unknown'}"
        + (" (smoke configuration: tiny sizes, not a performance claim)" if results["smoke"] else ""),
        "",
        "| | |\n| --- | --- |",
    ]
    keys = ("gpu", "driver", "cuda", "cudnn", "torch", "triton", "dali", "cpu", "cpu_count", "python")
    lines += [f"| {k} | {env[k]} |" for k in keys if env.get(k) is not None]
    lines += [
        f"| bf16 matmul (measured, n={rates['matmul']['n']}) | "
        f"{rates['matmul']['tflop_per_s']:.3g} TFLOP/s |",
        f"| device copy (measured, read + write) | {fmt_rate(rates['copy']['gb_per_s'])} GB/s |",
        "",
        "## Training throughput",
        "",
        "Images/s: median of the timed windows after warm-up (min-max in brackets); every row trains",
        "the same model, batch, loss, L2 decay and weight + BN-statistics EMA. Rows: "
        + "; ".join(f"({k}) {v}" for k, v in results["row_titles"].items())
        + ". MFU: images/s x training FLOPs per image / the measured bf16 matmul rate.",
        "",
        "| model | batch | px | input | row | images/s | min-max | vs (b) | vs (d) | MFU | setting |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    inputs = ("synthetic", "dali", "torch")
    order = lambda r: (
        r["spec"]["model"],
        r["spec"]["batch"],
        inputs.index(r["spec"]["input"]),
        r["spec"]["row"],
    )
    for r in sorted(results["rows"], key=order):  # by configuration, then (a), (b), (c), (d)
        s, d = r["spec"], r["derived"]
        if r["status"] == "ok":
            ips = r["images_per_s"]
            cells = [fmt_rate(ips["median"]), f"{fmt_rate(ips['min'])}-{fmt_rate(ips['max'])}"]
            cells += [_ratio(d["ratio_to_b"]), _ratio(d["ratio_to_d"]), _pct(d["mfu"]), _setting(r)]
        else:
            cells = ["-", "-", "-", "-", "-", _status(r)]
        model = s["model"] + ("" if s["base_channels"] == 64 else f" (width {s['base_channels']})")
        lines.append(
            f"| {model} | {s['batch']} | {s['image_size']} | {s['input']} | ({s['row']}) | "
            + " | ".join(cells)
            + " |"
        )
    lines += _graph_table(results) + _optimizer_table(results) + _kernel_table(results)
    lines += _pipeline_table(results)
    lines += _checks(results) + _context()
    return "\n".join(lines) + "\n"


def _graph_table(results: dict) -> list[str]:
    """Row (a) next to row (e): the same fasttrain step with and without the CUDA graph."""
    pairs = [r for r in results["rows"] if r["spec"]["row"] == "a" and r["derived"].get("ratio_to_e")]
    if not pairs:
        return []
    ok = {(_key(r["spec"]), r["spec"]["row"]): r for r in results["rows"] if r["status"] == "ok"}
    lines = [
        "",
        "## CUDA graph on and off",
        "",
        "Row (a) and row (e) are the same fasttrain step (model, precision, fused optimizer, device LR",
        "and loss scale); (e) runs it eagerly, (a) replays it as one CUDA graph.",
        "",
        "| model | batch | px | input | graph (a) images/s | eager (e) images/s | graph speed-up |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in pairs:
        s, e = r["spec"], ok[(_key(r["spec"]), "e")]
        lines.append(
            f"| {s['model']} | {s['batch']} | {s['image_size']} | {s['input']} | "
            f"{fmt_rate(r['images_per_s']['median'])} | {fmt_rate(e['images_per_s']['median'])} | "
            f"{_ratio(r['derived']['ratio_to_e'])} |"
        )
    return lines


def kernel_rows(bench_json: dict) -> list[dict]:
    """bench/bench_optim.py's pytest-benchmark JSON as report rows, with the speed-up of each contender
    over torch-foreach (torch.optim foreach + foreach EMA) on the same optimizer and parameter set."""
    keys = ("optimizer", "contender", "model", "num_params", "width_divisor", "ms_per_update")
    keys += ("effective_gb_per_s", "copy_gb_per_s", "fraction_of_copy")
    rows = [
        {k: b["extra_info"][k] for k in keys} for b in bench_json.get("benchmarks", []) if b["extra_info"]
    ]
    baseline = {(r["optimizer"], r["model"]): r for r in rows if r["contender"] == "torch-foreach"}
    for r in rows:
        base = baseline.get((r["optimizer"], r["model"]))
        r["speedup_vs_torch_foreach"] = None if base is None else base["ms_per_update"] / r["ms_per_update"]
    return rows


def _kernel_table(results: dict) -> list[str]:
    rows = results.get("kernels", [])
    if not rows:
        return []
    lines = [
        "",
        "## Optimizer kernels (bench/bench_optim.py)",
        "",
        "One update of every parameter + the weight EMA on the parameter set of the model; effective",
        "GB/s counts the minimum traffic (RMSProp+EMA 36 B/param, Momentum+EMA 28 B/param) and is",
        "compared with the device copy bandwidth measured in the same benchmark run. Targets on a GPU:",
        ">= 85% of copy bandwidth and >= 4x torch-foreach (torch.optim foreach=True + _foreach_lerp_ EMA).",
        "",
        "| optimizer | params of | contender | params | ms | effective GB/s | of copy | vs torch-foreach |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["optimizer"], r["model"], r["ms_per_update"])):
        width = "" if r["width_divisor"] == 1 else f" (width / {r['width_divisor']})"
        lines.append(
            f"| {r['optimizer']}+EMA | {r['model']}{width} | {r['contender']} | "
            f"{r['num_params'] / 1e6:.2f} M | {r['ms_per_update']:.3f} | "
            f"{fmt_rate(r['effective_gb_per_s'])} | {_pct(r['fraction_of_copy'])} | "
            f"{_ratio(r['speedup_vs_torch_foreach'])} |"
        )
    return lines


def _optimizer_table(results: dict) -> list[str]:
    rows = [r for r in results["rows"] if r["status"] == "ok" and "optimizer" in r]
    if not rows:
        return []
    lines = [
        "",
        "## Optimizer step alone",
        "",
        "One update of every parameter (optimizer + weight EMA); effective GB/s counts the minimum",
        "traffic of a one-pass update (RMSProp+EMA 36 B/param, Momentum+EMA 28 B/param), compared with",
        "the measured device copy bandwidth.",
        "",
        "| model | row | optimizer | params | ms | effective GB/s | of copy bandwidth |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        o = r["optimizer"]
        lines.append(
            f"| {r['spec']['model']} | ({r['spec']['row']}) | {r['setting']['optimizer']} | "
            f"{o['num_params'] / 1e6:.2f} M | {o['ms']:.3f} | {fmt_rate(o['effective_gb_per_s'])} | "
            f"{_pct(r['derived'].get('optimizer_fraction_of_copy'))} |"
        )
    return lines


def _pipeline_table(results: dict) -> list[str]:
    pipes = results.get("pipelines", [])
    if not pipes:
        return []
    data = results.get("data", {})
    source = (
        f"synthetic JPEGs ({data.get('image_px')} px, mean {data.get('mean_jpeg_bytes')} B; not ImageNet)"
        if data.get("synthetic")
        else f"--data_dir {data.get('data_dir')}"
    )
    lines = [
        "",
        "## Input pipeline alone",
        "",
        f"Data: {source}. Headroom = pipeline images/s / training images/s of (a) on synthetic input.",
        "",
        "| model | batch | px | backend | workers | images/s | min-max | headroom | status |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for p in pipes:
        s = p["spec"]
        ips = p.get("images_per_s")
        cells = (
            [fmt_rate(ips["median"]), f"{fmt_rate(ips['min'])}-{fmt_rate(ips['max'])}"] if ips else ["-", "-"]
        )
        head = p["derived"]["headroom"]
        lines.append(
            f"| {s['model']} | {s['batch']} | {s['image_size']} | {_backend(s['input'])} | "
            f"{'1 thread' if s['input'] == 'nvjpeg' else s['num_workers']} | "
            + " | ".join(cells)
            + f" | {'-' if head is None else f'{head:.2f}'} | {_status(p) or _shared(p)} |"
        )
    return lines


def _backend(name: str) -> str:
    return "nvjpeg (torchvision; decode + crop + resize only)" if name == "nvjpeg" else name


def _shared(p: dict) -> str:
    return f"same pipeline setting as {p['measured_for']}" if "measured_for" in p else ""


def _checks(results: dict) -> list[str]:
    checks = results.get("checks", {})
    if not checks:
        return []
    lines = ["", "## GPU checks", "", "| check | status | seconds | output |", "| --- | --- | ---: | --- |"]
    for name, c in checks.items():
        lines.append(f"| {name} | {c['status']} | {c.get('seconds', 0):.0f} | {c.get('output', '')} |")
    return lines


def _context() -> list[str]:
    lines = [
        "",
        "## Context: published figures on other hardware (not measured here)",
        "",
        "| source | hardware | model | setting | images/s |",
        "| --- | --- | --- | --- | ---: |",
    ]
    lines += [f"| {s} | {h} (other hardware) | {m} | {st} | {v:,} |" for s, h, m, st, v in CONTEXT]
    return lines


def write(results: dict, out: Path, plot_too: bool = True) -> None:
    """Derive, then write results.json (atomically: a run cut short keeps the last whole file),
    results.md and, with plot_too, throughput.png to out."""
    derive(results)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    tmp.replace(out / "results.json")
    (out / "results.md").write_text(markdown(results), encoding="utf-8")
    if plot_too:
        from bench.plot import plot  # matplotlib: only when a plot is asked for

        plot(results, out / "throughput.png")


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m bench.report DIR [MORE_DIR ...]", file=sys.stderr)
        return 2
    out = Path(argv[0])
    results = json.loads((out / "results.json").read_text())
    for more in argv[1:]:
        try:
            results = merge(results, json.loads((Path(more) / "results.json").read_text()))
        except MergeError as exc:
            print(f"bench.report: {more}: {exc}", file=sys.stderr)
            return 2
    write(results, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
