"""Inductor's and numba's compile caches carried from one GPU run to the next (bench/gpu_run.py).

Every lent GPU machine starts bare, and a session has 15 minutes of it: in the fourth run (2026-11-28)
the cold compiles of ResNet-50's and Inception v3's columns (f) and (d) kept the untimed lanes busy for
307 s, where the same compiles from inductor's cache take 16-27 s each. So the run keeps inductor's
cache in its work folder (TORCHINDUCTOR_CACHE_DIR: FX graphs, AOTAutograd's, Triton's kernels and
their tuned configurations) and packs it into OUT/caches.tar.gz (at most 16 MiB comes back in a file;
a larger pack is left out, with a line saying its size). Here, the next session puts that file in
.gpu_cache/ (git-ignored) and the device call carries it: carry=[".whl", ".gpu_cache"]; the run
unpacks it before anything compiles, if it was made with the same torch, Triton, CUDA and GPU (its
caches.json says), else says why not and compiles cold. Inductor's own keys decide each hit; a model
whose code changed since compiles that region cold. numba's cache (NUMBA_CACHE_DIR: the loaders'
JPEG and resize kernels, 55 s cold on that machine) travels in the same file: numba (0.62 and newer)
keys it on the source file's contents and its folder's path, both the same in each device call's fresh
copy of the checkout, and on the CPU's name and features (another CPU compiles afresh). Keep --work
the same from session to session (/tmp/gpurun): the caches' entries name the folder they were made in.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from bench.gpu_output import atomic_write

ARCHIVE = "caches.tar.gz"
STAMP = "caches.json"
LIMIT_BYTES = 16 * 2**20 - 64 * 2**10  # what a file coming back from the device may hold, less a margin
STAMP_KEYS = ("torch", "triton", "cuda", "gpu", "python")
COLD = "compiles start cold"


def cache_dir(work: Path) -> Path:
    """The caches' folder in the work folder: inductor/ and numba/."""
    return work / "caches"


def environment(work: Path) -> dict[str, str]:
    """The variables every step's process gets: inductor's and numba's caches in the work folder."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir(work) / "inductor"),
        "NUMBA_CACHE_DIR": str(cache_dir(work) / "numba"),
    }


def stamp(preflight_environment: dict) -> dict:
    return {k: str(preflight_environment.get(k)) for k in STAMP_KEYS}


def unpack(archive: Path, work: Path, preflight_environment: dict) -> str:
    """Put a carried cache into the work folder; one line saying what happened."""
    target = cache_dir(work)
    if not archive.is_file():
        return f"caches: no {archive} carried; {COLD}"
    if target.exists() and any(target.iterdir()):
        return f"caches: {target} already holds a cache (a later part); {archive.name} not unpacked"
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            member = tar.getmember(STAMP)
            made = json.loads(tar.extractfile(member).read())
            now = stamp(preflight_environment)
            differ = [f"{k} {made.get(k)} -> {now[k]}" for k in STAMP_KEYS if made.get(k) != now[k]]
            if differ:
                return f"caches: {archive.name} was made with another {', '.join(differ)}; {COLD}"
            target.mkdir(parents=True, exist_ok=True)
            members = [m for m in tar.getmembers() if m.name != STAMP]
            tar.extractall(target, members=members, filter="data")
    except (OSError, KeyError, ValueError, tarfile.TarError) as exc:
        return f"caches: {archive} could not be read ({type(exc).__name__}: {exc}); {COLD}"
    n, made_on = len(members), made.get("date")
    return f"caches: {n} cache entries (inductor's, numba's) unpacked from {archive.name} ({made_on})"


# Triton's intermediate forms of a kernel: a cached kernel loads from its metadata and its binary alone
# (triton.compiler's CompiledKernel takes the files of its group that exist), so these go first when the
# whole cache packs to more than comes back.
INTERMEDIATE = (".ttir", ".ttgir", ".llir", ".ptx", ".source")


def _archive(source: Path, made: bytes, lean: bool) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        info = tarfile.TarInfo(STAMP)
        info.size = len(made)
        tar.addfile(info, io.BytesIO(made))
        for path in sorted(source.rglob("*")):
            if not path.is_file() or path.name.endswith(".lock") or (lean and path.suffix in INTERMEDIATE):
                continue
            tar.add(path, arcname=str(path.relative_to(source)), recursive=False)
    return buf.getvalue()


def pack(work: Path, out: Path, preflight_environment: dict) -> str:
    """Pack the work folder's caches into out/caches.tar.gz (stamped with the preflight's environment
    and date); one line saying what happened."""
    source = cache_dir(work)
    if not source.is_dir() or not any(source.iterdir()):
        return "caches: the caches are empty; nothing packed"
    made = json.dumps(stamp(preflight_environment) | {"date": preflight_environment.get("date", "")}).encode()
    data, lean = _archive(source, made, lean=False), ""
    if len(data) > LIMIT_BYTES:
        whole = len(data) / 2**20
        data, lean = _archive(source, made, lean=True), f" (whole {whole:.1f} MiB; without Triton's IR files)"
    target = out / ARCHIVE
    if len(data) > LIMIT_BYTES:
        target.unlink(missing_ok=True)
        size = len(data) / 2**20
        return f"caches: the caches pack to {size:.1f} MiB{lean}, over what comes back (16 MiB); not kept"
    atomic_write(target, data)
    return f"caches: packed into {target.name} ({len(data) / 2**20:.1f} MiB{lean})"
