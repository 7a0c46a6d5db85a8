"""How close inductor's kernels run to the GPU's memory bandwidth in one training step, kernel by kernel.

The compile-in-graph issue's open question. At ResNet-50 bf16 batch 256 on an H200 (the third GPU run,
bench/results/2026-11-28-h200-third-run/), inductor's fused BatchNorm / ReLU / add / max-pool kernels
took 21.0 ms of a 38 ms step in (f) fasttrain --compile and in (d) torch.compile alike: one bf16 pass
over the BatchNorm layers' outputs is 5.7 GB there, so 21 ms is about 15 passes at the 4.2 TB/s the
copy ran at, where training BN + ReLU needs about 8 (forward: statistics 1 read, apply 1 read + 1
write; backward: reduction 2 reads, apply 2 reads + 1 write). Either the kernels move more bytes than
that, or they move them slower than a copy; the two call for different work (fewer passes: the
statistics into the convolution's epilogue, cuDNN's runtime fusion; slower: hand-written BN kernels).
This measures which.

    python -m bench.inductor_bw --spec JSON --out FILE.json [--steps 2]

Method: inductor's own bandwidth profiler (torch._inductor.config.profile_bandwidth, what the
environment's TORCHINDUCTOR_PROFILE=1 sets), switched on before the row is built. Each Triton kernel
inductor generates then times its first call with triton's do_bench and reports it with the bytes
inductor counts for it (its inputs and outputs, each once: the least traffic the kernel can have);
every call of a compiled graph appends its kernels' lines to profile_bandwidth_output, parsed here
(parse_report). The row is (d), torch.compile of eager PyTorch (bench/row_steps.py): its compiled
graphs run eagerly, as the profiler's timing needs (it synchronizes, which a CUDA graph capture
refuses), and the third run's profile found the same inductor time in (d) as in (f).

Caveat: a profiled kernel runs only while it is timed (its first call); later calls append the cached
time and launch nothing, so the profiled steps compute nothing meaningful: they are a measurement, not
training. The convolutions (cuDNN, cuBLAS) are not inductor's and are not in the report.

Output (JSON): every kernel (its graph's file, its name, ms and GB per step, GB/s, calls per step),
the totals, the same process's device copy rate (bench.common.copy_bandwidth), and one bf16 pass over
the BatchNorm layers' outputs per step (bn_pass_gb), from which:
    passes       = inductor's GB per step / bn_pass_gb
    of_copy      = inductor's GB/s / the copy's GB/s
    ms_at_copy   = inductor's GB per step at the copy's rate (what the same bytes would take at best)
On the CPU (the dry run) inductor writes C++, not Triton: no kernel is reported, the plumbing runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from bench.common import copy_bandwidth, environment, synchronize
from bench.row_steps import RowSpec, build_row, config_for
from bench.throughput import input_stream

# One kernel line of torch/_inductor/runtime/triton_heuristics.py's end_graph (create_bandwidth_info_str
# with the percentage and the name as its suffix): "0.123ms    \t0.456 GB \t 3700.00GB/s \t 12.34% \t name"
_LINE = re.compile(r"^\s*([\d.]+)ms\s+([\d.]+) GB\s+([\d.]+)GB/s\s+[\d.]+%\s+(\S+)\s*$")
_HEADER = re.compile(r"^TRITON KERNELS BANDWIDTH INFO \((.*)\)\s*$")
# Kinds by the prefix inductor names its kernels with: pointwise, (looped) reduction, persistent
# reduction, foreach (the compiled optimizer), templates (matmuls and convolutions it generates).
KINDS = (("triton_poi", "pointwise"), ("triton_red", "reduction"), ("triton_per", "persistent reduction"),
         ("triton_for", "foreach"), ("triton_tem", "template"))  # fmt: skip
TOP = 30


def kind_of(name: str) -> str:
    return next((kind for prefix, kind in KINDS if name.startswith(prefix)), "other")


def parse_report(text: str) -> list[dict]:
    """Every kernel call in a profile_bandwidth_output file: graph (the compiled module's file), name,
    ms, gb. Lines this format does not know are skipped (a SUMMARY line, a separator)."""
    calls, graph = [], ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            graph = Path(header.group(1)).name
            continue
        match = _LINE.match(line)
        if match:
            ms, gb, _, name = match.groups()
            calls.append(dict(graph=graph, name=name, ms=float(ms), gb=float(gb)))
    return calls


def summarize_calls(calls: Iterable[dict], steps: int, bn_pass_gb: float, copy_gb_per_s: float) -> dict:
    """Per kernel (graph, name): ms and GB per step, GB/s, calls per step; the totals and the ratios
    of the module docstring."""
    kernels: dict[tuple[str, str], dict] = {}
    for call in calls:
        k = kernels.setdefault(
            (call["graph"], call["name"]), dict(graph=call["graph"], name=call["name"], ms=0.0, gb=0.0, n=0)
        )
        k["ms"] += call["ms"]
        k["gb"] += call["gb"]
        k["n"] += 1
    rows = []
    for k in sorted(kernels.values(), key=lambda k: -k["ms"]):
        rows.append(
            dict(
                graph=k["graph"], name=k["name"], kind=kind_of(k["name"]), ms_per_step=k["ms"] / steps,
                gb_per_step=k["gb"] / steps, gb_per_s=k["gb"] / (k["ms"] / 1e3) if k["ms"] else 0.0,
                calls_per_step=k["n"] / steps,
            )
        )  # fmt: skip
    ms = sum(r["ms_per_step"] for r in rows)
    gb = sum(r["gb_per_step"] for r in rows)
    by_kind: dict[str, dict] = {}
    for r in rows:
        entry = by_kind.setdefault(r["kind"], dict(ms_per_step=0.0, gb_per_step=0.0))
        entry["ms_per_step"] += r["ms_per_step"]
        entry["gb_per_step"] += r["gb_per_step"]
    for entry in by_kind.values():
        ms_kind = entry["ms_per_step"]
        entry["gb_per_s"] = entry["gb_per_step"] / (ms_kind / 1e3) if ms_kind else 0.0
    totals = dict(ms_per_step=ms, gb_per_step=gb, gb_per_s=gb / (ms / 1e3) if ms else 0.0)
    if copy_gb_per_s:
        totals["of_copy"] = totals["gb_per_s"] / copy_gb_per_s
        totals["ms_at_copy"] = gb / copy_gb_per_s * 1e3
    if bn_pass_gb:
        totals["passes"] = gb / bn_pass_gb
    return dict(kernels=rows, by_kind=by_kind, totals=totals)


def bn_pass_gb(spec: RowSpec, device: torch.device, element_bytes: int) -> float:
    """GB of one pass over every BatchNorm layer's output at the row's batch: the model traced on the
    meta device (shapes only) with a hook on each module that has running statistics."""
    from fasttrain.run import build_model  # noqa: PLC0415

    cfg = config_for(spec, device)
    with torch.device("meta"):
        model = build_model(cfg).eval()
    elements = [0]

    def count(_module, _inputs, output) -> None:
        elements[0] += output.numel()

    for module in model.modules():
        if isinstance(getattr(module, "running_mean", None), torch.Tensor):
            module.register_forward_hook(count)
    with torch.no_grad():
        model(torch.empty(1, 3, spec.image_size, spec.image_size, device="meta"))
    return elements[0] * spec.batch * element_bytes / 1e9


def measure(spec: RowSpec, device: torch.device, steps: int, report: Path) -> dict:
    """Build row (d) with the profiler on, warm it up (compile; each kernel's timed first call), then
    parse what `steps` more steps report."""
    from torch._inductor import config as inductor_config  # noqa: PLC0415

    inductor_config.profile_bandwidth = True
    inductor_config.profile_bandwidth_regex = ""
    inductor_config.profile_bandwidth_output = str(report)
    # Else inductor also runs each graph it compiles once on random inputs to report it, and random
    # indices fail the loss's scatter ("index -17 is out of bounds").
    inductor_config.benchmark_harness = False
    t0 = time.perf_counter()
    next_batch = input_stream(spec, device)
    row = build_row(dataclasses.replace(spec, row="d"), device)
    for _ in range(1 + row.extra_warmup):
        row.step(*next_batch())
    synchronize(device)
    warmup_seconds = time.perf_counter() - t0
    report.write_text("")  # from here on, the measured steps' calls only
    for _ in range(steps):
        row.step(*next_batch())
    synchronize(device)
    calls = parse_report(report.read_text() if report.exists() else "")
    element_bytes = 4 if row.setting["precision"] == "fp32" else 2
    copy, one_pass = copy_bandwidth(device)["gb_per_s"], bn_pass_gb(spec, device, element_bytes)
    result = summarize_calls(calls, steps, one_pass, copy)
    result.update(
        spec=dataclasses.asdict(spec), setting=row.setting, steps=steps, warmup_seconds=warmup_seconds,
        copy_gb_per_s=copy, bn_pass_gb=one_pass,
    )  # fmt: skip
    if not calls:
        result["note"] = (
            "no Triton kernel reported: inductor's code for this device is not Triton (the CPU's is C++)"
            if device.type != "cuda"
            else "no Triton kernel reported"
        )
    return result


def summary_lines(result: dict) -> list[str]:
    """Markdown: the totals against the copy and the BN passes, then the TOP kernels."""
    t = result["totals"]
    if not result["kernels"]:
        return [f"No inductor kernel reported ({result.get('note', '')})."]
    out = [
        f"inductor's kernels: {t['ms_per_step']:.2f} ms and {t['gb_per_step']:.2f} GB per step, "
        f"{t['gb_per_s']:,.0f} GB/s ({t.get('of_copy', 0):.2f} of the copy's "
        f"{result['copy_gb_per_s']:,.0f} GB/s; the same bytes at the copy's rate: "
        f"{t.get('ms_at_copy', 0):.2f} ms); {t.get('passes', 0):.1f} passes over the BatchNorm "
        f"outputs ({result['bn_pass_gb']:.2f} GB a pass).",
        "",
        "| kind | ms/step | GB/step | GB/s |",
        "| --- | --- | --- | --- |",
    ]
    for kind, e in sorted(result["by_kind"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
        out.append(f"| {kind} | {e['ms_per_step']:.2f} | {e['gb_per_step']:.2f} | {e['gb_per_s']:,.0f} |")
    out += ["", "| kernel (graph) | calls | ms/step | GB/step | GB/s |", "| --- | --- | --- | --- | --- |"]
    for k in result["kernels"][:TOP]:
        out.append(
            f"| {k['name']} ({k['graph'][:12]}) | {k['calls_per_step']:g} | {k['ms_per_step']:.3f} | "
            f"{k['gb_per_step']:.3f} | {k['gb_per_s']:,.0f} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inductor_bw", description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help="RowSpec as JSON (its row is ignored: (d) is run)")
    parser.add_argument("--out", required=True, help="the result, a JSON file")
    parser.add_argument("--steps", type=int, default=2, help="steps measured after the warm-up (default 2)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    spec = RowSpec(**{"compile_mode": "default", **json.loads(args.spec), "row": "d"})
    device = torch.device(args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = measure(spec, device, args.steps, out.with_suffix(".report.txt"))
    result["environment"] = environment(device, [sys.argv[0], *(argv or sys.argv[1:])])
    out.write_text(json.dumps(result, indent=1))
    print("\n".join(summary_lines(result)[:1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
