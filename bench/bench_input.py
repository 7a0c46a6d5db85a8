"""Training input pipelines side by side on the CPU: images/s of fasttrain's loaders, TensorFlow's
tf.data with the seeds' preprocessing, DALI's CPU mode and a plain PyTorch pipeline, in one run.

Settings (batch 32, 2 workers or threads in every row):
    resnet224            224 px, ResNet preprocessing (crop, bilinear resize, flip), no colour
    inception299+colour  299 px, Inception preprocessing with colour distortion
    vgg224               224 px, the ResNet seed's vgg_preprocessing (short side U{256..512}, random
                         224 crop, flip; tf-data: its imagenet.py + vgg_preprocessing, bench/tf_vgg.py)
Rows, each in a process of its own (torch and TensorFlow never share one):
    fasttrain-torch   fasttrain's torch backend through fasttrain.data.build_loader (bench/torch_input.py),
                      loader="processes" (DataLoader worker processes)
    fasttrain-threads the same with loader="threads" (fasttrain.data.thread_loader)
    fasttrain-dali    fasttrain's DALI backend in DALI's CPU-only mode, the same loader API
    tf-data           tf.data with the seeds' preprocessing (bench/tf_input.py), run by --tf-python
                      or this interpreter if it has tensorflow; else "not run"
    plain-pytorch     PyPI tfrecord + Pillow RandomResizedCrop/flip(/jitter) in a DataLoader
Data: the real-photo shard set of bench/photo_shards.py (cached in the temp directory), or --data_dir.

Method: all rows of a setting are started and warmed up (`--warmup` batches: worker start, TF
tracing, shuffle-buffer fill), then each row gets a short calibration window that sizes its timed
windows to about --seconds. Then --rounds rounds; in each, every row in turn (the order rotated per
round, so drift and neighbours' noise hit all rows alike) takes `--drain` untimed batches (emptying
the prefetch buffers it filled while idle; bench/input_serve.py) and one timed window. An idle row
uses no CPU once its buffers are full (measured: 0.0 CPU-seconds per row over 20 s idle, all four
rows, process trees included), so the row being timed has the cores to itself. Reported per row:
the median images/s over rounds, min and max, and median / the tf-data row's median in the same run
(and that ratio round by round); and the CPU time per image, user + system of the row's process tree
over its timed windows (bench/input_serve.py's tree_cpu_seconds), which other load on the machine
disturbs much less than the wall clock. Conditions recorded: CPU, cores, load average before and after each
setting, versions (bench/common.py's environment), the data set's statistics, git commit. Writes
results.json and results.md to --out. From the repository root (the rows run as `python -m bench.<row>`
there, the tf-data row under --tf-python):

    python -m bench.bench_input --out DIR [--tf-python /tmp/tfenv/bin/python] [--seconds 20] [--rounds 3]
    python -m bench.bench_input --smoke --out DIR   (batch 8, one-batch windows: a check, not a measurement)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import ROOT, environment
from bench.photo_shards import cached_photo_shards

SETTINGS = {"resnet224": ("resnet", 224), "inception299+colour": ("inception", 299), "vgg224": ("vgg", 224)}
ROWS = (
    "fasttrain-torch",
    "fasttrain-dali",
    "tf-data",
    "plain-pytorch",
    "fasttrain-threads",
    "fasttrain-threads-nocp",
)
REFERENCE = "tf-data"
REPLY_TIMEOUT = 900.0  # seconds; a window is sized to --seconds, warm-up may fill a 16k-record buffer


class Row:
    """One row's process and the commands of bench/input_serve.py."""

    def __init__(self, name: str, cmd: list[str], log: Path):
        self.name, self.status, self.error, self.rates, self.info = name, "ok", "", [], {}
        self.batches = 0
        self.cpu_seconds, self.images = 0.0, 0  # over the timed windows
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )
        self._pending = b""

    def send(self, **cmd) -> None:
        if self.status == "ok":
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()

    def answer(self) -> dict | None:
        """The row's reply, or None (and status failed) when it errs, dies or hangs."""
        if self.status != "ok":
            return None
        deadline = time.monotonic() + REPLY_TIMEOUT
        while time.monotonic() < deadline:
            # Our own line buffer over the raw pipe: select() cannot see lines a file object buffered.
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.startswith(b"@@ "):
                    reply = json.loads(line[3:])
                    return self._fail(reply["error"]) if "error" in reply else reply
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    return self._fail(
                        f"the process ended (exit code {self.proc.wait()}); see {self._log.name}"
                    )
                self._pending += chunk
        return self._fail(f"no answer within {REPLY_TIMEOUT:.0f} s")

    def _fail(self, error: str) -> None:
        self.status, self.error = "failed", error
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def tf_interpreter(given: str) -> str | None:
    """The Python that runs the tf-data row: --tf-python, else this one if it imports tensorflow."""
    python = given or sys.executable
    ok = subprocess.run([python, "-c", "import tensorflow"], capture_output=True, timeout=300).returncode == 0
    return python if ok else None


