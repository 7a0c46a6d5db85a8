"""DALI's reads get the CRC check DALI leaves out (fasttrain.data.record_check): a record whose bytes
changed after the shard was written stops the epoch at its batch, named, before that batch is handed
out; the batches before it are handed out as usual. (Before the check, DALI decoded such a record and
the run trained on it without a word, where TensorFlow's reader and the torch backend stop.)"""

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed")

from test_dali_pipeline import SHARDS, _cfg, write_dataset  # noqa: E402

from fasttrain.data import DataError  # noqa: E402
from fasttrain.data.dali_pipeline import DaliLoader  # noqa: E402
from fasttrain.data.tfrecord import read_index_file  # noqa: E402


def _flip_data_crc(shard: Path, record: int) -> int:
    """Change the stored data CRC of `record` (its last 4 bytes): the JPEG stays whole, so DALI decodes
    it as before and only a CRC check can tell. Returns the record's offset."""
    offset, size = (int(v) for v in read_index_file(shard.with_name(shard.name + ".idx"))[record])
    data = bytearray(shard.read_bytes())
    data[offset + size - 1] ^= 0x01
    shard.write_bytes(bytes(data))
    return offset


def test_a_record_with_a_wrong_crc_stops_the_epoch_at_its_batch(tmp_path):
    data_dir = write_dataset(tmp_path)
    shard = data_dir / "validation-00001-of-00002"
    offset = _flip_data_crc(shard, 4)
    loader = DaliLoader(_cfg(data_dir), "validation", False)  # stored order: batches of 8
    handed_out = []
    with pytest.raises(DataError) as info:
        for _, labels in loader:
            handed_out.append([int(v) for v in labels])
    # Record 4 of the second shard is record 13 + 4 = 17 of the split: the third batch (16-23).
    first = SHARDS["validation"][0]
    assert (first + 4) // 8 == 2 and len(handed_out) == 2
    assert np.array_equal(np.concatenate(handed_out), np.arange(16))  # labels are 1 + position, offset -1
    message = str(info.value)
    assert message.startswith(
        f"corrupted record at offset {offset} in {shard} (data CRC mismatch), record 4 of the shard; "
    ), message
    assert "python -m fasttrain.data verify" in message and "skip_corrupt" in message


def test_training_stops_at_the_bad_batch_and_not_before(tmp_path):
    data_dir = write_dataset(tmp_path)
    _flip_data_crc(data_dir / "train-00002-of-00003", 10)
    loader = DaliLoader(_cfg(data_dir), "train", True)
    bad_label = SHARDS["train"][0] + SHARDS["train"][1] + 10  # labels are 1 + position, offset -1
    handed_out = []
    with pytest.raises(DataError, match=r"\(data CRC mismatch\), record 10 of the shard"):
        for _, labels in loader:
            handed_out.append([int(v) for v in labels])
    assert all(bad_label not in batch for batch in handed_out)
    assert len(handed_out) < len(loader)
