"""Shared test set-up: GPU-only tests skip cleanly; Triton kernels run in the interpreter on the CPU."""

import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Subprocesses (the CLI, torchrun, worker scripts) import this checkout's fasttrain, and keep what
# PYTHONPATH already held.
_REPO = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)

if HAS_CUDA:
    # cuBLAS's documented setting for run-to-run reproducible results (a fixed workspace per stream),
    # read when its first handle is made: the graph-vs-eager tests compare runs on different streams.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

if not HAS_CUDA:
    # Must be set before triton is first imported anywhere in this process: with it, @triton.jit
    # kernels run on CPU tensors in Triton's interpreter (slow: tests keep sizes small).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A synthetic set of 3 train and 2 validation shards of 40 records, 4 classes (test_data_synthetic.py
    and test_data_verify.py)."""
    # Imported here: the environment set above (TRITON_INTERPRET) must be in place before fasttrain is.
    from fasttrain.data.synthetic import make_synthetic

    out = tmp_path_factory.mktemp("synthetic")
    make_synthetic(out, train_shards=3, val_shards=2, per_shard=40, classes=4, seed=7)
    return out


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    # The CLI's main() applies fasttrain's thread policy (fasttrain/threads.py: torch.set_num_threads)
    # in the process that calls it; a test calling it in-process must not leave the tests after it on
    # another thread count, which changes oneDNN's summation order and so the last bits of results.
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
