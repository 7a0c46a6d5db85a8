"""fasttrain.data.warm (`python -m fasttrain.data warm-up`): its parts, each compiled in a process of its
own, leave every kernel the loaders run in numba's disk cache, and a part that fails is compiled by the
caller instead, with a line that says so."""

import json
import os
import subprocess
import sys

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
