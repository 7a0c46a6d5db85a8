"""kernel_helpers' autouse fixture decides per test whether Triton kernels run interpreted (CPU tensors)
or compiled (CUDA tensors). Checked in a pytest run of its own (a subprocess), since the tests that
need the compiled side are gpu tests, skipped here: a gpu test without a `device` parameter ran its
CUDA tensors in the interpreter, and failed on the H200 (bench/results/2026-11-28-h200-fourth-run/)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

INNER = textwrap.dedent(
    f"""
    import os
    import sys

    import pytest

    sys.path.insert(0, {str(TESTS)!r})
    from kernel_helpers import _triton_interpreter  # noqa: F401, E402  (the autouse fixture)


    def interpreted():
        return os.environ.get("TRITON_INTERPRET") == "1"


    def test_a_cpu_test_runs_interpreted():
        assert interpreted()


    @pytest.mark.gpu
    def test_a_gpu_test_without_a_device_parameter_runs_compiled():
        assert not interpreted()


    @pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
    def test_the_device_parameter_decides(device):
        assert interpreted() == (device == "cpu")
    """
)


def test_the_fixture_runs_cpu_tests_interpreted_and_gpu_tests_compiled(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "--rootdir",
         str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout, done.stdout[-2000:]
