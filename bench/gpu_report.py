"""summary.md of a bench.gpu_run results.json: steps, step speed side by side, optimizer, e2e, checks.

    python -m bench.gpu_report RESULTS_JSON [RESULTS_JSON ...] > summary.md

Several files (parts of the same GPU run made at different chances) are merged: rows, steps and
warm compiles of later files are added to the first's; the environment is the first's. Step-speed
columns: (f) fasttrain as its CLI runs it on CUDA (whole-step CUDA graph, the model's blocks compiled by
inductor inside it), (a) with --no-compile, (g) (f) with --pad_stem (the 4-channel stem), (e)
--no-cuda_graph --no-compile, (b) eager PyTorch (channels_last, autocast, torch.optim foreach +
foreach EMA), (d) torch.compile of (b)'s model and optimizer step, default mode, (d-max) mode
max-autotune-no-cudagraphs, (d-ro) mode reduce-overhead (torch.compile's own CUDA graphs). A cell is
the median images/s of the timed windows (min-max) and the peak
memory; compile times are reported apart. Rows profiled after their timed windows get a table of their
device time by kind of kernel (bench/step_profile.py); an inductor_bw step, its kernels' GB/s against the
copy's (bench/inductor_bw.py).
"""

from __future__ import annotations

import json
import sys

from bench.gpu_plan import EAGER
from bench.step_profile import breakdown_table

COLUMN_TITLES = {
    "a": "(a) fasttrain, graph, --no-compile",
    "f": "(f) fasttrain, graph + --compile (the CLI on CUDA)",
    "g": "(g) (f) with --pad_stem",
    "e": "(e) fasttrain, --no-cuda_graph",
    "b": "(b) eager PyTorch",
    "d": "(d) torch.compile default",
    "d-max": "(d-max) compile max-autotune-no-cudagraphs",
    "d-ro": "(d-ro) compile reduce-overhead (its own CUDA graphs)",
    "h": "(h) (a) with --bn_kernels=triton",
    "f-max": "(f-max) (f) with --compile_mode max-autotune-no-cudagraphs",
}


def column_of(row: dict) -> str:
    spec = row["spec"]
    mode = spec.get("compile_mode")
    if spec["row"] == "f":
        return "f-max" if mode == "max-autotune-no-cudagraphs" else "f"
    if spec["row"] != "d":
        return spec["row"]
    return {"default": "d", "reduce-overhead": "d-ro"}.get(mode, "d-max")


def setting_key(spec: dict) -> str:
    return f"{spec['model']}-{spec.get('precision') or 'policy'}-{spec['batch']}"


def _rate(row: dict | None) -> float | None:
    if not row or row.get("status") != "ok":
        return None
    return row["images_per_s"]["median"]


def _cell(row: dict | None) -> str:
    if row is None:
        return "not run"
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('error', '')[:80]}"
    ips = row["images_per_s"]
    mem = row.get("peak_memory_gib")
    mem_text = f", {mem:.1f} GiB" if mem is not None else ""
    return f"{ips['median']:,.0f} ({ips['min']:,.0f}-{ips['max']:,.0f}){mem_text}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def column_titles(results: dict) -> dict[str, str]:
    """COLUMN_TITLES for this run: (g) was (f) with --no-pad_stem until 2026-11-28, when --pad_stem
    became off by default and (g) became (f) with it; the rows' own stem_channels say which."""
    titles = dict(COLUMN_TITLES)
    g_rows = [r for r in results.get("rows", []) if column_of(r) == "g"]
    stems = {r.get("setting", {}).get("stem_channels") for r in g_rows}
    if stems == {3}:
        titles["g"] = "(g) (f) with --no-pad_stem"
    return titles


