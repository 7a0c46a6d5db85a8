"""Checks, in seconds, that the benchmark suite can run here; prints the versions it runs on.

    python bench/preflight.py       exit 0, or 3 with one line naming what is missing

bench/device_run.sh runs it before minutes of measurements depend on it: the lent GPU machine has no
network, so a missing package must be carried there (bench/device_wheels.sh).
"""

import importlib
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (module, what to do when it is missing)
REQUIRED = (
    ("google_crc32c", "run `bash bench/device_wheels.sh` where PyPI is reachable and carry .whl/"),
    ("torch", "install the torch build for this machine's CUDA"),
    ("triton", "install triton (it comes with Linux builds of torch)"),
    ("pytest_benchmark", "install pytest-benchmark"),
    ("fasttrain.train", "run from the repository root or with it on PYTHONPATH"),
    ("fasttrain.kernels.rmsprop_tf", "run from the repository root or with it on PYTHONPATH"),
)


def main() -> int:
    for module, remedy in REQUIRED:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            print(f"bench/preflight.py: cannot import {module} ({exc}): {remedy}", file=sys.stderr)
            return 3
    import torch
    import triton

    from fasttrain.data import dali_available

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    print(
        f"bench/preflight.py: python {sys.version.split()[0]}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), triton {triton.__version__}, "
        f"DALI {'yes' if dali_available() else 'no'}, {gpu}"
    )
    if Path("/dev/shm").is_dir():
        # DataLoader workers hand batches over in shared memory: 14 workers x 2 prefetched x 256
        # images at 299 px is about 2 GB. Too little makes every torch-pipeline row fail.
        free_gb = shutil.disk_usage("/dev/shm").free / 1e9
        note = "" if free_gb >= 4 else " (too little for the torch pipeline's workers at batch 256)"
        print(f"bench/preflight.py: /dev/shm has {free_gb:.1f} GB free{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
