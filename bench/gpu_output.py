"""bench/gpu_run.py's output: results.json (also the work folder's, which --resume continues from),
summary.md (bench/gpu_report.py), selfcheck.json, gpu_tests.txt and logs.tar.gz in the output folder,
each written whole or not at all, rewritten after every step."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

from bench import gpu_report
from fasttrain.checkpoint import write_atomic


def write_outputs(results: dict, work: Path, out: Path) -> None:
    """Gather the work folder's results into `results` and write every output file."""
    results["rows"] = read_jsonl(work / "rows.jsonl")
    results["profiles"] = read_jsonl(work / "rows.profile.jsonl")  # bench.throughput's profile records
    for name in ("bench_optim.json", "e2e.json", "selfcheck.json"):
        path = work / name
        if path.exists():
            try:
                results[name.split(".")[0]] = json.loads(path.read_text())
            except ValueError:  # being written right now: the next save has it
                pass
    for path in sorted(work.glob("inductor_bw-*.json")):  # bench.inductor_bw's, one per setting
        try:
            results.setdefault("inductor_bw", {})[path.stem.removeprefix("inductor_bw-")] = json.loads(
                path.read_text()
            )
        except ValueError:
            pass
    text = json.dumps(results, indent=1, default=str)
    atomic_write(out / "results.json", text)
    atomic_write(work / "results.json", text)  # what --resume continues from
    atomic_write(out / "summary.md", gpu_report.render(results))
    for name in ("selfcheck.json", "gpu_tests.txt"):
        if (work / name).exists():
            shutil.copyfile(work / name, out / name)
    atomic_write(out / "logs.tar.gz", bundle(work))


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut off by a kill
            pass
    return rows


def bundle(work: Path) -> bytes:
    """Every log and result in the work folder (not the shards or the trainers' checkpoints)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(work.rglob("*")):
            keep = (
                path.suffix in (".log", ".txt", ".json", ".jsonl", ".xml", ".md")
                and "shards" not in path.parts
                and "caches" not in path.parts  # inductor's cache: caches.tar.gz (bench/gpu_caches.py)
            )
            if path.is_file() and keep and path.stat().st_size < 4 * 2**20:
                tar.add(path, arcname=str(path.relative_to(work)))
    return buf.getvalue()


def atomic_write(path: Path, data: str | bytes) -> None:
    write_atomic(path, lambda f: f.write(data.encode() if isinstance(data, str) else data))
