"""The CPU thread policy (fasttrain/threads.py): the arithmetic, the environment it sets before torch
loads, the explicit settings it keeps, and that the command line applies it before importing torch;
the input workers and loader that --num_workers / --loader auto give a device."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fasttrain.config import make_config
from fasttrain.threads import (
    MAX_WORKERS,
    auto_loader,
    auto_workers,
    available_cores,
    choose_input,
    configure,
    input_workers,
    intra_op_threads,
    processes_shm_bytes,
    resolve_input,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "workers, cores, ranks, expected",
    [(2, 2, 1, 1), (4, 2, 1, 1), (0, 2, 1, 2), (2, 8, 1, 6), (2, 16, 4, 2), (0, 16, 4, 4), (8, 16, 4, 1)],
)
def test_intra_op_threads_are_the_cores_left_after_the_input_workers(workers, cores, ranks, expected):
    assert intra_op_threads(workers, cores, ranks) == expected


def test_input_workers_follow_the_backend():
    def cfg(backend, deterministic=False):  # the three Config fields input_workers reads
        return SimpleNamespace(num_workers=3, data_backend=backend, deterministic=deterministic)

    assert input_workers(cfg("torch")) == 3
    assert input_workers(cfg("torch", deterministic=True)) == 1
    assert input_workers(cfg("dali")) == 3  # DALI's CPU threads
    assert input_workers(cfg("synthetic")) == 0


@pytest.mark.parametrize(
    "backend, cuda, cores, ranks, expected",
    [
        ("torch", True, 16, 1, 15),  # one H200 box: 15 workers beside the trainer's thread
        ("torch", True, 16, 4, 3),  # four ranks share the 16 cores
        ("torch", True, 96, 8, 11),
        ("torch", True, 128, 1, MAX_WORKERS),  # more would only cost memory and start-up
        ("torch", True, 2, 1, 1),
        ("torch", True, 4, 8, 1),  # more ranks than cores: still one
        ("dali", True, 16, 1, 4),  # DALI's CPU threads beside its GPU decode: as before
        ("dali", True, 8, 4, 2),
        ("torch", False, 16, 1, 4),  # the CPU: the model's threads need the cores
        ("dali", False, 2, 1, 4),
    ],
)
def test_auto_workers_are_the_ranks_share_of_the_cores_on_cuda(backend, cuda, cores, ranks, expected):
    assert auto_workers(backend, cuda, cores, ranks) == expected


def test_auto_loader_takes_processes_above_six_workers():
    # 14 threads did the work of 6.4 cores on the H200 (the GIL), 14 processes of 14.4
    assert [auto_loader(n) for n in (1, 4, 6, 7, 15)] == ["threads"] * 3 + ["processes"] * 2
    assert auto_loader(15, deterministic=True) == "threads"  # one worker either way: no processes


def test_resolve_input_fills_only_what_was_left_to_auto():
    env = {"LOCAL_WORLD_SIZE": "1"}
    auto = make_config(data_backend="torch", num_workers=None)  # the demo recipe's is 2
    assert (auto.num_workers, auto.loader) == (None, "auto")
    cuda = resolve_input(auto, True, environ=env, cores=16, shm_free=None)
    assert (cuda.num_workers, cuda.loader) == (15, "processes")
    cpu = resolve_input(auto, False, environ=env, cores=16)
    assert (cpu.num_workers, cpu.loader) == (4, "threads")
    four_ranks = resolve_input(auto, True, environ={"LOCAL_WORLD_SIZE": "4"}, cores=16)
    assert (four_ranks.num_workers, four_ranks.loader) == (3, "threads")
    dali = resolve_input(auto, True, "dali", environ=env, cores=16)
    assert dali.num_workers == 4
    chosen = make_config(data_backend="torch", num_workers=12, loader="threads")
    assert resolve_input(chosen, True, environ=env, cores=16) is chosen  # both kept
    count = resolve_input(make_config(num_workers=12), True, environ=env, cores=2, shm_free=None)
    assert (count.num_workers, count.loader) == (12, "processes")  # the loader follows the count
    loader = resolve_input(make_config(loader="threads", num_workers=None), True, environ=env, cores=16)
    assert (loader.num_workers, loader.loader) == (15, "threads")


MiB = 2**20


def test_auto_keeps_the_threads_where_shared_memory_cannot_hold_the_processes_batches():
    # A container's default /dev/shm is 64 MB; a DataLoader worker short of it dies with a bus error.
    env = {"LOCAL_WORLD_SIZE": "1"}
    cfg = make_config(data_backend="torch", num_workers=None, batch_size=256, image_size=224)
    batch = 256 * 224 * 224 * 3  # one uint8 NHWC batch, 38.5 MB
    assert processes_shm_bytes(cfg, 15) == (2 * 15 + 2) * batch  # 2 ahead per worker, 2 held
    assert processes_shm_bytes(cfg, 15, ranks=4) == 4 * (2 * 15 + 2) * batch  # one /dev/shm a node
    small = choose_input(cfg, True, environ=env, cores=16, shm_free=64 * MiB)
    assert (small.workers, small.loader) == (15, "threads")
    assert small.why.startswith("threads, not processes: /dev/shm has 64 MiB free, 15 DataLoader")
    assert "may need 1.1 GiB" in small.why and "docker run --ipc=host or --shm-size" in small.why
    enough = choose_input(cfg, True, environ=env, cores=16, shm_free=32 * batch)
    assert (enough.loader, enough.why) == ("processes", "")
    assert choose_input(cfg, True, environ=env, cores=16, shm_free=32 * batch - 1).loader == "threads"
    assert choose_input(cfg, True, environ=env, cores=16, shm_free=None).loader == "processes"  # no /dev/shm
    chosen = make_config(data_backend="torch", num_workers=15, loader="processes")
    assert choose_input(chosen, True, environ=env, shm_free=MiB).loader == "processes"  # as asked


def _child(code: str, **env_changes) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "FASTTRAIN_T"))}
    env.update(env_changes, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split("|")


_REPORT = (
    "import os, fasttrain.threads as t; p = t.configure(1); import torch; "
    "print(os.environ.get('OMP_WAIT_POLICY'), torch.get_num_threads(), p.describe(), sep='|')"
)


def test_configure_sets_a_passive_wait_before_torch_loads_and_threads_from_the_free_cores():
    wait, threads, text = _child(_REPORT)
    assert wait == "PASSIVE"
    assert int(threads) == max(1, available_cores() - 1)
    assert "passive wait" in text


def test_configure_asks_for_the_workers_once_torch_is_imported():
    code = (
        "import sys, fasttrain.threads as t; seen = []; "
        "p = t.configure(lambda: seen.append('torch' in sys.modules) or 1); import torch; "
        "print(seen, torch.get_num_threads(), sep='|')"
    )
    seen, threads = _child(code)
    assert seen.strip() == "[True]"  # called once, after torch loaded (it may ask torch for CUDA)
    assert int(threads) == max(1, available_cores() - 1)


def test_an_explicit_setting_is_kept():
    # 1 thread where the policy would give all cores (configure(0): no input workers)
    wait, threads, text = _child(
        _REPORT.replace("configure(1)", "configure(0)"), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="ACTIVE"
    )
    assert (wait, int(threads)) == ("ACTIVE", 1)
    assert "OMP_NUM_THREADS=1" in text and "the environment's wait" in text


def test_fasttrain_threads_off_leaves_torch_defaults():
    wait, threads, text = _child(_REPORT, FASTTRAIN_THREADS="off")
    assert wait == "None"
    default = int(_child("import torch; print(torch.get_num_threads(), end='|')")[0])
    assert int(threads) == default
    assert "torch's defaults" in text


def test_configured_after_torch_says_the_wait_could_not_be_set():
    before = torch.get_num_threads()
    try:
        policy = configure(0, environ={"LOCAL_WORLD_SIZE": "1"})
        assert "torch was imported before" in policy.wait
        assert torch.get_num_threads() == policy.threads == available_cores()
    finally:
        torch.set_num_threads(before)


def test_the_command_line_parses_flags_without_importing_torch():
    # python -m fasttrain applies the policy after parsing the flags and before the trainer imports
    # torch: an import of torch creeping into the flag layer would make the wait policy too late.
    code = (
        "import sys, fasttrain.__main__, fasttrain.flags, fasttrain.threads; "
        "fasttrain.flags.parse_args(['--num_workers=1']); print('torch' in sys.modules, end='|')"
    )
    assert _child(code)[0] == "False"
