"""fasttrain.data.warm (`python -m fasttrain.data warm-up`): its parts, each compiled in a process of its
own, leave every kernel the loaders run in numba's disk cache, and a part that fails is compiled by the
caller instead, with a line that says so; a loader's own warm-up (fasttrain.data.torch_pipeline) takes
the parts only where the cache is cold and its node has one rank and 4 or more cores."""

import json
import os
import subprocess
import sys

import pytest

from fasttrain.data import warm

# numba reports a compile (not a load from its cache) as a "numba:compile" event.
COMPILED_BY_THE_LOADERS_WARM_UP = """
import json
from numba.core import event
from fasttrain.data.warm import warm_up_all
with event.install_recorder("numba:compile") as rec:
    warm_up_all()
print(json.dumps(sorted({ev.data["dispatcher"].py_func.__qualname__ for _, ev in rec.buffer})))
"""


def test_the_parts_leave_every_loader_kernel_in_the_cache(tmp_path):
    # A cache of its own: cold, as on a new machine (the checkout's __pycache__ folders are not read).
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    out = subprocess.run(
        [sys.executable, "-m", "fasttrain.data", "warm-up", "--jobs", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for name in warm.PARTS:
        assert f"warm-up: {name} " in out.stderr and "failed" not in out.stderr, out.stderr
    # After the parts, the command's own warm-up (the loaders') compiled nothing: the parts cover it.
    assert (
        out.stdout.startswith("warm-up: the parts in ") and "(every kernel from numba's cache)" in out.stdout
    ), out.stdout
    # And a later process's warm-up, as a loader runs it, loads every kernel.
    check = subprocess.run(
        [sys.executable, "-c", COMPILED_BY_THE_LOADERS_WARM_UP], env=env, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr[-3000:]
    assert json.loads(check.stdout.strip().splitlines()[-1]) == []


def test_a_part_that_fails_is_compiled_here_instead(monkeypatch):
    # The helper process knows no part of this name (KeyError): it fails, and the caller's own warm-up
    # runs all the same (recorded here, not run: it is the loaders' warm-up, tested above).
    monkeypatch.setattr(warm, "PARTS", {"no-such-part": lambda: None})
    ran, lines = [], []
    monkeypatch.setattr(warm, "warm_up_all", lambda: ran.append(True))
    result = warm.warm_up_parallel(2, say=lines.append)
    assert result["failed"] == ["no-such-part"] and result["parts"] == {"no-such-part": None}
    assert result["compiled_here"] == []  # the recorded stand-in compiled nothing
    assert ran == [True]
    assert len(lines) == 1 and lines[0].startswith("warm-up: no-such-part failed after "), lines
    assert "KeyError" in lines[0] and lines[0].endswith("; compiled here instead"), lines


def test_jobs_below_one_is_a_usage_error():
    out = subprocess.run(
        [sys.executable, "-m", "fasttrain.data", "warm-up", "--jobs", "0"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "must be at least 1, got 0" in out.stderr, out.stderr


def test_cold_is_true_where_colours_kernels_compile_and_false_where_they_load(tmp_path):
    # A cache of its own: the first call compiles colour's kernels into it, the second finds them
    # compiled; a new process then loads them from the disk cache.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    code = "from fasttrain.data import warm; print(warm.cold(), warm.cold())"
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert (first.stdout.split(), again.stdout.split()) == (["True", "False"], ["False", "False"]), (
        first.stderr[-2000:] + again.stderr[-2000:]
    )


@pytest.mark.parametrize(
    "ranks, cores, cold, parts",
    [
        (1, 16, True, 9),  # one rank, 16 cores, a cold cache: the parts, one process each
        (1, 4, True, 4),
        (1, 16, False, None),  # a warm cache: loaded here (about a second)
        (4, 16, True, None),  # 4 ranks warm up at once: each compiles here, on its own core
        (1, 3, True, None),  # 2-3 cores: the parts would gain nothing
    ],
)
def test_a_loaders_cold_warm_up_compiles_in_parts_where_it_has_the_cores(
    monkeypatch, capsys, ranks, cores, cold, parts
):
    from fasttrain.data import torch_pipeline

    calls = []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    monkeypatch.setattr(torch_pipeline, "available_cores", lambda: cores)
    monkeypatch.setattr(warm, "cold", lambda: cold)
    monkeypatch.setattr(warm, "warm_up_parallel", lambda jobs: calls.append(("parts", jobs)))
    monkeypatch.setattr(torch_pipeline, "warm_up", lambda: calls.append(("here",)))
    monkeypatch.setattr(torch_pipeline, "_warm_up_reader", lambda: calls.append(("reader",)))
    torch_pipeline.warm_up_kernels(0)
    err = capsys.readouterr().err
    if parts:
        assert calls == [("parts", parts)], calls  # the parts end with this process's warm-up
        assert "compiling the input pipeline's numba kernels" in err and f"{parts} processes at once" in err
    else:
        assert calls == [("here",), ("reader",)] and "processes at once" not in err, (calls, err)


def test_parts_that_cannot_start_leave_the_compile_to_the_loader(monkeypatch, capsys):
    from fasttrain.data import torch_pipeline

    def no_processes(jobs):
        raise OSError(11, "Resource temporarily unavailable")

    calls = []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(torch_pipeline, "available_cores", lambda: 16)
    monkeypatch.setattr(warm, "cold", lambda: True)
    monkeypatch.setattr(warm, "warm_up_parallel", no_processes)
    monkeypatch.setattr(torch_pipeline, "warm_up", lambda: calls.append("here"))
    monkeypatch.setattr(torch_pipeline, "_warm_up_reader", lambda: calls.append("reader"))
    torch_pipeline.warm_up_kernels(0)
    assert calls == ["here", "reader"]
    err = capsys.readouterr().err
    said = "the parts could not start ([Errno 11] Resource temporarily unavailable); compiling here"
    assert said in err, err
