"""fasttrain: fast ImageNet training in PyTorch on TensorFlow-models TFRecord shards."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# The Triton kernels live in the top-level kernels/ folder and are installed as fasttrain.kernels
# (setup.py's package_dir; a bare `kernels` package would collide with other projects). In a source
# checkout that folder sits beside this package, not in it: let fasttrain's subpackages be found
# there too, so `fasttrain.kernels` imports the same code either way.
_checkout = _Path(__file__).resolve().parent.parent
if not (_checkout / "fasttrain" / "kernels").exists() and (_checkout / "kernels" / "__init__.py").is_file():
    __path__.append(str(_checkout))
