"""fasttrain.errors: library messages name settings plainly; the command line shows them as flags."""

import pytest

from fasttrain.checkpoint import CheckpointError
from fasttrain.config import ConfigError
from fasttrain.data import DataError, LabelRangeError
from fasttrain.errors import SettingError, exit_code, flag_text


def test_flag_text_writes_the_named_settings_as_flags_and_nothing_else():
    err = SettingError(
        "sync_bn needs CUDA devices; drop sync_bn for CPU runs (runs/sync_bn, --sync_bn, sync_bn_x, "
        "data_dir stays)",
        settings=("sync_bn",),
    )
    assert str(err).startswith("sync_bn needs CUDA devices")  # what a library caller reads
    assert flag_text(err) == (
        "--sync_bn needs CUDA devices; drop --sync_bn for CPU runs (runs/sync_bn, --sync_bn, sync_bn_x, "
        "data_dir stays)"
    )


def test_a_package_a_message_says_to_install_stays_a_package():
    # "pip install tensorboard" became "pip install --tensorboard", a command that fails.
    err = SettingError(
        "tensorboard needs TensorBoard's package: pip install tensorboard, or pass tensorboard=false",
        settings=("tensorboard",),
    )
    assert flag_text(err) == (
        "--tensorboard needs TensorBoard's package: pip install tensorboard, or pass --tensorboard=false"
    )


def test_flag_text_leaves_errors_without_settings_as_they_are():
    assert flag_text(ValueError("model=x")) == "model=x"
    assert flag_text(DataError("model=x in a path")) == "model=x in a path"


@pytest.mark.parametrize(
    "err, code",
    [
        (ConfigError("--seed must be below 2**32"), 2),
        (SettingError("precision=fp16 is for CUDA devices", settings=("precision",)), 2),
        (LabelRangeError("label 5 + label_offset -1", settings=("label_offset",)), 2),  # the flags misfit
        (DataError("corrupted record"), 1),
        (CheckpointError("ckpt-3.pt does not fit"), 1),
        (RuntimeError("a bug"), None),  # not a user error: its traceback goes through
    ],
)
def test_exit_codes(err, code):
    assert exit_code(err) == code
