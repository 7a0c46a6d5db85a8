"""bench/gpu_caches.py: inductor's cache packed at the end of one GPU run and unpacked at the start of the
next, only where torch, Triton, CUDA, the GPU and Python are the same; what cannot come back is left out
with a line saying why."""

import json
import os
import random
import subprocess
import sys
import tarfile
import time

from bench import gpu_caches

H200 = dict(torch="2.11.0+cu130", triton="3.6.0", cuda="13.0", gpu="NVIDIA H200", python="3.12.3")


def _cache(work, files=None):
    root = gpu_caches.cache_dir(work)
    files = files or {
        "fxgraph/ab/entry": b"graph",
        "triton/0/k.cubin": b"\x7fELF" + bytes(100),
        "a.lock": b"",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_a_packed_cache_unpacks_into_the_next_runs_work_folder(tmp_path):
    _cache(tmp_path / "run1")
    out = tmp_path / "out"
    out.mkdir()
    line = gpu_caches.pack(tmp_path / "run1", out, H200 | {"date": "2026-11-28"})
    assert line.startswith("caches: packed into caches.tar.gz"), line
    line = gpu_caches.unpack(out / "caches.tar.gz", tmp_path / "run2", H200)
    assert "2 cache entries (inductor's, numba's) unpacked" in line, line  # the lock file is not carried
    root = gpu_caches.cache_dir(tmp_path / "run2")
    assert (root / "fxgraph/ab/entry").read_bytes() == b"graph"
    assert (root / "triton/0/k.cubin").read_bytes() == b"\x7fELF" + bytes(100)
    assert not (root / "a.lock").exists() and not (root / "caches.json").exists()
    # The steps' processes are pointed at that folder.
    assert gpu_caches.environment(tmp_path / "run2") == {
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "NUMBA_CACHE_DIR": str(root / "numba"),
    }


def test_a_cache_made_with_another_torch_or_gpu_is_not_unpacked(tmp_path):
    _cache(tmp_path / "run1")
    gpu_caches.pack(tmp_path / "run1", tmp_path, H200 | {"date": "2026-11-28"})
    for changed in (dict(torch="2.12.0+cu130"), dict(gpu="NVIDIA H100 80GB HBM3")):
        line = gpu_caches.unpack(tmp_path / "caches.tar.gz", tmp_path / "run2", H200 | changed)
        assert "was made with another" in line and "compiles start cold" in line, line
        assert list(changed.values())[0] in line
        assert not gpu_caches.cache_dir(tmp_path / "run2").exists()


def test_missing_corrupt_or_already_there_each_say_so_and_unpack_nothing(tmp_path):
    line = gpu_caches.unpack(tmp_path / "nothing.tar.gz", tmp_path / "run", H200)
    assert line.startswith("caches: no ") and "compiles start cold" in line
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a tar file at all")
    line = gpu_caches.unpack(bad, tmp_path / "run", H200)
    assert "could not be read" in line and str(bad) in line, line
    with tarfile.open(tmp_path / "nostamp.tar.gz", "w:gz"):
        pass
    assert "could not be read" in gpu_caches.unpack(tmp_path / "nostamp.tar.gz", tmp_path / "run", H200)
    assert not gpu_caches.cache_dir(tmp_path / "run").exists()
    # A later part (--resume) keeps the cache its work folder holds.
    _cache(tmp_path / "run1")
    gpu_caches.pack(tmp_path / "run1", tmp_path, H200 | {"date": "2026-11-28"})
    line = gpu_caches.unpack(tmp_path / "caches.tar.gz", tmp_path / "run1", H200)
    assert "already holds a cache" in line


def test_a_pack_over_what_comes_back_is_left_out_and_an_older_one_removed(tmp_path, monkeypatch):
    _cache(tmp_path / "run", {"triton/big.cubin": bytes(range(256)) * 4096})
    (tmp_path / "caches.tar.gz").write_bytes(b"an earlier part's")
    monkeypatch.setattr(gpu_caches, "LIMIT_BYTES", 1000)
    line = gpu_caches.pack(tmp_path / "run", tmp_path, H200 | {"date": "2026-11-28"})
    assert "over what comes back (16 MiB); not kept" in line, line
    assert not (tmp_path / "caches.tar.gz").exists()
    line = gpu_caches.pack(tmp_path / "empty", tmp_path, H200 | {"date": ""})
    assert line == "caches: the caches are empty; nothing packed"


def test_the_stamp_is_read_from_the_preflights_environment(tmp_path):
    _cache(tmp_path / "run")
    gpu_caches.pack(tmp_path / "run", tmp_path, H200 | {"numpy": "2.5.2"} | {"date": "2026-11-28"})
    with tarfile.open(tmp_path / "caches.tar.gz") as tar:
        assert json.loads(tar.extractfile("caches.json").read()) == H200 | {"date": "2026-11-28"}


def test_a_gpu_run_points_every_step_at_its_work_folders_cache_and_the_dry_run_does_not(tmp_path):
    from bench.gpu_plan import parse_args
    from bench.gpu_run import Driver

    gpu = Driver(parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]))
    assert gpu.env["TORCHINDUCTOR_CACHE_DIR"] == str(gpu_caches.cache_dir(tmp_path / "work") / "inductor")
    assert gpu.env["NUMBA_CACHE_DIR"] == str(gpu_caches.cache_dir(tmp_path / "work") / "numba")
    assert gpu.args.caches.endswith("/.gpu_cache/caches.tar.gz")  # what carry=[".gpu_cache"] brings
    dry = Driver(parse_args(["--out", str(tmp_path / "o2"), "--work", str(tmp_path / "w2"), "--dry-run"]))
    for name in ("TORCHINDUCTOR_CACHE_DIR", "NUMBA_CACHE_DIR"):
        assert dry.env.get(name) == os.environ.get(name)