def speed_table(results: dict) -> list[str]:
    by_setting: dict[str, dict[str, dict]] = {}
    for row in results.get("rows", []):
        by_setting.setdefault(setting_key(row["spec"]), {})[column_of(row)] = row
    titles = column_titles(results)
    columns = [c for c in titles if any(c in cols for cols in by_setting.values())]
    if not columns:
        return ["No step-speed row ran."]
    head = ["setting", *(titles[c] for c in columns), "a / b", "a / e", "a / d", "a / d-max"]
    head += ["f / b", "f / d", "f / d-max", "f / d-ro", "f / g", "h / f", "h / d", "f-max / d-max"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    steps = results.get("steps", {})
    for key in [s["key"] for s in results.get("settings", [])] + sorted(by_setting):
        cols = by_setting.pop(key, None)
        if cols is None:
            continue
        a = _rate(cols.get("a"))
        f = _rate(cols.get("f"))
        ratios = [_ratio(a, _rate(cols.get(c))) for c in ("b", "e", "d", "d-max")]
        ratios += [_ratio(f, _rate(cols.get(c))) for c in ("b", "d", "d-max", "d-ro", "g")]
        h = _rate(cols.get("h"))
        ratios += [_ratio(h, f), _ratio(h, _rate(cols.get("d")))]
        ratios += [_ratio(_rate(cols.get("f-max")), _rate(cols.get("d-max")))]
        cells = []
        for c in columns:
            # A process that died (a CUDA error, a kill at its limit) wrote no row: say so, not "not run".
            step = steps.get(f"rows {key}" if c in EAGER else f"{c} {key}", {})
            died = c not in cols and step.get("status") in ("failed", "timed out")
            cells.append(
                f"{step['status']}: {step.get('last_line', '')[:80]}" if died else _cell(cols.get(c))
            )
        out.append("| " + " | ".join([key, *cells, *ratios]) + " |")
    out += [
        "",
        "Compile time (reported apart, never in a rate): cold in the untimed lane; warm = the timed "
        "row's build + compile from inductor's caches + warm-up.",
    ]
    for name, warm in sorted(results.get("compile_warm", {}).items()):
        cold = warm.get("compile_seconds")
        out.append(f"- {name}: {warm['status']}" + (f", cold {cold:.0f} s" if cold else ""))
    for row in results.get("rows", []):
        if row["spec"]["row"] in ("d", "f", "g") and row.get("status") == "ok":
            out.append(f"- {setting_key(row['spec'])} {column_of(row)}: warm {row['warmup_seconds']:.0f} s")
    opt = [r for r in results.get("rows", []) if r.get("optimizer") and r["spec"]["row"] == "a"]
    if opt:
        each = [
            f"{setting_key(r['spec'])} {r['optimizer']['ms']:.2f} ms, "
            f"{r['optimizer']['effective_gb_per_s']:.0f} GB/s"
            for r in opt
        ]
        out += ["", "The optimizer + EMA update alone, in (a): " + "; ".join(each)]
    return out


def profile_tables(results: dict) -> list[str]:
    """Per setting, the profiled rows' device time by kind of kernel (bench/step_profile.py)."""
    by_setting: dict[str, list[tuple[str, dict, float | None]]] = {}
    errors = []
    for record in results.get("profiles", []):  # bench.throughput's profile_record, one per row
        label = COLUMN_TITLES.get(column_of(record), column_of(record)).split(" ", 1)[0]
        key = setting_key(record["spec"])
        if record.get("profile"):
            entry = (label, record["profile"], record.get("timed_ms_per_step"))
            by_setting.setdefault(key, []).append(entry)
        elif record.get("profile_error"):
            errors.append(f"- {key} {label}: {record['profile_error'][:160]}")
    if not by_setting:
        return ["No row was profiled.", *errors]
    out = []
    order = {COLUMN_TITLES[c].split(" ", 1)[0]: i for i, c in enumerate(COLUMN_TITLES)}
    for key, rows in by_setting.items():
        rows.sort(key=lambda r: order.get(r[0], len(order)))
        out += [f"{key} ({rows[0][1]['source']}, {rows[0][1]['steps']} steps each):", ""]
        out += [*breakdown_table(rows), ""]
    return out + errors


def kernel_table(results: dict) -> list[str]:
    bench = results.get("bench_optim") or {}
    out = []
    for b in bench.get("benchmarks", []):
        info = b.get("extra_info", {})
        if "c3_over_c4" in info:  # bench/bench_stem.py
            ms, spread = info["ms"], {k: (info["min_ms"][k], info["max_ms"][k]) for k in info["ms"]}
            out += [
                f"**ResNet-50 conv1 forward + backward, batch {info['batch']}, {info['image_size']} px, "
                f"{info['dtype']}, channels_last:** 3 input channels {ms['c3']:.3f} ms "
                f"({spread['c3'][0]:.3f}-{spread['c3'][1]:.3f}), 4 (one zero) {ms['c4']:.3f} ms "
                f"({spread['c4'][0]:.3f}-{spread['c4'][1]:.3f}): a 4-channel stem would save "
                f"{info['saved_ms']:.3f} ms a step ({info['c3_over_c4']:.2f}x on the convolution).",
                "",
            ]
            continue
        if "passes_at_copy" in info:  # bench/bench_bn.py
            cells = ", ".join(
                f"{name} {ms:.3f} ms ({info['passes_at_copy'][name]:.1f} passes"
                f"{', host-bound' if name in info.get('host_bound', ()) else ''})"
                for name, ms in info["ms"].items()
            )
            add = " + add" if info["residual"] else ""
            out += [
                f"**BatchNorm{add} + ReLU forward + backward, {tuple(info['shape'])} {info['dtype']}** "
                f"(the kernels' own count: {info['kernel_passes']} passes; copy {info['copy_gb_per_s']:,.0f} "
                f"GB/s): {cells}.",
                "",
            ]
            continue
        if "interleaved" not in info:
            continue
        out.append(
            f"**{info['optimizer']} + EMA, {info['model']}** ({info['num_params'] / 1e6:.1f}M parameters, "
            f"{info['bytes_per_param']} B/param; copy {info['copy_gb_per_s']:,.0f} GB/s in the same rounds):"
        )
        out += [
            "",
            "| contender | ms/update | GB/s | of copy | vs torch foreach |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, row in info["interleaved"].items():
            vs = row["speedup_vs_torch_foreach"]
            out.append(
                f"| {name} | {row['ms_per_update']:.3f} | {row['effective_gb_per_s']:,.0f} | "
                f"{row['fraction_of_copy']:.2f} | {'-' if vs is None else f'{vs:.2f}x'} |"
            )
        out += [f"Not run: {name}: {why}" for name, why in info.get("not_run", {}).items()] + [""]
    return out or ["No optimizer kernel result."]


def e2e_lines(results: dict) -> list[str]:
    e2e = results.get("e2e")
    if not e2e:
        return ["Not run."]
    out = [
        f"Batch {e2e['batch']}, {e2e['steps']} steps, loader workers: {e2e['workers']} "
        f"on {e2e['cpu_count']} CPUs."
    ]
    loaders = ["loader-threads", "loader-threads-unfused", "loader-processes"]
    loaders += sorted(k for k in e2e if k.startswith("loader-") and k not in loaders)  # at the threshold
    for name in ("synthetic", "jpeg", "jpeg-processes", *loaders):
        run = e2e.get(name, {})
        if name.startswith("loader") and not run:
            continue  # results of a gpu_e2e without the loader-alone runs
        if "images_per_s" in run:
            cpu = run.get("cpu_ms_per_image")
            ratio = f" ({run['over_synthetic']:.2f}x synthetic)" if "over_synthetic" in run else ""
            said = f" ({run['input']})" if "input" in run else ""  # its start-up line's loader
            if not said and "loader" in run:  # a loader alone (bench/loader_alone.py)
                said = f" ({run['workers']} {run['loader']})"
            out.append(
                f"- {name}{said}: {run['images_per_s']:,.0f} images/s{ratio}"
                + (f", {cpu:.3f} CPU ms/image, {run['cpu_cores_busy']:.1f} cores busy" if cpu else "")
                + (f", input stall {run['input_stall']:.0%}" if "input_stall" in run else "")
                + (f"; {run['threads_said']}" if "threads_said" in run else "")
                + (
                    f"; threads {run['loader_busy']:.0%} busy, {run['loader_off_cpu']:.0%} of it off the CPU"
                    if "loader_busy" in run and "threads_said" not in run
                    else ""
                )
            )
        else:
            why = run.get("status") or f"exit {run.get('returncode')}"
            out.append(f"- {name}: {why}, no steady rate")
    if "cores_for_synthetic_rate" in e2e:
        out.append(
            f"- the loader's CPU: {e2e['input_cpu_ms_per_image']:.3f} ms/image; "
            f"cores for the synthetic rate: {e2e['cores_for_synthetic_rate']:.1f}"
        )
    return out


def render(results: dict) -> str:
    env = (results.get("preflight") or {}).get("environment", {})
    lines = ["# GPU run" + (" (CPU dry run)" if results.get("dry_run") else ""), ""]
    if env:
        commit = results.get("commit") or env.get("git_commit")
        lines.append(
            f"{env.get('gpu') or 'CPU'}; driver {env.get('driver')}, CUDA {env.get('cuda')}, cuDNN "
            f"{env.get('cudnn')}, torch {env.get('torch')}, Triton {env.get('triton')}, "
            f"Python {env.get('python')}, {env.get('cpu_count')} CPUs; {env.get('date')}; commit {commit}."
        )
    lines += ["", "## Steps", "", "| step | status | seconds | last line |", "| --- | --- | --- | --- |"]
    for name, s in results.get("steps", {}).items():
        last = (s.get("last_line") or s.get("reason") or "").replace("|", "/")
        lines.append(f"| {name} | {s['status']} | {s.get('seconds', '-')} | {last[:160]} |")
    lines += ["", "## Step speed (images/s, synthetic data on the device)", "", *speed_table(results)]
    lines += ["", "## Where the step's device time goes (profiled after the timed windows)", ""]
    lines += profile_tables(results)
    lines += ["", "## Fused optimizer + EMA", "", *kernel_table(results)]
    lines += ["", "## Trainer end to end on JPEG TFRecords", "", *e2e_lines(results)]
    for key, bw in (results.get("inductor_bw") or {}).items():
        from bench.inductor_bw import summary_lines  # noqa: PLC0415 (it imports the trainer's modules)

        lines += ["", f"## inductor's kernels against the copy's bandwidth, {key} (d)", ""]
        lines += summary_lines(bw)
    selfcheck = results.get("selfcheck") or {}
    lines += ["", "## selfcheck", ""]
    lines += [f"- {r['name']}: {r['status']}: {r['detail']}" for r in selfcheck.get("rows", [])] or [
        "Not run."
    ]
    return "\n".join(lines) + "\n"


def merge(parts: list[dict]) -> dict:
    merged = dict(parts[0])
    for later in parts[1:]:
        merged["rows"] = merged.get("rows", []) + later.get("rows", [])
        merged["profiles"] = merged.get("profiles", []) + later.get("profiles", [])
        merged["steps"] = {**merged.get("steps", {}), **later.get("steps", {})}
        merged["compile_warm"] = {**merged.get("compile_warm", {}), **later.get("compile_warm", {})}
        for key in ("bench_optim", "e2e", "selfcheck"):
            merged[key] = later.get(key) or merged.get(key)
    return merged


if __name__ == "__main__":
    parts = [json.loads(open(p, encoding="utf-8").read()) for p in sys.argv[1:]]
    sys.stdout.write(render(merge(parts)))
