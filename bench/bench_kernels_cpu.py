"""CPU cost per image of the torch pipeline's image kernels, this tree beside a git revision of it.

    PYTHONPATH=$PWD python -m bench.bench_kernels_cpu --baseline <rev> [--images 400] [--rounds 2]

Each contender runs in its own subprocess (the two fasttrain trees cannot share one interpreter), the
baseline's tree extracted with `git archive <rev> fasttrain`; the subprocesses alternate (baseline,
this tree, baseline, ...) over `--rounds` rounds and each item keeps its best round. Every item runs
single-threaded over the same records of the bench photo shard (default: the lead's cached set,
/tmp/fasttrain-photos-2048-32768-8, shard 0) with the same draws, and reports process CPU time per
image (time.process_time, best of 3 passes) beside wall time. The outputs of each item are hashed and
the hashes compared between the contenders: a change that should not alter the pixels must leave
them equal (printed as "same" / "DIFFERENT").

Items (ms per image):
    resnet       transforms._resnet_train: TF1 bilinear of the cropped-decode window to 224, uint8 out
    inc-<method> resize.resize of the Inception crop to 299 (in_scale 1/255, flip), float32 out
    inc-colour+store  distort_color then the x255 rounding store (`transforms.apply_train`'s tail)
    inc-train    transforms.apply_train, inception 299 + colour, from the decoded image
    vgg-resample vgg._window_bilinear of the decoded window rows (the vgg fast path's resample)
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_SHARD = "/tmp/fasttrain-photos-2048-32768-8/train-00000-of-00008"


def _worker(shard: str, count: int) -> dict:
    import numpy as np

    from fasttrain.data import resize as R
    from fasttrain.data import transforms as T
    from fasttrain.data import vgg
    from fasttrain.data.imagenet import decode_record
    from fasttrain.data.jpeg import decode as J
    from fasttrain.data.tfrecord import iter_records

    T.warm_up()
    records = []
    for offset, payload in iter_records(shard):
        records.append(decode_record(payload, shard, offset, 0, 1001))
        if len(records) == count:
            break
    jpegs, boxes = [r.jpeg for r in records], [r.boxes for r in records]
    n = len(jpegs)
    rng = np.random.default_rng(0)
    results = {}

    def timed(name, fn, digest):
        best_cpu = best_wall = 1e9
        for _ in range(3):
            c0, w0 = time.process_time(), time.perf_counter()
            for i in range(n):
                fn(i)
            best_cpu = min(best_cpu, time.process_time() - c0)
            best_wall = min(best_wall, time.perf_counter() - w0)
        sha = hashlib.sha256()
        for i in range(n):
            sha.update(digest(i))
        results[name] = {"cpu_ms": best_cpu / n * 1e3, "wall_ms": best_wall / n * 1e3, "sha": sha.hexdigest()}

    sizes = [J.jpeg_size(j) for j in jpegs]
    rp = [T.sample_train_params(rng, *sizes[i], boxes[i], "resnet", False) for i in range(n)]
    wins = [J.decode_and_crop_jpeg(jpegs[i], rp[i].crop) for i in range(n)]
    out224 = np.empty((224, 224, 3), np.uint8)
    sc224 = np.empty((224, 224, 3), np.float32)

    def resnet(i):
        return T._resnet_train(wins[i], rp[i].flip, 224, out224, sc224)

    timed("resnet", resnet, lambda i: resnet(i).tobytes())

    full = [J.decode_jpeg(j) for j in jpegs]
    ip = [T.sample_train_params(rng, *full[i].shape[:2], boxes[i], "inception", True) for i in range(n)]
    crops = [
        full[i][p.crop[0] : p.crop[0] + p.crop[2], p.crop[1] : p.crop[1] + p.crop[3]]
        for i, p in enumerate(ip)
    ]
    f299 = np.empty((299, 299, 3), np.float32)
    u299 = np.empty((299, 299, 3), np.uint8)
    for method in R.METHODS:

        def rs(i, method=method):
            return R.resize(crops[i], f299, method, in_scale=1 / 255, flip=ip[i].flip)

        timed(f"inc-{method}", rs, lambda i, rs=rs: rs(i).tobytes())
    resized = []
    for i in range(n):
        R.resize(crops[i], f299, ip[i].method, in_scale=1 / 255, flip=ip[i].flip)
        resized.append(f299.copy())

    fused_store = "out" in inspect.signature(T.distort_color).parameters

    def colour(i):
        f299[...] = resized[i]  # (a 1 MB copy, about 0.03 ms: in both contenders' numbers)
        if fused_store:
            T.distort_color(f299, ip[i].color, u299)
        else:
            T.distort_color(f299, ip[i].color)
            T._store(f299, u299, np.float32(255))
        return u299

    timed("inc-colour+store", colour, lambda i: colour(i).tobytes())

    def inception(i):
        return T.apply_train(full[i], ip[i], 299, "inception", u299, f299)

    timed("inc-train", inception, lambda i: inception(i).tobytes())
    for kept in (full, crops, resized):  # (memory for the vgg item)
        kept.clear()

    vp = [vgg.sample_train_params(rng, *sizes[i], 224) for i in range(n)]
    rows = []
    for i in range(n):
        window = vgg.source_window(*sizes[i], vp[i], 224)
        block, col = J.decode_window_rows(jpegs[i], window)
        rows.append((block.copy(), window[0], col, *vgg.smallest_size_at_least(*sizes[i], vp[i].side)))
    flat = out224.reshape(224, -1)

    def resample(i):
        block, r0, col, new_h, new_w = rows[i]
        p = vp[i]
        h, w = sizes[i]
        vgg._window_bilinear(block, r0, col, h, w, new_h, new_w, p.top, p.left, p.flip, flat, vgg._NO_FLOATS)
        return out224

    timed("vgg-resample", resample, lambda i: resample(i).tobytes())
    return results


def _run(tree: str, shard: str, count: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_kernels_cpu",
        "--worker",
        "--shard",
        shard,
        "--images",
        str(count),
    ]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="git revision to compare with (omit: this tree only)")
    parser.add_argument("--shard", default=DEFAULT_SHARD)
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.shard, args.images)))
        return
    here = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": here}
        if args.baseline:
            base = Path(tmp) / "baseline"
            base.mkdir()
            archive = subprocess.run(
                ["git", "-C", here, "archive", args.baseline, "fasttrain", "bench"],
                capture_output=True,
                check=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
            # this script itself, so that the baseline runs the same items
            (base / "bench" / "bench_kernels_cpu.py").write_text(Path(__file__).read_text())
            trees = {"baseline": str(base), **trees}
        print("load before:", Path("/proc/loadavg").read_text().strip())
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                for item, row in _run(tree, args.shard, args.images).items():
                    kept = best.setdefault(name, {}).get(item)
                    if kept is None or row["cpu_ms"] < kept["cpu_ms"]:
                        best[name][item] = row
        print("load after: ", Path("/proc/loadavg").read_text().strip())
    names = list(trees)
    print(
        f"{args.images} records of {args.shard}, one thread, ms per image (CPU / wall), best of {args.rounds}"
    )
    print("item".ljust(18) + "".join(n.rjust(20) for n in names) + ("  pixels" if len(names) > 1 else ""))
    for item in best[names[-1]]:
        cells = "".join(
            f"{best[n][item]['cpu_ms']:.3f} / {best[n][item]['wall_ms']:.3f}".rjust(20) for n in names
        )
        same = ""
        if len(names) > 1:
            same = "  same" if best[names[0]][item]["sha"] == best[names[1]][item]["sha"] else "  DIFFERENT"
        print(item.ljust(18) + cells + same)


if __name__ == "__main__":
    main()