def test_over_the_limit_triton_s_intermediate_files_are_left_out_first(tmp_path, monkeypatch):
    noise = random.Random(1).randbytes(40_000)  # incompressible
    _cache(tmp_path / "run", {"triton/k/k.ptx": noise, "triton/k/k.llir": noise, "triton/k/k.cubin": b"bin"})
    monkeypatch.setattr(gpu_caches, "LIMIT_BYTES", 60_000)
    line = gpu_caches.pack(tmp_path / "run", tmp_path, H200 | {"date": "2026-11-28"})
    assert "without Triton's IR files" in line and "packed into caches.tar.gz" in line, line
    with tarfile.open(tmp_path / "caches.tar.gz") as tar:
        assert set(tar.getnames()) == {"caches.json", "triton/k/k.cubin"}


NUMBA_MODULE = """
import numba


@numba.njit(cache=True)
def twice(x):
    return 2 * x
"""

NUMBA_CALL = """
import sys
sys.path.insert(0, sys.argv[1])
import carried
assert carried.twice(21) == 42
print(carried.twice.stats.cache_hits.most_common() and "hit" or "miss")
"""


def test_numbas_cache_holds_for_a_fresh_copy_of_the_same_source_in_the_same_place(tmp_path):
    # What carrying numba's cache relies on: a device call copies the checkout afresh (the same bytes
    # and path, new mtimes), and numba keys its cache on the source's contents, not its mtime.
    src, cache = tmp_path / "src", tmp_path / "cache"
    src.mkdir()
    module = src / "carried.py"

    def run():
        env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
        cmd = [sys.executable, "-c", NUMBA_CALL, str(src)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    module.write_text(NUMBA_MODULE)
    assert run() == "miss"  # compiled and cached in NUMBA_CACHE_DIR
    module.unlink()
    module.write_text(NUMBA_MODULE)  # a fresh copy
    os.utime(module, (time.time() + 3600, time.time() + 3600))
    assert run() == "hit"
    module.write_text(NUMBA_MODULE.replace("2 * x", "x + x"))
    assert run() == "miss"  # changed code compiles again
