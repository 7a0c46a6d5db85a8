"""The throughput suite in one command: fasttrain next to the alternatives, measured in one run.

On a GPU machine run `python -m fasttrain selfcheck` first: it says in a minute or two whether each
fast path measured here (Triton kernels, CUDA-graph step, buckets, DALI) is correct on that machine.

    python -m bench.run                     GPU: the full suite (~9 min on one H200); CPU: --smoke
    python -m bench.run --smoke --out DIR   the tiny CPU configuration CI runs (seconds; 1 thread)
    python -m bench.run --parts compile --merge --out DIR     add (d) rows to an earlier run's DIR

(from the repository root, so that `bench` and this checkout's fasttrain are the ones imported; the
flags and their defaults: bench/run_args.py)

Parts, in this order, each under its share of --time_budget (time a part leaves unused passes on;
whatever does not fit is recorded as skipped, never estimated):
    gpu_tests  python -m pytest -m gpu tests -v           (CUDA only; output in gpu_tests.txt)
    rows       rows (a), (b), (c), (e) of bench/row_steps.py on synthetic device input, for every
               model x batch; the optimizer step alone at each model's first batch
    pipeline   the input pipelines alone (torch, DALI when it imports, and on CUDA nvJPEG decoding
               through torchvision when it imports) and training rows fed by the loaders
               (--pipeline_rows), at each model's largest batch, on --data_dir or a synthetic set
    kernels    python -m pytest bench/bench_optim.py      (CUDA only; bench_optim.txt / .json)
    compile    row (d), each configuration in its own subprocess under --compile_timeout, started
               only while that much of the budget is left (a compile cut short measures nothing)
Before them: the environment and copy bandwidth (bench/common.py), the measured bf16 matmul rate and
FLOPs per image (bench/mfu.py).

Output in --out (default ~/.cache/fasttrain/bench/<date>-<gpu>/, outside the checkout, so that a trial
run never leaves files in the repository; pass --out bench/results/<date>-<gpu> to keep a run there):
results.json (bench/report.py documents it), results.md, throughput.png, run.log, and the parts'
outputs. results.json and results.md are rewritten after every part, so a run cut short keeps what
it measured.
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from bench import report
from bench.common import copy_bandwidth, environment, run_limited
from bench.input_rows import nvjpeg_rate, pipeline_data, pipeline_rate
from bench.mfu import matmul_rate, training_flops
from bench.row_steps import ROW_TITLES, RowSpec, config_for
from bench.run_args import UsageError, configurations, parse_args
from bench.throughput import MeasureOptions, measure_row
from fasttrain.data import dali_available

# Share of --time_budget each part may use at most; compile gets whatever is left at the end.
PART_SHARE = {"gpu_tests": 0.3, "rows": 0.35, "pipeline": 0.2, "kernels": 0.1}


def _has_torchvision() -> bool:
    try:
        import torchvision.io  # noqa: F401
    except Exception:  # not installed, or built against another torch
        return False
    return True


class Suite:
    """Runs the parts into one results dict and writes it after each of them."""

    def __init__(self, args, argv: list[str]):
        self.args = args
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.start = time.monotonic()
        self._allotted = 0.0  # share of the budget given to the parts run so far
        env = environment(self.device, ["-m", "bench.run", *argv])
        self.out = Path(args.out) if args.out else default_out_dir(env)
        earlier = self.out / "results.json"
        if args.merge and earlier.exists():  # fail now, not after the run, if it was another GPU
            try:
                report.merge(json.loads(earlier.read_text()), dict(environment=env, rows=[], pipelines=[]))
            except report.MergeError as exc:
                raise UsageError(f"--merge: {exc}") from None
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.out / "run.log", "a", encoding="utf-8")
        self.results = dict(
            environment=env, smoke=args.smoke, row_titles=ROW_TITLES, rates={}, flops={},
            rows=[], pipelines=[], checks={}, context=[list(c) for c in report.CONTEXT],
        )  # fmt: skip

    def log(self, text: str) -> None:
        line = f"[{time.monotonic() - self.start:6.1f} s] {text}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def remaining(self) -> float:
        return self.args.time_budget - (time.monotonic() - self.start)

    def deadline(self, part: str) -> float:
        """When `part` must stop. The shares of the parts run so far add up, so time that one part
        leaves unused passes on to the next."""
        self._allotted += PART_SHARE[part]
        return self.start + self._allotted * self.args.time_budget

    def opts(self, **overrides) -> MeasureOptions:
        a = self.args
        base = dict(warmup=a.warmup, repeats=a.repeats, steps=a.steps, target_seconds=0.3)
        if a.smoke:
            base["optimizer_calls"] = 3
        return MeasureOptions(**{**base, **overrides})

    def spec(self, row: str, config, **extra) -> RowSpec:
        model, batch, size, width = config
        return RowSpec(row, model, batch, size, width, num_workers=self.args.num_workers, **extra)

    # --- parts ---------------------------------------------------------------------------------

    def yardsticks(self) -> None:
        rates = self.results["rates"]
        rates["matmul"] = matmul_rate(self.device)
        rates["copy"] = copy_bandwidth(self.device)
        self.log(
            f"bf16 matmul {rates['matmul']['tflop_per_s']:.3g} TFLOP/s, "
            f"copy {rates['copy']['gb_per_s']:.1f} GB/s"
        )
        for model, _, size, width in configurations(self.args):
            key = report.flop_key(dict(model=model, image_size=size, base_channels=width))
            if key not in self.results["flops"]:
                self.results["flops"][key] = training_flops(model, size, width)

    def rows(self, deadline: float) -> None:
        first_of_model = set()
        for config in configurations(self.args):
            timing_optimizer = config[0] not in first_of_model
            first_of_model.add(config[0])
            # fasttrain's own rows first: a run that runs out of time loses a baseline, not the headline.
            for row in [r for r in ("a", "e", "b", "c") if r in self.args.rows]:
                self.add_row(self.spec(row, config), self.opts(optimizer=timing_optimizer), deadline)

    def pipeline(self, deadline: float, data_dir: str) -> None:
        largest = {}
        for config in configurations(self.args):
            largest[config[0]] = max(largest.get(config[0], config), config, key=lambda c: c[1])
        backends = ["torch"] + (["dali"] if dali_available() else [])
        # GPU decoding for machines without DALI: nvJPEG through torchvision,
        # decode + crop + resize alone (input_rows.nvjpeg_rate), not a loader that feeds training.
        alone = backends + (["nvjpeg"] if self.device.type == "cuda" and _has_torchvision() else [])
        # DataLoader workers each build whole batches, so batches arrive in waves of `workers`:
        # warm up past the first wave and time windows spanning two, or the queue inflates the rate.
        workers, smoke = self.args.num_workers, self.args.smoke
        wave = (
            dict(warmup=2, repeats=3, batches=3)
            if smoke
            else dict(warmup=max(4, 2 * workers), repeats=3, batches=max(6, 2 * workers))
        )
        fed = (
            self.opts(repeats=3)
            if smoke
            else self.opts(repeats=3, warmup=self.args.warmup + 2 * workers, target_seconds=2.0)
        )
        measured = {}  # the pipeline does not depend on the model: measure each setting once
        for config in largest.values():
            for backend in alone:
                spec = self.spec("a", config, input=backend, data_dir=data_dir)
                cfg = config_for(dataclasses.replace(spec, input="torch"), self.device)  # the recipe's
                setting = (backend, cfg.preprocess, cfg.color_distort, spec.image_size, spec.batch)
                if setting in measured:
                    result = dict(
                        measured[setting], spec=vars(spec), measured_for=measured[setting]["spec"]["model"]
                    )
                elif time.monotonic() > deadline:
                    result = dict(spec=vars(spec), status="skipped", error="time budget")
                elif backend == "nvjpeg":
                    # No worker waves here: a few batches past cuda/nvJPEG start-up suffice.
                    result = measured[setting] = nvjpeg_rate(spec, self.device, data_dir, 3, 3, 5)
                else:
                    result = measured[setting] = pipeline_rate(spec, self.device, **wave)
                self.results["pipelines"].append(result)
                self.log(f"pipeline {backend} {config[:3]}: {self._summary(result)}")
        # Training fed by a pipeline: each --pipeline_rows pair for every model before the next pair,
        # so that a run short of time loses the last pairs, not the last model.
        for row, backend in self.args.pipeline_rows:
            for config in largest.values():
                spec = self.spec(row, config, input=backend, data_dir=data_dir)
                if backend in backends:
                    self.add_row(spec, fed, deadline)
                else:  # said in the report, not left out silently
                    why = "NVIDIA DALI is not installed here"
                    self.results["rows"].append(
                        dict(spec=vars(spec), title=ROW_TITLES[row], status="not run", error=why)
                    )

    def add_row(self, spec: RowSpec, opts: MeasureOptions, deadline: float) -> None:
        name = f"({spec.row}) {spec.model} batch {spec.batch} {spec.image_size}px {spec.input}"
        if time.monotonic() > deadline:
            result = dict(spec=vars(spec), title=ROW_TITLES[spec.row], status="skipped", error="time budget")
        else:
            result = measure_row(spec, self.device, opts)
        self.results["rows"].append(result)
        self.log(f"{name}: {self._summary(result)}")

    def compile_rows(self) -> None:
        # Largest batch first: the configuration that matters most for throughput claims.
        configs = sorted(configurations(self.args), key=lambda c: -c[1])
        for config in configs:
            spec = self.spec("d", config, compile_mode=self.args.compile_mode)
            left = self.remaining() - 10
            name = f"(d) {spec.model} batch {spec.batch} {spec.image_size}px"
            if left < self.args.compile_timeout:
                # A compile cut short measures nothing: start one only with its whole allowance.
                why = f"time budget ({left:.0f} s left, --compile_timeout {self.args.compile_timeout:.0f} s)"
                result = dict(spec=vars(spec), title=ROW_TITLES["d"], status="skipped", error=why)
            else:
                result = self._compile_subprocess(spec, self.args.compile_timeout)
            self.results["rows"].append(result)
            self.log(f"{name}: {self._summary(result)}")

    def not_run(self, row: str, why: str) -> None:
        for config in configurations(self.args):
            spec = vars(self.spec(row, config, compile_mode=self.args.compile_mode))
            self.results["rows"].append(dict(spec=spec, title=ROW_TITLES[row], status="not run", error=why))

    def _compile_subprocess(self, spec: RowSpec, limit: float) -> dict:
        result_path = self.out / f".{spec.model}-{spec.batch}-d.json"
        log_path = self.out / f"compile-{spec.model}-{spec.batch}.log"
        cmd = [
            sys.executable, "-m", "bench.throughput",
            "--spec", json.dumps(vars(spec)), "--opts", json.dumps(vars(self.opts())),
            "--result", str(result_path), "--threads", str(torch.get_num_threads()),
        ]  # fmt: skip
        run = run_limited(cmd, limit, log_path)
        if result_path.exists():
            result = json.loads(result_path.read_text().splitlines()[-1])  # JSON lines: one row
            result_path.unlink()
            return result
        status = "timed out" if run["timed_out"] else "failed"
        why = (
            f"exceeded {limit:.0f} s (--compile_timeout)" if run["timed_out"] else f"exit {run['returncode']}"
        )
        return dict(
            spec=vars(spec), title=ROW_TITLES["d"], status=status, error=f"{why}; see {log_path.name}"
        )

    def check(self, name: str, cmd: list[str], limit: float, output: str) -> None:
        if limit < 20:
            self.results["checks"][name] = dict(status="skipped (time budget)", seconds=0.0, output="")
            return self.log(f"{name}: skipped, out of time")
        run = run_limited(cmd, limit, self.out / output)
        lines = (self.out / output).read_text(errors="replace").strip().splitlines()
        status = "timed out" if run["timed_out"] else ("passed" if run["returncode"] == 0 else "failed")
        self.results["checks"][name] = dict(
            status=status, command=" ".join(cmd[1:]), seconds=run["seconds"], output=output,
            summary=lines[-1] if lines else "",
        )  # fmt: skip
        self.log(f"{name}: {status} in {run['seconds']:.0f} s: {lines[-1] if lines else ''}")

    @staticmethod
    def _summary(result: dict) -> str:
        if result["status"] != "ok":
            return f"{result['status']}: {result.get('error', '')}"
        ips = result["images_per_s"]
        return f"{ips['median']:.1f} images/s (min {ips['min']:.1f}, max {ips['max']:.1f})"

    # --- output --------------------------------------------------------------------------------

    def save(self, plot: bool = True) -> None:
        results = self.results
        if self.args.merge and (self.out / "results.json").exists():
            results = report.merge(json.loads((self.out / "results.json").read_text()), self.results)
        report.write(results, self.out, plot_too=plot)


def default_out_dir(env: dict) -> Path:
    """<fasttrain's cache>/bench/<date>-<gpu or cpu>/ (FASTTRAIN_CACHE, else ~/.cache/fasttrain)."""
    from fasttrain.config import default_cache_dir

    name = "".join(c if c.isalnum() else "-" for c in (env.get("gpu") or "cpu").lower()).strip("-")
    return default_cache_dir() / "bench" / f"{env['date'][:10]}-{name}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        if args.smoke and not torch.cuda.is_available():
            # One intra-op thread: on a busy machine two OpenMP threads that wait for each other at
            # every op's barrier made a 10 ms smoke step take seconds. Recorded as torch_threads.
            torch.set_num_threads(1)
        suite = Suite(args, argv)
    except UsageError as exc:
        print(f"bench.run: {exc}", file=sys.stderr)
        return 2
    budget, parts = args.time_budget, args.parts
    suite.log(f"results in {suite.out}; parts {', '.join(parts)}; budget {budget:.0f} s")
    suite.yardsticks()
    suite.save(plot=False)
    cuda = suite.device.type == "cuda"
    if "gpu_tests" in parts and cuda:
        # First: the correctness evidence (graph == eager, no host sync, kernels compiled) matters
        # more than any speed, and a run cut short must still have it.
        limit = min(suite.deadline("gpu_tests") - time.monotonic(), suite.remaining())
        # -v: one line per test as it ends, so a run cut off at its limit still names the one running.
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-v", "-rs", "--durations=10"]
        suite.check("gpu_tests", cmd, limit, "gpu_tests.txt")
        suite.save(plot=False)
    if "rows" in parts:
        suite.rows(suite.deadline("rows"))
        suite.save(plot=False)
    if "pipeline" in parts:
        with pipeline_data(args.data_dir, args.smoke) as (data_dir, description):
            suite.results["data"] = description
            suite.pipeline(suite.deadline("pipeline"), data_dir)
        suite.save(plot=False)
    if "kernels" in parts and cuda:
        limit = min(suite.deadline("kernels") - time.monotonic(), suite.remaining())
        cmd = [
            sys.executable, "-m", "pytest", "bench/bench_optim.py", "-q",
            f"--benchmark-json={suite.out / 'bench_optim.json'}",
        ]  # fmt: skip
        suite.check("kernels", cmd, limit, "bench_optim.txt")
        bench_json = suite.out / "bench_optim.json"
        if bench_json.exists():
            suite.results["kernels"] = report.kernel_rows(json.loads(bench_json.read_text()))
        suite.save(plot=False)
    if "compile" in parts and "d" in args.rows:
        suite.compile_rows()
    else:
        why = "--smoke" if args.smoke else ("--rows" if "d" not in args.rows else "--parts")
        suite.not_run("d", f"not selected ({why})")
    suite.save()
    suite.log(f"done in {time.monotonic() - suite.start:.0f} s: {suite.out / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
