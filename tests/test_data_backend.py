"""--data_backend auto (fasttrain.data.resolve_backend) and what a run says about its input.

auto takes DALI only where it is the faster path, its GPU decode on a CUDA device: on a CPU, DALI's
CPU mode ran at 0.29x of the torch backend on real photos (issue 38), is not TensorFlow's pixels and
reads no row checkpoints. DALI's presence is patched in, so the rule is tested with and without the
package installed. The trainer names the resolved backend and loader on its start-up line and in
config.json, never "auto".
"""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import fasttrain.data
import fasttrain.train
from fasttrain.config import make_config
from fasttrain.data import build_loader, dali_available, resolve_backend
from fasttrain.data.synthetic import make_synthetic
from fasttrain.train import train

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _dali_of_version(monkeypatch, version: str) -> None:
    """DALI as if installed at `version` (a stand-in module: CI's DALI, or none, is another release)."""
    nvidia = types.ModuleType("nvidia")
    nvidia.dali = types.SimpleNamespace(__version__=version)
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)
    monkeypatch.setitem(sys.modules, "nvidia.dali", nvidia.dali)
    monkeypatch.setattr(fasttrain.data, "dali_available", lambda: True)


def test_auto_takes_dali_only_for_its_gpu_decode(monkeypatch):
    _dali_of_version(monkeypatch, "1.44.0")
    auto = make_config(data_backend="auto")
    assert resolve_backend(auto, CPU) == "torch"  # not DALI's CPU mode
    assert resolve_backend(auto) == "torch"  # no device: a loader on the CPU
    assert resolve_backend(auto, CUDA) == "dali"
    assert resolve_backend(dataclasses.replace(auto, skip_corrupt=True), CUDA) == "torch"
    assert resolve_backend(make_config(data_backend="dali"), CPU) == "dali"  # asked for by name
    assert resolve_backend(make_config(data_backend="synthetic"), CUDA) == "synthetic"
    # A DALI older than the pipeline needs: auto chose it, and the loader then refused to run.
    _dali_of_version(monkeypatch, "1.30.0")
    assert resolve_backend(auto, CUDA) == "torch"
    monkeypatch.setattr(fasttrain.data, "dali_available", lambda: False)
    assert resolve_backend(auto, CUDA) == "torch"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("backend-data")
    make_synthetic(root, train_shards=1, val_shards=1, per_shard=16, classes=4, seed=1)
    return root


def _cfg(data, tmp_path, **overrides):
    values = dict(model="resnet18", base_channels=8, image_size=32, batch_size=4, num_classes=4)
    values.update(data_dir=str(data), data_cache_dir=str(tmp_path / "cache"), label_offset=-1)
    values.update(device="cpu", max_steps=1, log_every=1, eval_at_end=False, tensorboard=False)
    values.update(train_dir=str(tmp_path / "run"), num_workers=1, data_backend="auto")
    return make_config(**{**values, **overrides})


@pytest.mark.parametrize(
    "loader, words", [("threads", "torch, 1 loader thread"), ("processes", "torch, 1 DataLoader process")]
)
def test_a_cpu_run_with_auto_says_it_used_the_torch_backend(
    shards, tmp_path, monkeypatch, capsys, loader, words
):
    monkeypatch.setattr(fasttrain.data, "dali_available", lambda: True)  # as after the test install
    train(_cfg(shards, tmp_path, loader=loader))
    start_up = next(line for line in capsys.readouterr().out.splitlines() if "steps/epoch" in line)
    assert f"| data {shards} ({words}) |" in start_up
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data_backend"] == "torch" and saved["loader"] == loader


def test_each_loader_describes_itself(shards):
    cfg = make_config(data_dir=str(shards), data_backend="torch", num_workers=3, batch_size=4)
    assert build_loader(cfg, "train", training=True).description == "torch, 3 loader threads"
    processes = dataclasses.replace(cfg, loader="processes")
    assert build_loader(processes, "train", training=True).description == "torch, 3 DataLoader processes"
    deterministic = dataclasses.replace(cfg, deterministic=True)
    assert build_loader(deterministic, "train", training=True).description == "torch, 1 loader thread"
    synthetic = dataclasses.replace(cfg, data_backend="synthetic", image_size=8)
    assert build_loader(synthetic, "train", training=True).description == "synthetic"


