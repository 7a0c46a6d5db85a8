"""CPU cost of the train crop decode with and without row checkpoints (fasttrain/data/jpeg/), one thread.

    python -m bench.bench_jpeg_rows [--data DIR] [--images 600] [--rounds 5]

On the first `--images` records of DIR's first train shard (default: the input bench's photo set,
/tmp/fasttrain-photos-2048-32768-8, which `python -m bench.photo_shards` writes), with the windows
fasttrain draws (resnet: transforms.sample_train_params(...).crop; vgg: vgg.source_window of
vgg.sample_train_params at 224), per image:
- today: jpeg.decode_and_crop_jpeg (resnet) / jpeg.decode_window_rows (vgg), libjpeg-turbo's crop decode;
- rows: jpeg_rows.decode_and_crop / jpeg_rows.decode_window_rows, the doctor step included;
- doctor: the doctor step alone (building the doctored stream);
- build: jpeg_scan.row_checkpoints (the one-time index build) and its bytes per image in a sidecar.
Times are process CPU time (time.process_time, user + sys) per image, the contenders alternating
within each round over the same windows, with wall time and the load average beside them; split by
JPEG kind: "baseline" (checkpoints exist) and "fallback" (progressive: no checkpoints, today's path).
Every rows-path window is first checked equal to today's pixels.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from fasttrain.data import transforms, vgg
from fasttrain.data.imagenet import decode_record, list_shards
from fasttrain.data.jpeg import decode as jpeg
from fasttrain.data.jpeg import doctor as jpeg_rows
from fasttrain.data.tfrecord import iter_records

DEFAULT_DATA = "/tmp/fasttrain-photos-2048-32768-8"


def _records(data_dir: str, count: int):
    shard = list_shards(data_dir, "train", check=False)[0]
    out = []
    for offset, payload in iter_records(shard, verify=False):
        out.append(decode_record(payload, shard, offset, 0, 1001))
        if len(out) == count:
            break
    return shard, out


def _windows(records, setting: str, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for record in records:
        height, width = jpeg.jpeg_size(record.jpeg)
        if setting == "resnet":
            out.append(transforms.sample_train_params(rng, height, width, record.boxes, "resnet", False).crop)
        else:
            params = vgg.sample_train_params(rng, height, width, 224)
            out.append(vgg.source_window(height, width, params, 224))
    return out


def _time(fn, items, rounds: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per item, the best round of `rounds` (the least disturbed by other work)."""
    cpu, wall = [], []
    for _ in range(rounds):
        c, w = time.process_time(), time.perf_counter()
        for item in items:
            fn(*item)
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return 1e3 * min(cpu) / max(len(items), 1), 1e3 * min(wall) / max(len(items), 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=DEFAULT_DATA)
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"load before: {open('/proc/loadavg').read().strip()}")
    shard, records = _records(args.data, args.images)
    jpegs = [r.jpeg for r in records]
    jpeg_rows.row_checkpoints(jpegs[0])  # compile (or load numba's cache) outside the timing
    start = time.process_time()
    checkpoints = [jpeg_rows.row_checkpoints(j) for j in jpegs]
    build_ms = 1e3 * (time.process_time() - start) / len(jpegs)
    rows = sum(c.shape[0] for c in checkpoints if c is not None)
    print(
        f"{shard}: {len(jpegs)} images, {np.mean([len(j) for j in jpegs]) / 1e3:.1f} kB mean; "
        f"{sum(c is not None for c in checkpoints)} with checkpoints"
    )
    print(
        f"index build: {build_ms:.3f} CPU ms/image; sidecar {(10 * rows + 16 * len(jpegs)) / len(jpegs):.0f} "
        f"bytes/image ({rows / len(jpegs):.0f} checkpoint lines)"
    )
    for setting in ("resnet", "vgg"):
        windows = _windows(records, setting, seed=1)
        if setting == "resnet":
            today, rows_path = jpeg.decode_and_crop_jpeg, jpeg_rows.decode_and_crop
        else:
            today, rows_path = jpeg.decode_window_rows, jpeg_rows.decode_window_rows
        for j, c, w in zip(jpegs, checkpoints, windows):  # exactness first
            expected, got = today(j, w), rows_path(j, c, w)
            if setting == "vgg":  # (rows, x): the window's columns from x on
                assert expected[1] == got[1]
                span = slice(3 * (w[1] - got[1]), 3 * (w[1] - got[1] + w[3]))
                np.testing.assert_array_equal(expected[0][:, span], got[0][:, span])
            else:
                np.testing.assert_array_equal(expected, got)
        doctored = [
            jpeg_rows.doctor(j, c, *w) is not None if c is not None else False
            for j, c, w in zip(jpegs, checkpoints, windows)
        ]
        tops = [w[0] / jpeg.jpeg_size(j)[0] for j, w in zip(jpegs, windows)]
        print(f"\n{setting}: mean window top {np.mean(tops):.1%} down; {np.mean(doctored):.1%} doctored")
        print(
            f"  {'kind':9s} {'images':>6s} {'today ms':>9s} {'rows ms':>9s} {'saved':>6s} {'doctor us':>9s}"
            "   (CPU per image; wall in brackets)"
        )
        total_today = total_rows = 0.0
        for kind in ("baseline", "fallback"):
            pick = [i for i, c in enumerate(checkpoints) if (c is not None) == (kind == "baseline")]
            if not pick:
                continue
            items_today = [(jpegs[i], windows[i]) for i in pick]
            items_rows = [(jpegs[i], checkpoints[i], windows[i]) for i in pick]
            t_cpu, t_wall = _time(today, items_today, args.rounds)
            r_cpu, r_wall = _time(rows_path, items_rows, args.rounds)
            d_cpu = 0.0
            if kind == "baseline":
                d_cpu, _ = _time(
                    jpeg_rows.doctor, [(jpegs[i], checkpoints[i], *windows[i]) for i in pick], args.rounds
                )
            total_today += t_cpu * len(pick)
            total_rows += r_cpu * len(pick)
            print(
                f"  {kind:9s} {len(pick):6d} {t_cpu:9.3f} {r_cpu:9.3f} {1 - r_cpu / t_cpu:6.1%} "
                f"{1e3 * d_cpu:9.1f}   ({t_wall:.3f} / {r_wall:.3f})"
            )
        print(
            f"  {'all':9s} {len(jpegs):6d} {total_today / len(jpegs):9.3f} {total_rows / len(jpegs):9.3f} "
            f"{1 - total_rows / total_today:6.1%}"
        )
    print(f"\nload after: {open('/proc/loadavg').read().strip()}  (cores: {os.cpu_count()})")


if __name__ == "__main__":
    main()