def row_command(
    name: str, setting: str, data_dir: str, tf_python: str | None, batch: int
) -> list[str] | None:
    preprocess, size = SETTINGS[setting]
    common = [
        "--data_dir",
        data_dir,
        "--setting",
        preprocess,
        "--image_size",
        str(size),
        "--batch",
        str(batch),
    ]
    if name == REFERENCE:
        return None if tf_python is None else [tf_python, "-m", "bench.tf_input", *common]
    return [sys.executable, "-m", "bench.torch_input", "--row", name, *common]


def measure_setting(setting: str, args, data_dir: str, tf_python: str | None, logs: Path) -> dict:
    rows = []
    for name in args.rows:
        cmd = row_command(name, setting, data_dir, tf_python, args.batch)
        if cmd is None:
            rows.append(dict(row=name, status="not run (tensorflow not installed)"))
            continue
        rows.append(Row(name, cmd, logs / f"{setting}-{name}.log"))
    live = [r for r in rows if isinstance(r, Row)]
    for r in live:  # warm up together: untimed, so they may share the cores
        r.send(cmd="warmup", batches=args.warmup)
    for r in live:
        reply = r.answer()
        if reply:
            r.info = dict(
                warmup_seconds=round(reply["seconds"], 2), shape=reply["shape"], dtype=reply["dtype"]
            )
            r.info.update({k: reply[k] for k in ("version",) if k in reply})
    for r in live:  # alone: size the windows to about --seconds
        r.send(cmd="window", drain=args.drain, batches=args.calibrate)
        reply = r.answer()
        if reply:
            rate = args.calibrate / reply["seconds"]  # batches/s
            r.batches = max(args.min_batches, round(args.seconds * rate))
    for k in range(args.rounds):
        for r in live[k % len(live) :] + live[: k % len(live)] if live else []:
            r.send(cmd="window", drain=args.drain, batches=r.batches)
            reply = r.answer()
            if reply:
                r.rates.append(r.batches * args.batch / reply["seconds"])
                r.cpu_seconds += reply.get("cpu_seconds", float("nan"))
                r.images += r.batches * args.batch
    for r in live:
        r.close()
    out = []
    for r in rows:
        if not isinstance(r, Row):
            out.append(r)
            continue
        res = dict(row=r.name, status=r.status, **r.info)
        if r.status == "ok":
            res.update(batches_per_window=r.batches, images_per_s=[round(x, 1) for x in r.rates])
            res.update(median=statistics.median(r.rates), min=min(r.rates), max=max(r.rates))
            res.update(cpu_ms_per_image=1000 * r.cpu_seconds / r.images)
        else:
            res["error"] = r.error
        out.append(res)
    ref = next((r for r in out if r["row"] == REFERENCE and r["status"] == "ok"), None)
    for r in out:
        if r["status"] == "ok":
            r["vs_tf_data"] = r["median"] / ref["median"] if ref else None
            # round by round: both windows of a round saw about the same machine (other load, clock)
            pairs = zip(r["images_per_s"], ref["images_per_s"], strict=True) if ref else ()
            r["vs_tf_data_per_round"] = [round(a / b, 3) for a, b in pairs]
            r["per_core"] = r["median"] / (os.cpu_count() or 1)
            if ref and "cpu_ms_per_image" in r:  # images per CPU-second, relative to tf.data's
                r["cpu_vs_tf_data"] = ref["cpu_ms_per_image"] / r["cpu_ms_per_image"]
    return dict(setting=setting, rows=out)


