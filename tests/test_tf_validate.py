"""Step counters read from TF checkpoints (fasttrain.tf.validate): global_step and the Inception seed's
zero-debias local_step must be whole scalars in [0, 2**63); anything else is one CheckpointError naming
the variable, on V2 files written by fasttrain's writer and V1 files crafted with its table writer."""

from pathlib import Path

import numpy as np
import pytest
from test_tf_checkpoint_damage import write_v1

from fasttrain.checkpoint import CheckpointError
from fasttrain.models.inception_v3 import Inception3
from fasttrain.tf.checkpoint import open_checkpoint, write_checkpoint
from fasttrain.tf.state import model_state, read_global_step

INCEPTION = Path(__file__).parent / "data" / "tf-inception" / "reduced" / "model.ckpt-7"


def _step_checkpoint(tmp_path: Path, value) -> object:
    prefix = write_checkpoint(tmp_path / "model.ckpt-1", {"global_step": np.asarray(value)}, state_file=False)
    return open_checkpoint(prefix)


@pytest.mark.parametrize(
    "value, want",
    [
        (np.int64(123456789012), 123456789012),
        (np.float32(7.0), 7),
        (np.int64(2**63 - 1), 2**63 - 1),
        (np.int32(0), 0),
    ],
)
def test_whole_steps_read(tmp_path, value, want):
    assert read_global_step(_step_checkpoint(tmp_path, value)) == want


@pytest.mark.parametrize(
    "value, why",
    [
        (np.array([3, 4], np.int64), r"has shape \(2,\); a step counter is a scalar"),
        (np.array([5], np.int64), r"has shape \(1,\); a step counter is a scalar"),
        (np.float32(np.nan), r"is nan, not a whole number"),
        (np.float32(np.inf), r"is inf, not a whole number"),
        (np.float32(2.5), r"is 2.5, not a whole number"),
        (np.int64(-7), r"is -7, outside \[0, 2\*\*63\)"),
        (np.float32(1e30), r"is 10000000150\d+, outside \[0, 2\*\*63\)"),
        (np.float32(2.0**63), r"is 9223372036854775808, outside"),
    ],
)
def test_bad_global_step_is_one_error_naming_it(tmp_path, value, why):
    ckpt = _step_checkpoint(tmp_path, value)
    with pytest.raises(
        CheckpointError, match=rf"^TensorFlow checkpoint {ckpt.prefix}: variable global_step {why}"
    ):
        read_global_step(ckpt)


def test_v1_global_step_of_a_huge_declared_shape(tmp_path):
    path = write_v1(tmp_path / "model.ckpt-1", (2**40, 2**20), [([{}, {}], [1.0])], name="global_step")
    with pytest.raises(CheckpointError, match=r"variable global_step has shape \(1099511627776, 1048576\)"):
        read_global_step(open_checkpoint(path))


@pytest.mark.parametrize(
    "value, why", [(np.nan, "is nan, not a whole"), (-1.0, r"is -1, outside"), (1e30, r"is 1\d+, outside")]
)
def test_bad_zero_debias_local_step(tmp_path, value, why):
    model = Inception3(11, bn_gamma=False, depth_multiplier=1.0 / 32)  # as make_tf_inception.py
    ckpt = open_checkpoint(INCEPTION)
    tensors = {n: np.asarray(ckpt.get(n)) for n in ckpt.shapes()}
    scope = "conv2/BatchNorm/conv2/BatchNorm/"
    for stat in ("moving_mean", "moving_variance"):  # both equal, so only the value is wrong
        tensors[f"{scope}{stat}/local_step"] = np.float32(value)
    edited = open_checkpoint(write_checkpoint(tmp_path / "model.ckpt-7", tensors, state_file=False))
    with pytest.raises(CheckpointError, match=rf"variable {scope}moving_mean/local_step {why}"):
        model_state(edited, "inception_v3", model)
