"""Shared set-up for the pytest-benchmark files bench/bench_*.py (python -m pytest bench/bench_x.py).

- Without CUDA, TRITON_INTERPRET=1 is set before anything imports triton, so Triton kernels run on
  CPU tensors in Triton's interpreter (tiny sizes only: it is slow).
- Tests marked `gpu` are skipped without CUDA, as in tests/.
- `env_info`: where the numbers were measured (GPU, driver, CUDA, torch, triton, DALI, CPU, date,
  command, commit; bench/report.py's `environment`), for `benchmark.extra_info.update(env_info)`.
- FASTTRAIN_BENCH_SMOKE=1 (CI: `FASTTRAIN_BENCH_SMOKE=1 python -m pytest bench --benchmark-only`)
  runs every benchmark at a size that proves it works in seconds, not one that measures anything:
  bench_optim.py builds its models narrow, and the other files' size knobs default to small values
  here (each still wins when set explicitly).

pytest collects bench_*.py because pyproject.toml's python_files lists that pattern.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("FASTTRAIN_BENCH_SMOKE") == "1":
    # Read by the bench files at import, which comes after this conftest's.
    for knob, value in {"SIZE": "32", "BATCH": "2", "ROUNDS": "1"}.items():
        os.environ.setdefault(f"FASTTRAIN_BENCH_{knob}", value)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the checkout's fasttrain also under a bare `pytest`


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def env_info() -> dict:
    import report  # bench/report.py, beside this file

    device = torch.device("cuda" if HAS_CUDA else "cpu")
    return report.environment(device, ["-m", "pytest", *sys.argv[1:]], ROOT)