def ensure_row_checkpoints(data_dir: str) -> dict:
    """Build the shards' JPEG row checkpoints (python -m fasttrain.data row-checkpoints) unless they are
    there: the fasttrain-torch and fasttrain-threads rows read them (fasttrain-threads-nocp does not).
    Returns what the build cost (CPU seconds of the command's process tree, wall seconds) and the
    sidecars' size."""
    from fasttrain.data.imagenet import find_shards
    from fasttrain.data.jpeg.row_build import build_sidecars
    from fasttrain.data.jpeg.row_index import RowIndex, sidecar_candidates

    shards = find_shards(data_dir, "train")
    built = all(RowIndex.open(s) is not None for s in shards)
    info: dict = dict(already_built=built)
    if not built:
        cpu0, wall0 = _cpu_with_children(), time.perf_counter()
        build_sidecars(data_dir, workers=2)
        info.update(build_cpu_seconds=_cpu_with_children() - cpu0, build_seconds=time.perf_counter() - wall0)
    sizes = [c.stat().st_size for s in shards for c in sidecar_candidates(s) if c.is_file()]
    info.update(sidecar_bytes=sum(sizes))
    return info


def _cpu_with_children() -> float:
    self_, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + children.ru_utime + children.ru_stime


def write_markdown(results: dict, path: Path) -> None:
    env, data = results["environment"], results["data"]
    lines = [
        f"# Input pipelines, training, batch {results['batch']}, {results['workers']} workers per row",
        "",
        f"CPU: {env['cpu']} ({env['cpu_count']} cores); commit {env['git_commit']}; {env['date']}",
        f"Data: {data.get('images')} distinct photos, {data.get('records')} records in {data.get('shards')} "
        f"shards, mean {data.get('mean_width', 0):.0f}x{data.get('mean_height', 0):.0f} px, "
        f"mean {data.get('mean_jpeg_bytes', 0) / 1000:.1f} kB; kinds {data.get('kinds')}",
        f"Rounds {results['rounds']}, about {results['seconds']} s per window, "
        f"drain {results['drain']} batches.",
        "",
        *(
            ["SMOKE RUN: one-batch windows that prefetched batches fill; the numbers measure nothing.", ""]
            * results["smoke"]
        ),
        *_row_checkpoint_lines(results.get("row_checkpoints"), data),
        "| setting | row | images/s median (min-max) | per core | vs tf.data | CPU ms/image | images per "
        "CPU-s vs tf.data | batch | load before/after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in results["settings"]:
        load = f"{s['load_before'][0]:.2f} / {s['load_after'][0]:.2f}"
        for r in s["rows"]:
            if r["status"] != "ok":
                lines.append(
                    f"| {s['setting']} | {r['row']} | {r['status']} {r.get('error', '')} | | | | | | {load} |"
                )
                continue
            ratio = f"{r['vs_tf_data']:.2f}x" if r.get("vs_tf_data") else "-"
            rate = f"{r['median']:.0f} ({r['min']:.0f}-{r['max']:.0f})"
            batch = f"{tuple(r['shape'])} {r['dtype']}"
            cpu = f"{r['cpu_ms_per_image']:.2f}" if "cpu_ms_per_image" in r else "-"
            cpu_ratio = f"{r['cpu_vs_tf_data']:.2f}x" if r.get("cpu_vs_tf_data") else "-"
            lines.append(
                f"| {s['setting']} | {r['row']} | {rate} | {r['per_core']:.0f} | {ratio} | {cpu} "
                f"| {cpu_ratio} | {batch} | {load} |"
            )
    path.write_text("\n".join(lines) + "\n")


def _row_checkpoint_lines(info: dict | None, data: dict) -> list[str]:
    if not info:
        return []
    records = data.get("records") or 0
    per = f", {info['sidecar_bytes'] / records:.0f} bytes per record" if records else ""
    if info["already_built"]:
        cost = "built before this run"
    else:
        cost = f"built in this run: {info['build_cpu_seconds']:.1f} CPU s, {info['build_seconds']:.1f} s wall"
        if records:
            cost += f" ({info['build_cpu_seconds'] / records * 1e3:.2f} CPU ms per record)"
    return [
        f"JPEG row checkpoints (python -m fasttrain.data row-checkpoints; read by fasttrain-torch and "
        f"fasttrain-threads, not by fasttrain-threads-nocp): {cost}; "
        f"{info['sidecar_bytes'] / 1e6:.1f} MB{per}.",
        "",
    ]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--tf-python", default="", help="interpreter with tensorflow for the tf-data row")
    p.add_argument("--data_dir", default="", help="train-*-of-* shards (default: the photo set, cached)")
    p.add_argument("--seconds", type=float, default=20.0, help="about this long per timed window")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10, help="untimed batches when a row starts")
    p.add_argument("--drain", type=int, default=8, help="untimed batches before each window")
    p.add_argument("--calibrate", type=int, default=6, help="batches of the window that sizes the others")
    p.add_argument("--min_batches", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"of {','.join(SETTINGS)}")
    p.add_argument("--rows", default=",".join(ROWS), help=f"of {','.join(ROWS)}")
    p.add_argument("--images", type=int, default=2048, help="distinct photos in the generated set")
    # 1024 batches per epoch: fasttrain's loaders and the plain DataLoader start new workers (DALI a new
    # pipeline) every epoch, TF's repeat() does not; ImageNet's epochs are 40,036 batches of 32.
    p.add_argument("--records", type=int, default=32768, help="records in the generated set")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="tiny data and windows (CI-size)")
    args = p.parse_args(argv)
    if args.smoke:
        args.images, args.records, args.shards, args.rounds, args.batch = 64, 256, 2, 1, 8
        args.warmup, args.drain, args.calibrate, args.min_batches, args.seconds = 1, 1, 1, 1, 0.0
    args.settings, args.rows = args.settings.split(","), args.rows.split(",")
    bad = [s for s in args.settings if s not in SETTINGS] + [r for r in args.rows if r not in ROWS]
    if bad:
        p.error(
            f"unknown setting or row {', '.join(bad)}: settings {', '.join(SETTINGS)}; rows {', '.join(ROWS)}"
        )
    return args


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if args.data_dir:
        data_dir = args.data_dir
        manifest = Path(data_dir) / "photo_shards.json"
        data = json.loads(manifest.read_text()) if manifest.is_file() else dict(data_dir=data_dir)
    else:
        data_dir = os.path.join(
            tempfile.gettempdir(), f"fasttrain-photos-{args.images}-{args.records}-{args.shards}"
        )
        data = cached_photo_shards(data_dir, args.images, args.records, args.shards)
    tf_python = tf_interpreter(args.tf_python) if REFERENCE in args.rows else None
    env = environment(torch.device("cpu"), ["-m", "bench.bench_input", *(argv or sys.argv[1:])])
    results = dict(
        environment=dict(env, tf_python=tf_python),
        data=dict(data, data_dir=data_dir),
        batch=args.batch,
        workers=2,
        rounds=args.rounds,
        seconds=args.seconds,
        drain=args.drain,
        smoke=args.smoke,
        settings=[],
    )
    if any(r in ("fasttrain-torch", "fasttrain-threads") for r in args.rows):
        results["row_checkpoints"] = ensure_row_checkpoints(data_dir)
    for setting in args.settings:
        before = os.getloadavg()
        res = measure_setting(setting, args, data_dir, tf_python, out / "logs")
        res.update(load_before=before, load_after=os.getloadavg())
        results["settings"].append(res)
        for r in res["rows"]:
            rate = (
                f"{r['median']:.1f} images/s"
                if r["status"] == "ok"
                else r["status"] + " " + r.get("error", "")
            )
            print(f"{setting:20s} {r['row']:16s} {rate}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, out / "results.md")
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")


if __name__ == "__main__":
    main()
