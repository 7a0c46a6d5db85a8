"""bench.gpu_run's first step: does CUDA work, does Triton's launcher work? Fails in one line if not.

    python -m bench.gpu_preflight --out preflight.json [--cpu]

CUDA: torch sees a device, and a 512 x 512 fp32 matmul on it equals the CPU's (TF32 off) within
1e-3 relative. Triton: a kernel (z = x * 2 + y over 100,003 elements, masked tail) compiles, launches
and gives exactly torch's result. With --cpu (the dry run) the matmul runs on the CPU and the kernel
under TRITON_INTERPRET=1. Writes the environment (bench/common.py's record: GPU, driver, CUDA, cuDNN,
torch, Triton and the input libraries) and the outcome to --out; exit 3 with one line on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--cpu" in sys.argv:  # Triton reads TRITON_INTERPRET when it is imported, just below
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.common import environment, one_line  # noqa: E402


@triton.jit
def _axpy(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(z_ptr + offs, x * 2.0 + y, mask=mask)


def _triton_check(device) -> str:
    n = 100_003
    x = torch.randn(n, device=device)
    y = torch.randn(n, device=device)
    z = torch.empty_like(x)
    t0 = time.perf_counter()
    _axpy[(triton.cdiv(n, 1024),)](x, y, z, n, BLOCK=1024)
    if device.type == "cuda":
        torch.cuda.synchronize()  # note: host waits; the kernel's result is read next
    if not torch.equal(z, x * 2.0 + y):
        raise RuntimeError("a Triton kernel's result differs from torch's (z = 2x + y)")
    return f"Triton {triton.__version__}: a kernel compiled and ran ({time.perf_counter() - t0:.1f} s)"


def check(cpu: bool) -> dict:
    if not cpu and not torch.cuda.is_available():
        raise RuntimeError(
            f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
        )
    device = torch.device("cpu" if cpu else "cuda")
    env = environment(device, sys.argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    got = (a.to(device) @ a.to(device)).cpu()  # note: a host copy, once
    want = a.double() @ a.double()
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    if not err < 1e-3:
        raise RuntimeError(f"a 512x512 matmul on {device} is off by {err:.2e} (relative) from the CPU's")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return dict(environment=env, cuda=f"{name}: matmul within {err:.1e}", triton=_triton_check(device))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cpu", action="store_true", help="dry run: CPU matmul, Triton's interpreter")
    args = p.parse_args(argv)
    try:
        record = dict(status="ok", **check(args.cpu))
    except Exception as exc:  # any failure here means the rest cannot run: say it in one line
        record = dict(status="failed", error=one_line(exc))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, default=str)
    if record["status"] != "ok":
        print(f"gpu_preflight: {record['error']}", file=sys.stderr)
        return 3
    print(f"gpu_preflight: {record['cuda']}; {record['triton']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
