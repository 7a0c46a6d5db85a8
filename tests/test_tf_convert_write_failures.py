"""python -m fasttrain.tf.convert on a full disk (tests/fsize_limited.py: writes past the limit fail with
EFBIG): from-tf and to-tf end in one line naming the file, exit 1, no traceback; nothing of an earlier
file (a --overwrite target and its .sha256) is lost, no temporary file is left, and a rerun with room
succeeds without --overwrite. An index that cannot be written leaves no data file behind it."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fasttrain.checkpoint import CheckpointError
from fasttrain.tf import checkpoint as tf_checkpoint
from fasttrain.tf.checkpoint import open_checkpoint, write_checkpoint
from fasttrain.tf.convert import main

REPO = Path(__file__).resolve().parents[1]
RESNET = REPO / "tests" / "data" / "tf-resnet-v2" / "resnet18_v2_w4"  # 313 kB of data


def _convert(limit: int, *args) -> subprocess.CompletedProcess:
    env_limit = {"FASTTRAIN_TEST_FSIZE": str(limit)}
    command = [sys.executable, str(REPO / "tests" / "fsize_limited.py"), "-m", "fasttrain.tf.convert", *args]
    return subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **env_limit}, timeout=300
    )


def test_from_tf_on_a_full_disk_keeps_the_old_file_and_its_sum(tmp_path):
    out = tmp_path / "a.pt"
    out.write_bytes(b"the old file")
    out.with_name("a.pt.sha256").write_text("old sum  a.pt\n")
    done = _convert(
        100_000, "from-tf", str(RESNET), "--model", "resnet18_v2", "--out", str(out), "--overwrite"
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"fasttrain: error: cannot write {out} (EFBIG: File too large): it is as it was"
    ]
    assert (
        out.read_bytes() == b"the old file" and out.with_name("a.pt.sha256").read_text() == "old sum  a.pt\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "a.pt.sha256"]


def test_to_tf_on_a_full_disk_leaves_nothing_and_a_rerun_needs_no_overwrite(tmp_path):
    pt = tmp_path / "r18.pt"
    assert main(["from-tf", str(RESNET), "--model", "resnet18_v2", "--out", str(pt)]) == 0
    prefix = tmp_path / "exp" / "model.ckpt-0"
    done = _convert(200_000, "to-tf", str(pt), "--out", str(prefix))
    assert done.returncode == 1, done.stderr
    data = f"{prefix}.data-00000-of-00001"
    assert done.stderr.strip().splitlines() == [
        f"fasttrain: error: cannot write {data} (EFBIG: File too large)"
    ]
    assert list(prefix.parent.iterdir()) == []
    assert main(["to-tf", str(pt), "--out", str(prefix)]) == 0
    assert sorted(open_checkpoint(prefix.parent).shapes()) == sorted(open_checkpoint(RESNET).shapes())


def test_an_index_that_cannot_be_written_leaves_no_data_file(tmp_path, monkeypatch):
    def full(items):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tf_checkpoint, "build_table", full)
    prefix = tmp_path / "model.ckpt-1"
    with pytest.raises(
        CheckpointError, match=rf"^cannot write {prefix}.index \(ENOSPC: No space left on device\)$"
    ):
        write_checkpoint(prefix, {"w": np.ones(3, np.float32)})
    assert list(tmp_path.iterdir()) == []
