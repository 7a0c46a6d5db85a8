"""`python -m fasttrain.data build` on a real-photo JPEG tree: images/s, and CPU time per image (so
images/s per core), beside TensorFlow's build_imagenet_data.py steps on the same tree.

Data (generated once into --data, never committed): `--images` JPEGs drawn as bench/photo_shards.py
draws its photographs (sizes mostly 500x375, quality 85-97, 4:2:0 / 4:4:4 / 4:2:2, 10% progressive,
5% restart markers, 10% EXIF, 3% grayscale), spread over `--synsets` synset folders of a train
directory, with a labels file, a metadata file and a box CSV (about half the images with 1-3 boxes).

Rows, each a fresh output directory:
    fasttrain        python -m fasttrain.data build --workers W (a subprocess)
    fasttrain+index  the same with --write_index
    fasttrain+rows   the same with --row_checkpoints (their .idx files too)
    tf-script        (with --tf-python) tests/data/make_tf_build.py's tf.compat.v1 port of the script's
                     steps, in TensorFlow's interpreter: its threads one after another, a session
                     run per image operation as in the script
Method: one untimed fasttrain run first (the tree in the page cache), then --rounds rounds over the
rows, rotated. Per run: images/s over the build itself (fasttrain: its summary line, from the first
job to the last; tf-script: around the port's run, TensorFlow's import and session set-up left out),
and CPU per image: for fasttrain the build's own figure (its jobs' process time, what grows with the
images) and the whole process tree's user + system time (getrusage of the waited-for children,
interpreter start and listing included); for tf-script the process's time around the run.
images/s per core = 1000 / (CPU ms per image), from the jobs' figure where there is one.

    python -m bench.bench_build --out DIR [--images 2048] [--workers 2] [--rounds 3]
                                [--tf-python /opt/tfvenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import ROOT, environment
from bench.photo_shards import GRAY_FRACTION, cut, encode, load_sources, random_boxes, target_size


def write_tree(root: Path, images: int, synsets: int, seed: int = 0) -> dict:
    """The JPEG tree (see the module docstring) and its three text files; returns its statistics."""
    manifest = root / "tree.json"
    want = dict(images=images, synsets=synsets, seed=seed)
    if manifest.is_file() and json.loads(manifest.read_text()).get("want") == want:
        return json.loads(manifest.read_text())
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng([seed, 0xB111D])
    colour, gray = load_sources()
    names = [f"n{90000000 + s:08d}" for s in range(synsets)]
    lines, nbytes, sizes = [], [], []
    for i in range(images):
        width, height = target_size(rng)
        source = gray if rng.uniform() < GRAY_FRACTION else colour
        jpeg, _ = encode(rng, cut(rng, source[int(rng.integers(len(source)))], width, height))
        synset = names[i % synsets]
        name = f"{synset}_{i}.JPEG"
        (root / "train" / synset).mkdir(parents=True, exist_ok=True)
        (root / "train" / synset / name).write_bytes(jpeg)
        for y0, x0, y1, x1 in random_boxes(rng):
            lines.append(f"{name},{x0:.4f},{y0:.4f},{x1:.4f},{y1:.4f}\n")
        nbytes.append(len(jpeg))
        sizes.append((width, height))
    (root / "synsets.txt").write_text("".join(s + "\n" for s in names))
    (root / "metadata.txt").write_text("".join(f"{s}\tbench class {s}\n" for s in names))
    (root / "boxes.csv").write_text("".join(lines))
    stats = dict(
        want=want,
        mean_width=float(np.mean([w for w, _ in sizes])),
        mean_height=float(np.mean([h for _, h in sizes])),
        mean_jpeg_bytes=float(np.mean(nbytes)),
        boxes=len(lines),
    )
    manifest.write_text(json.dumps(stats, indent=1) + "\n")
    return stats


def _timed(command: list[str], cwd: Path) -> tuple[float, float, str]:
    """(wall seconds, process-tree CPU seconds, stdout) of a command run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{command[:4]} failed:\n{done.stdout}\n{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def run_fasttrain(tree: Path, out: Path, workers: int, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "fasttrain.data", "build", f"--train_directory={tree / 'train'}"]
    command += [f"--output_directory={out}", f"--labels_file={tree / 'synsets.txt'}"]
    command += [
        f"--imagenet_metadata_file={tree / 'metadata.txt'}",
        f"--bounding_box_file={tree / 'boxes.csv'}",
    ]
    # 16 shards (the results' setting); a tree of fewer images gets 8, which the build needs at least
    # one image each of (it refuses empty shards).
    images = len(list((tree / "train").glob("*/*.JPEG")))
    shards = 16 if images >= 16 else 8
    command += [f"--train_shards={shards}", "--num_threads=8", f"--workers={workers}", *extra]
    wall, tree_cpu, stdout = _timed(command, ROOT)
    m = re.search(
        r"wrote (\d+) images in \d+ shards .* in ([\d.]+) s \((\d+) images/s, ([\d.]+) CPU ms", stdout
    )
    images, build_seconds, _, job_ms = int(m[1]), float(m[2]), int(m[3]), float(m[4])
    return dict(
        wall=wall,
        build_seconds=build_seconds,
        images=images,
        job_cpu_ms=job_ms,
        tree_cpu_ms=1e3 * tree_cpu / images,
    )


def run_tf(tree: Path, out: Path, tf_python: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # Timed inside the interpreter, around the build only (TensorFlow's import takes seconds).
    code = (
        "import sys, time; from pathlib import Path; sys.path.insert(0, 'tests/data'); "
        "import make_tf_build as m; "
        "coder = m.Coder(); wall, cpu = time.perf_counter(), time.process_time(); "
        f"m.tf_build(Path({str(tree)!r}), Path({str(out)!r}), coder, {{}}, {{'train': 16}}, 8); "
        "print('timed', time.perf_counter() - wall, time.process_time() - cpu)"
    )
    _, _, stdout = _timed([tf_python, "-c", code], ROOT)
    wall, cpu = (float(v) for v in re.search(r"timed ([\d.]+) ([\d.]+)", stdout).groups())
    images = sum(1 for _ in (tree / "train").glob("*/*.JPEG"))
    return dict(build_seconds=wall, images=images, tree_cpu_ms=1e3 * cpu / images)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "fasttrain-bench-build-tree"))
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--synsets", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tf-python", default=None)
    args = p.parse_args(argv)
    out, tree = Path(args.out), Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    stats = write_tree(tree, args.images, args.synsets)
    scratch = Path(tempfile.mkdtemp(prefix="fasttrain-bench-build-"))
    rows = {"fasttrain": [], "fasttrain+index": ["--write_index"], "fasttrain+rows": ["--row_checkpoints"]}
    names = list(rows) + (["tf-script"] if args.tf_python else [])
    load_before = os.getloadavg()
    run_fasttrain(tree, scratch / "warm", args.workers, [])  # untimed: the tree into the page cache
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name == "tf-script":
                runs[name].append(run_tf(tree, scratch / name, args.tf_python))
            else:
                runs[name].append(run_fasttrain(tree, scratch / name, args.workers, rows[name]))
            print(name, runs[name][-1], flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    summary = {}
    for name, results in runs.items():
        row = {k: statistics.median(r[k] for r in results) for k in results[0]}
        cpu_ms = row.get("job_cpu_ms", row["tree_cpu_ms"])
        row["images_per_core_second"] = 1e3 / cpu_ms
        row["images_per_second"] = row["images"] / row["build_seconds"]
        summary[name] = row
    result = dict(
        environment=environment(torch.device("cpu"), sys.argv),
        tree=stats,
        workers=args.workers,
        rounds=args.rounds,
        load_average_before=load_before,
        load_average_after=os.getloadavg(),
        runs=runs,
        summary=summary,
    )
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "| row | images/s | CPU ms / image (jobs) | CPU ms / image (process tree) | images/s per core |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in summary.items():
        jobs = f"{row['job_cpu_ms']:.2f}" if "job_cpu_ms" in row else "-"
        lines.append(
            f"| {name} | {row['images_per_second']:.0f} | {jobs} | {row['tree_cpu_ms']:.2f} | "
            f"{row['images_per_core_second']:.0f} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
