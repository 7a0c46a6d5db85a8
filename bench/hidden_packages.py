"""Packages made to fail to import as missing ones do, so that the GPU run's CPU dry run (bench/gpu_run.py
--hide) meets what the GPU machine lacks (DALI, tfrecord) as that machine does."""

from __future__ import annotations

from pathlib import Path


def hide(folder: Path, names: list[str]) -> list[str]:
    """Write into `folder` a package for each dotted name in `names` whose import raises
    ModuleNotFoundError; returns [folder], to go first on PYTHONPATH."""
    for name in names:
        parts = name.split(".")
        pkg = folder.joinpath(*parts)
        pkg.mkdir(parents=True, exist_ok=True)
        for depth in range(1, len(parts)):  # the parents (nvidia): found here first, their other
            # modules (nvidia.cudnn, ...) still where they are installed (a regular `nvidia` package
            # there had taken nvidia.dali from its own folder, past the hidden one)
            init = folder.joinpath(*parts[:depth], "__init__.py")
            init.write_text("__path__ = __import__('pkgutil').extend_path(__path__, __name__)\n")
        (pkg / "__init__.py").write_text(
            # ModuleNotFoundError, as a missing package raises: pytest >= 9.2's importorskip skips on
            # that only (a plain ImportError failed the collection of 5 test modules).
            f'raise ModuleNotFoundError("{name} is hidden by bench.gpu_run --hide", name="{name}")\n'
        )
    return [str(folder)]
