"""fasttrain: fast ImageNet training in PyTorch on TensorFlow-models TFRecord shards."""

import importlib.util as _importlib_util
import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"


def _map_checkout_kernels() -> None:
    # setup.py installs the top-level kernels/ directory as fasttrain.kernels (a bare `kernels`
    # package would collide with other projects). In a source checkout run with PYTHONPATH=. there
    # is no fasttrain/kernels, so register the same import name for the checkout's directory.
    here = _Path(__file__).resolve().parent
    checkout_kernels = here.parent / "kernels"
    if (here / "kernels").exists() or not (checkout_kernels / "__init__.py").is_file():
        return
    if _importlib_util.find_spec("fasttrain.kernels") is not None:  # an editable install maps it
        return
    spec = _importlib_util.spec_from_file_location(
        "fasttrain.kernels",
        checkout_kernels / "__init__.py",
        submodule_search_locations=[str(checkout_kernels)],
    )
    module = _importlib_util.module_from_spec(spec)
    _sys.modules["fasttrain.kernels"] = module
    spec.loader.exec_module(module)


_map_checkout_kernels()