def test_build_loader_resolves_auto_workers_and_loader_for_its_device(shards, monkeypatch):
    import fasttrain.threads

    monkeypatch.setattr(fasttrain.threads, "available_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = make_config(data_dir=str(shards), data_backend="torch", batch_size=4, num_workers=None)
    assert build_loader(cfg, "train", training=True).description == "torch, 4 loader threads"  # CPU
    on_cuda = build_loader(cfg, "train", training=True, device=CUDA)  # (not started: no GPU needed)
    assert on_cuda.description == "torch, 15 DataLoader processes"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    on_cuda = build_loader(cfg, "train", training=True, device=CUDA)
    assert on_cuda.description == "torch, 3 loader threads"


def test_the_command_line_counts_the_workers_auto_will_start(monkeypatch):
    # fasttrain.__main__ sets torch's intra-op threads from this before the trainer builds its loader
    import fasttrain.threads

    monkeypatch.setattr(fasttrain.threads, "available_cores", lambda: 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(fasttrain.data, "dali_available", lambda: False)
    auto = make_config(num_workers=None, data_backend="auto")
    assert fasttrain.data.startup_workers(auto) == 15  # torch backend, CUDA
    assert fasttrain.data.startup_workers(dataclasses.replace(auto, device="cpu")) == 4
    monkeypatch.setattr(fasttrain.data, "dali_available", lambda: True)
    assert fasttrain.data.startup_workers(auto) == 4  # auto takes DALI's GPU decode: its 4 threads
    assert fasttrain.data.startup_workers(dataclasses.replace(auto, data_backend="synthetic")) == 0


def test_processes_asked_for_with_too_little_shared_memory_get_a_note(shards, monkeypatch):
    import fasttrain.data.torch_pipeline

    monkeypatch.setattr(fasttrain.data.torch_pipeline, "shared_memory_free", lambda: 2**20)
    cfg = make_config(data_dir=str(shards), data_backend="torch", batch_size=4, num_workers=3, image_size=224)
    loader = build_loader(dataclasses.replace(cfg, loader="processes"), "train", training=True)
    assert loader.description == "torch, 3 DataLoader processes"  # as asked
    assert any(n.startswith("note: /dev/shm has 1 MiB free, 3 DataLoader processes") for n in loader.notes)
    monkeypatch.setattr(fasttrain.data.torch_pipeline, "shared_memory_free", lambda: 2**30)
    loader = build_loader(dataclasses.replace(cfg, loader="processes"), "train", training=True)
    assert not any("/dev/shm" in n for n in loader.notes)


def test_a_run_whose_auto_loader_lacks_shared_memory_says_why(shards, tmp_path, capsys, monkeypatch):
    import fasttrain.threads

    monkeypatch.setattr(fasttrain.threads, "shared_memory_free", lambda: 2**10)
    train(_cfg(shards, tmp_path, num_workers=8, data_backend="torch", loader="auto"))
    start_up = next(line for line in capsys.readouterr().out.splitlines() if "steps/epoch" in line)
    said = "(torch, 8 loader threads; threads, not processes: /dev/shm has 1 KiB free, 8 DataLoader"
    assert said in start_up
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["num_workers"], saved["loader"]) == (8, "threads")


def test_a_run_left_to_auto_says_so_and_saves_what_it_resolved(shards, tmp_path, capsys, monkeypatch):
    import fasttrain.threads

    monkeypatch.setattr(fasttrain.threads, "available_cores", lambda: 16)
    monkeypatch.setattr(fasttrain.train, "available_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    train(_cfg(shards, tmp_path, num_workers=None, data_backend="torch"))
    start_up = next(line for line in capsys.readouterr().out.splitlines() if "steps/epoch" in line)
    assert f"| data {shards} (torch, 4 loader threads; auto for 16 cores, 1 rank) |" in start_up
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["num_workers"], saved["loader"]) == (4, "threads")


@pytest.mark.skipif(not dali_available(), reason="needs NVIDIA DALI (pip install 'fasttrain[dali]')")
def test_dali_named_on_a_cpu_says_it_runs_its_cpu_mode(shards):
    cfg = make_config(data_dir=str(shards), data_backend="dali", num_workers=2, batch_size=4, label_offset=-1)
    assert (
        build_loader(cfg, "train", training=True, device=CPU).description == "dali, CPU mode, 2 CPU threads"
    )


def test_the_evaluator_resolves_a_dali_runs_backend_for_its_own_device(tmp_path):
    """config.json holds the backend resolved for the run's device: evaluating that run elsewhere (a
    CPU machine, one without DALI) resolves it again, as "auto" did before it was saved resolved."""
    from fasttrain.eval_settings import parse, run_config

    for saved, now in (("dali", "auto"), ("torch", "torch"), ("synthetic", "synthetic")):
        run = tmp_path / saved
        run.mkdir()
        (run / "config.json").write_text(make_config(data_backend=saved).to_json())
        assert run_config(run, parse([str(run)])).data_backend == now


def test_the_test_extra_leaves_dali_out_and_its_tests_skip_without_it():
    """DALI's tests run its CPU mode only; the test extra does not bring its 1 GB of CUDA libraries
    (README, "Run the test suite"), so those tests must skip, not fail, where DALI does not import."""
    repo = Path(__file__).resolve().parents[1]
    setup = ast.parse((repo / "setup.py").read_text())
    call = next(
        n for n in ast.walk(setup) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
    )
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    assert not [r for r in extras["test"] if "dali" in r] and any("dali" in r for r in extras["dali"])
    # The child sees nvidia.dali as not installed: importing it raises ImportError.
    hide_dali = (
        "import sys; sys.modules['nvidia.dali'] = None; import pytest; sys.exit(pytest.main(sys.argv[1:]))"
    )
    files = [
        "tests/test_dali_pipeline.py",
        "tests/test_vgg_dali.py",
        "tests/test_data_backend.py::test_dali_named_on_a_cpu_says_it_runs_its_cpu_mode",
    ]
    out = subprocess.run(
        [sys.executable, "-c", hide_dali, "-q", "-rs", "-p", "no:cacheprovider", *files],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "3 skipped" in out.stdout and "NVIDIA DALI is not installed" in out.stdout
