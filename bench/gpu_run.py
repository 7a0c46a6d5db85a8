"""The GPU run, prepared: selfcheck, the GPU tests, the training step's speed beside eager PyTorch and
torch.compile, the fused optimizer kernel and the trainer on JPEG shards, in one command on the lent
GPU machine (one H100 or H200; about 15 minutes of device time a session, 10 minutes a command).

    bash bench/gpu_prepare.sh                  here: fetch the wheels that machine lacks into .whl/
                                               (git-ignored), check that what travels is under 64 MiB
    bash bench/gpu_run.sh OUT [flags]          there: install the wheels, then this driver
    bash bench/gpu_run.sh OUT --dry-run        the same on a CPU at tiny sizes (CI: tests/test_gpu_run.py)

Steps; each is a subprocess under its own time limit writing its log into the work folder, run
whatever an earlier step did, except the preflight:
    preflight  CUDA works (a matmul checked against the CPU) and Triton's launcher works (a kernel
               checked); records the environment. On failure: one line, exit 3, nothing else runs.
    four lanes at once, none of them timed:
      checks   python -m fasttrain selfcheck; python -m pytest -m gpu tests (two lanes), once the
               loaders' numba kernels are in numba's disk cache (the shards lane's first item): the
               selfcheck's fused-decode row and the GPU tests' trainer runs compiled them cold at once
               otherwise, and both lanes ran out of time in the second run (2026-11-27)
      compile  each configuration's compiled columns (f, d) compiled once, --compile_workers at a time
               (inductor's on-disk caches then hold them, so the timed rows compile in seconds); the
               cold compile time is recorded here. New compiles start only while a checks lane runs.
      shards   the loaders' numba kernels compiled into numba's disk cache (else each process that
               loads JPEGs compiles them cold: 55-100 s on one core, 130 s on the busy machine), then
               the JPEG TFRecord shards of the e2e step (bench.photo_shards), their row checkpoints,
               and the e2e trainer's model compiled by inductor (bench.gpu_e2e --warm: two synthetic
               steps), so that e2e's timed trainer runs compile from the cache
    then alone, one at a time, the timed items in QUEUE's order (most important first); an item starts
    only while its minimum time is left in --budget, else it is recorded as not run:
      rows     one configuration: (a) fasttrain --no-compile, (e) with --no-cuda_graph, (b) eager
               PyTorch and (h) (a) with --bn_kernels triton in one process; then each in a process of
               its own: (f) fasttrain as its CLI runs it on CUDA (inductor regions inside the
               whole-step graph), (g) (f) with --pad_stem (the 4-channel stem), (d) torch.compile of
               (b), default mode, and (d-max) mode max-autotune-no-cudagraphs and (f-max) (f) in that
               mode, where --columns asks for them; each row, once written, profiled for 3 steps
               (bench/step_profile.py: device time by kind of kernel, in rows.profile.jsonl; at most
               30 s, else its process ends)
      kernels  bench/bench_optim.py's interleaved rounds on the ResNet-50 and Inception v3 parameter sets,
               bench/bench_stem.py's ResNet-50 conv1 with 3 against 4 input channels, and
               bench/bench_bn.py's BatchNorm + add + ReLU (Triton kernels, eager, inductor)
      e2e      the trainer's CLI on the JPEG shards against the same on synthetic data (bench/gpu_e2e.py)
      inductor_bw  last: the first setting's (d) compiled cold with inductor's bandwidth profiler,
               each inductor kernel's GB/s against the copy's (bench/inductor_bw.py)
Output in --out: results.json, summary.md, selfcheck.json, gpu_tests.txt and logs.tar.gz (every log),
rewritten after every step, so a run cut off at its limit keeps what it measured (the device tool
brings back 8 files at most, none deeper than two folders), and caches.tar.gz, inductor's and numba's
caches for the next session to carry (bench/gpu_caches.py; not in the dry run).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from bench import gpu_caches, gpu_report
from bench.common import run_limited
from bench.gpu_output import read_jsonl, write_outputs
from bench.gpu_plan import (
    COMPILED,
    DRY,
    DRY_LIMITS,
    EAGER,
    FULL,
    LIMITS,
    MIN_START,
    Setting,
    gpu_test_files,
    parse_args,
    row_args,
)
from bench.hidden_packages import hide

ROOT = Path(__file__).resolve().parents[1]


class Driver:
    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work or tempfile.mkdtemp(prefix="fasttrain-gpu-run-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.limits = DRY_LIMITS if args.dry_run else LIMITS
        self.lock = threading.Lock()
        self.results = dict(
            command=sys.argv, commit=args.commit, dry_run=args.dry_run, budget_s=args.budget,
            settings=[asdict(s) | {"key": s.key} for s in self.settings()], steps={}, compile_warm={},
        )  # fmt: skip
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not args.dry_run:  # (the CPU's inductor cache stays where CI's other tests warmed it)
            self.env.update(gpu_caches.environment(self.work))
        self.env["PYTHONPATH"] = os.pathsep.join(
            [*self._hidden_packages(), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        if args.dry_run:
            self.env.setdefault("FASTTRAIN_BENCH_SMOKE", "1")
            # Column (h)'s kernels run in Triton's interpreter on the CPU; Triton 3.6 reads the switch
            # only when it is first imported (an interpreted kernel then failed at its first tl.zeros).
            self.env.setdefault("TRITON_INTERPRET", "1")
        earlier = self.work / "results.json"
        if args.resume and earlier.exists():  # a later part on the same (still warm) machine
            before = json.loads(earlier.read_text())
            self.results["steps"] = before.get("steps", {})
            self.results["compile_warm"] = before.get("compile_warm", {})
            self.results["part"] = before.get("part", 1) + 1
            self.results["preflight"] = before.get("preflight")

    def finished(self, name: str) -> bool:
        """With --resume: the step ran to its end in an earlier part (a failure is a result too)."""
        return self.args.resume and self.results["steps"].get(name, {}).get("status") in ("ok", "failed")

    def measured(self, s: Setting, columns: list[str]) -> bool:
        """With --resume: every column of `columns` has an ok row for this setting in rows.jsonl."""
        done = {gpu_report.column_of(r) for r in read_jsonl(self.work / "rows.jsonl") if r["status"] == "ok"
                and gpu_report.setting_key(r["spec"]) == s.key}  # fmt: skip
        return self.args.resume and set(columns) <= done

    # --- what runs ---------------------------------------------------------------------------------

    def settings(self) -> list[Setting]:
        base = DRY if self.args.dry_run else FULL
        wanted = [k for k in self.args.configs.split(",") if k]
        return [s for s in base if not wanted or s.key in wanted]

    def _hidden_packages(self) -> list[str]:
        """--hide a,b: bench/hidden_packages.py's folder, first on the dry run's path."""
        return hide(self.work / "hidden-packages", self.args.hide.split(",")) if self.args.hide else []

    def remaining(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def log(self, text: str) -> None:
        line = f"[{time.monotonic() - self.start:6.1f} s] {text}"
        with self.lock:
            print(line, flush=True)
            with open(self.work / "driver.log", "a", encoding="utf-8") as f:
                f.write(line + "\n")

    def run(self, name: str, cmd: list[str], limit: float, log_name: str = "") -> dict:
        """cmd under min(limit, what the budget leaves), output to the work folder; recorded by name."""
        limit = max(1.0, min(limit, self.remaining() - 5))
        log_path = self.work / (log_name or f"{name}.log")
        self.log(f"{name}: start (limit {limit:.0f} s)")
        started = time.monotonic() - self.start
        run = run_limited(cmd, limit, log_path, env=self.env)
        status = "timed out" if run["timed_out"] else ("ok" if run["returncode"] == 0 else "failed")
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
        record = dict(
            status=status, started_s=round(started, 1), seconds=round(run["seconds"], 1),
            limit_s=round(limit), log=log_path.name,
        )  # fmt: skip
        record.update(returncode=run["returncode"], last_line=tail[0][:300] if tail else "")
        with self.lock:
            self.results["steps"][name] = record
        self.log(f"{name}: {status} in {run['seconds']:.0f} s: {record['last_line']}")
        self.save()
        return record

    def caches(self, pack: bool) -> None:
        """Unpack carried compile caches (before anything compiles), or pack this run's."""
        if self.args.dry_run:
            return
        env = (self.results.get("preflight") or {}).get("environment", {})
        if pack:
            self.log(gpu_caches.pack(self.work, self.out, env))
        else:
            self.log(gpu_caches.unpack(Path(self.args.caches), self.work, env))

    def not_run(self, name: str, why: str) -> None:
        with self.lock:
            self.results["steps"][name] = dict(status="not run", reason=why)
        self.log(f"{name}: not run ({why})")

    def py(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    # --- steps -------------------------------------------------------------------------------------

    def preflight(self) -> bool:
        cmd = self.py("-m", "bench.gpu_preflight", "--out", str(self.work / "preflight.json"))
        if self.args.dry_run:
            cmd.append("--cpu")
        record = self.run("preflight", cmd, self.limits["preflight"])
        path = self.work / "preflight.json"
        if path.exists():
            self.results["preflight"] = json.loads(path.read_text())
        self.save()
        return record["status"] == "ok"

    def selfcheck(self) -> None:
        if "selfcheck" in self.args.steps and not self.finished("selfcheck"):
            out = self.work / "selfcheck.json"
            cmd = self.py("-m", "fasttrain", "selfcheck", "--out", str(out))
            if self.args.dry_run:  # the CPU rows run in CI's own selfcheck already
                cmd += ["--checks", "optimizer-triton,eager-step,graph-replay"]
            self.run("selfcheck", cmd, self.limits["selfcheck"])

    def gpu_tests(self) -> None:
        if "gpu_tests" in self.args.steps and not self.finished("gpu_tests"):
            cmd = self.py("-m", "pytest", "-m", "gpu", *gpu_test_files(), "-v", "-rs")
            cmd += ["-k", self.args.gpu_tests_k] if self.args.gpu_tests_k else []
            cmd += ["-p", "no:cacheprovider"]
            cmd += ["--durations=10", f"--junitxml={self.work / 'gpu_tests.xml'}"]
            self.run("gpu_tests", cmd, self.limits["gpu_tests"], "gpu_tests.txt")

    def checks_pending(self) -> bool:
        return any(s in self.args.steps and not self.finished(s) for s in ("selfcheck", "gpu_tests"))

    def compile_lane(self, checks_done: threading.Event) -> None:
        """--compile_workers threads taking the compiles in order. A cold compile is mostly one core's
        Python (dynamo, inductor's lowering) between bursts of Triton builds across the cores, so two
        at once should get further through the lane in the checks' time (not yet measured)."""
        if not self.checks_pending() and not self.args.dry_run:
            return  # nothing untimed to hide compiles behind: each (d) row compiles in its own step
        items = iter(self._compile_items())
        workers = [
            threading.Thread(target=self._compile_worker, args=(items, checks_done))
            for _ in range(max(1, self.args.compile_workers))
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    def _compile_worker(self, items, checks_done: threading.Event) -> None:
        while True:
            with self.lock:
                item = next(items, None)
            if item is None:
                return
            setting, column = item
            if checks_done.is_set() and not self.args.dry_run:
                return  # from here on the GPU is timed: the rest compile cold in their rows
            name = f"compile {setting.key} {column}"
            if self.finished(name) or self.measured(setting, [column]):
                continue
            result = self.work / f"warm-{setting.key}-{column}.jsonl"
            cmd = self._row_cmd(setting, column, result, warm=True)
            record = self.run(name, cmd, self._cold_limit(column), f"warm-{setting.key}-{column}.log")
            rows = read_jsonl(result)
            if rows and rows[-1]["status"] == "ok":
                record["compile_seconds"] = rows[-1].get("warmup_seconds")
            with self.lock:
                self.results["compile_warm"][f"{setting.key} {column}"] = record

    def _cold_limit(self, column: str) -> float:
        """A compiled column's limit when it compiles cold: the max-autotune modes take longer."""
        return self.limits["compile-max" if column.endswith("-max") else "compile"]

    def _compile_items(self):
        wanted = [c for c in COMPILED if c in self.args.column_list]
        # Setting by setting, most important first (the lane rarely gets through all of them).
        return [(s, c) for s in self.settings() for c in wanted] if "rows" in self.args.steps else []

    def shards_lane(self, kernels_ready: threading.Event) -> None:
        try:
            wanted = "e2e" in self.args.steps or self.checks_pending()
            if wanted and not self.finished("loader kernels"):
                # The kernels' parts in processes of their own (fasttrain.data.warm), on half the
                # cores: the compile lanes run beside them.
                jobs = str(max(2, (os.cpu_count() or 2) // 2))
                cmd = self.py("-m", "fasttrain.data", "warm-up", "--jobs", jobs)
                limit = self.limits["loader_kernels"]
                self.run("loader kernels", cmd, limit, "loader_kernels.log")
        finally:
            kernels_ready.set()  # the checks lanes start (they run whatever happened here)
        if "e2e" not in self.args.steps:
            return
        shards = self.work / "shards"
        if not self.finished("row checkpoints"):
            images, records, count = (16, 96, 2) if self.args.dry_run else (2048, 32768, 32)
            cmd = self.py("-m", "bench.photo_shards", str(shards), "--images", str(images))
            cmd += ["--records", str(records), "--shards", str(count)]
            if self.run("shards", cmd, self.limits["shards"])["status"] == "ok":
                workers = "2" if self.args.dry_run else "8"
                cmd = self.py("-m", "fasttrain.data", "row-checkpoints", str(shards), "--workers", workers)
                self.run("row checkpoints", cmd, self.limits["shards"], "row_checkpoints.log")
        if not self.finished("e2e compile"):  # the trainer's model into inductor's caches, untimed
            cmd = self.py("-m", "bench.gpu_e2e", "--warm", "--data_dir", str(shards), "--work")
            cmd += [str(self.work / "e2e"), "--out", os.devnull, "--limit", str(self.limits["compile"] - 10)]
            cmd += ["--dry-run"] if self.args.dry_run else []
            self.run("e2e compile", cmd, self.limits["compile"], "e2e_compile.log")

    def _row_cmd(self, s: Setting, column: str, result: Path, warm: bool = False) -> list[str]:
        return self.py(*row_args(s, column, result, self.args.column_list, self.args.dry_run, warm))

    def rows(self, s: Setting) -> None:
        result = self.work / "rows.jsonl"
        eager = [c for c in EAGER if c in self.args.column_list]
        if eager and not self.measured(s, eager):
            if self.remaining() < MIN_START["rows"]:
                self.not_run(f"rows {s.key}", "time budget")
            else:
                self.run(f"rows {s.key}", self._row_cmd(s, "aeb", result), self.limits["rows"])
        for column in [c for c in COMPILED if c in self.args.column_list]:
            if self.measured(s, [column]):
                continue
            warm = self.results["compile_warm"].get(f"{s.key} {column}", {}).get("status") == "ok"
            need = MIN_START["d" if warm else ("d-max" if column.endswith("-max") else "d-cold")]
            name = f"{column} {s.key}"
            if self.remaining() < need:
                self.not_run(name, f"time budget ({self.remaining():.0f} s left, {need} s needed)")
                continue
            limit = self.limits["d"] if warm else self._cold_limit(column)
            self.run(name, self._row_cmd(s, column, result), limit, f"{column}-{s.key}.log")

    def kernels(self) -> None:
        if self.finished("kernels"):
            return
        if self.remaining() < MIN_START["kernels"]:
            return self.not_run("kernels", "time budget")
        select = (
            "interleaved and resnet50" if self.args.dry_run else "interleaved and (resnet50 or inception)"
        )
        select = f"({select}) or stem or bn_relu"
        files = ["bench/bench_optim.py", "bench/bench_stem.py", "bench/bench_bn.py"]
        cmd = self.py("-m", "pytest", *files, "--benchmark-only")
        cmd += ["-q", "-s", "-k", select]
        cmd += ["-p", "no:cacheprovider", f"--benchmark-json={self.work / 'bench_optim.json'}"]
        self.run("kernels", cmd, self.limits["kernels"], "kernels.log")

    def e2e(self) -> None:
        shards = self.work / "shards"
        if self.finished("e2e"):
            return
        if self.results["steps"].get("row checkpoints", {}).get("status") != "ok":
            return self.not_run("e2e", "the JPEG shards were not built (see shards.log)")
        if self.remaining() < MIN_START["e2e"]:
            return self.not_run("e2e", "time budget")
        cmd = self.py("-m", "bench.gpu_e2e", "--data_dir", str(shards), "--work", str(self.work / "e2e"))
        cmd += ["--out", str(self.work / "e2e.json")] + (["--dry-run"] if self.args.dry_run else [])
        cmd += ["--limit", str(int(min(self.limits["e2e"], self.remaining() - 10)) - 5)]
        self.run("e2e", cmd, self.limits["e2e"], "e2e.log")

    def inductor_bw(self, s: Setting) -> None:
        name = f"inductor_bw {s.key}"
        if self.finished(name):
            return
        if self.remaining() < MIN_START["inductor_bw"]:
            return self.not_run(name, "time budget")
        spec = dict(model=s.model, batch=s.batch, image_size=s.image_size, base_channels=s.base_channels)
        spec |= dict(precision=s.precision, compile_mode="default")
        cmd = self.py("-m", "bench.inductor_bw", "--spec", json.dumps(spec))
        cmd += ["--out", str(self.work / f"inductor_bw-{s.key}.json")]
        self.run(name, cmd, self.limits["inductor_bw"], f"inductor_bw-{s.key}.log")

    def queue(self) -> list:
        """The timed items, most important first: the ResNet-50 rows, then the optimizer kernel and the
        trainer on JPEGs (short, and each the only figure of its kind), then the other rows; with
        --rows_first every row comes before those two (a later run, once they have been measured);
        last, the first setting's inductor kernels' bandwidth (a diagnosis, not a figure to report)."""
        s = self.settings()
        first = s if self.args.rows_first else s[:2]
        items = [("rows", x) for x in first] + [("kernels", None), ("e2e", None)]
        return items + [("rows", x) for x in s[len(first) :]] + [("inductor_bw", x) for x in s[:1]]

    # --- output ------------------------------------------------------------------------------------

    def save(self) -> None:
        with self.lock:
            self.results["elapsed_s"] = round(time.monotonic() - self.start, 1)
            write_outputs(self.results, self.work, self.out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    driver = Driver(args)
    driver.log(f"work folder {driver.work}; results in {driver.out}; budget {args.budget:.0f} s")
    if not driver.preflight():
        why = (
            driver.results.get("preflight", {}).get("error")
            or driver.results["steps"]["preflight"]["last_line"]
        )
        print(f"gpu_run: preflight failed, nothing else ran: {why}", file=sys.stderr)
        return 3
    driver.caches(pack=False)
    kernels_ready, checks_done = threading.Event(), threading.Event()

    def after_kernels(check):
        kernels_ready.wait()
        check()

    checks = [threading.Thread(target=after_kernels, args=(c,)) for c in (driver.selfcheck, driver.gpu_tests)]
    others = [
        threading.Thread(target=driver.compile_lane, args=(checks_done,)),
        threading.Thread(target=driver.shards_lane, args=(kernels_ready,)),
    ]
    for lane in checks + others:
        lane.start()
    for lane in checks:
        lane.join()
    checks_done.set()  # the compile lane starts no new compile from here on
    for lane in others:
        lane.join()
    driver.log("untimed lanes done; timed items from here on, one at a time")
    driver.caches(pack=True)  # every compile done: packed before the timed items (a cut-off run keeps it)
    for kind, setting in driver.queue():
        if kind == "rows" and "rows" in args.steps:
            driver.rows(setting)
        elif kind == "kernels" and "kernels" in args.steps:
            driver.kernels()
        elif kind == "e2e" and "e2e" in args.steps:
            driver.e2e()
        elif kind == "inductor_bw" and "inductor_bw" in args.steps:
            driver.inductor_bw(setting)
    driver.caches(pack=True)
    driver.save()
    driver.log(f"done in {time.monotonic() - driver.start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
