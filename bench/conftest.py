"""Shared set-up for the pytest-benchmark files bench/bench_*.py (python -m pytest bench/bench_x.py).

- Without CUDA, TRITON_INTERPRET=1 is set before anything imports triton, so Triton kernels run on
  CPU tensors in Triton's interpreter (tiny sizes only: it is slow).
- Tests marked `gpu` are skipped without CUDA, as in tests/.
- `env_info`: where the numbers were measured (GPU, driver, CUDA, torch, triton, DALI, CPU, date,
  command, commit; bench/common.py's `environment`), for `benchmark.extra_info.update(env_info)`.
- FASTTRAIN_BENCH_SMOKE=1 (CI: `FASTTRAIN_BENCH_SMOKE=1 python -m pytest bench --benchmark-only`)
  runs every benchmark at a size that proves it works in seconds, not one that measures anything:
  bench_optim.py builds its models narrow, and the other files' size knobs default to small values
  here (each still wins when set explicitly).

pytest collects bench_*.py because pyproject.toml's python_files lists that pattern. bench/ is a
package, so pytest puts its parent, the repository root, on the import path: the files import
`bench.common` and this checkout's fasttrain.
"""

import os
import sys

import pytest
import torch

from bench.common import environment

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("FASTTRAIN_BENCH_SMOKE") == "1":
    # Read by the bench files at import, which comes after this conftest's.
    for knob, value in {"SIZE": "32", "BATCH": "2", "ROUNDS": "1"}.items():
        os.environ.setdefault(f"FASTTRAIN_BENCH_{knob}", value)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def env_info() -> dict:
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    return environment(device, ["-m", "pytest", *sys.argv[1:]])
