"""Whether a split's records carry the bounding-box keys DALI's training crop reads.

TensorFlow's build_imagenet_data.py writes image/object/bbox/{xmin,ymin,xmax,ymax} in every record,
empty lists for an image without boxes; other converters leave the keys out. TensorFlow's and
fasttrain's torch input then crop as for an image without boxes (the whole image is the box). DALI's
TFRecord reader (2.4) does not use a VarLenFeature's default value for a missing key: the boxes it
reads are whatever its buffer held, which stopped training with "box ... is out of bounds" reported
as an undecodable record, or, where the bytes happened to read as a box inside the image, cropped to
it without a word. So the DALI loader asks here once: when no shard's records carry the keys, its
pipeline reads none and crops with the whole-image box, as TensorFlow does; shards that differ are
one error (DALI cannot batch records with and without the keys).

One record per shard is read: a converter writes the keys in every record or in none. Records that
differ within a shard stop DALI's reader at their first batch ("same dimensionality"), which the
loader reports as such.
"""

from __future__ import annotations

from fasttrain.data.errors import DataError, ShardReadError, error_reason
from fasttrain.data.example import parse_example
from fasttrain.data.sharding import RecordTable
from fasttrain.data.tfrecord import read_record

BOX_KEYS = tuple(f"image/object/bbox/{k}" for k in ("xmin", "ymin", "xmax", "ymax"))


def records_have_box_keys(table: RecordTable) -> bool:
    """True when each shard's first record has all four box keys, False when none has any; DataError
    naming one of each kind when shards differ, or a first record that cannot be read."""
    with_keys, without = [], []
    for file_id, shard in enumerate(table.files):
        first = int(table.shard_starts[file_id])
        if first >= int(table.shard_starts[file_id + 1]):
            continue  # an empty shard
        offset, size = int(table.offsets[first]), int(table.sizes[first])
        try:
            with open(shard, "rb") as f:
                payload = read_record(f, offset, size, shard)
            keys = set(parse_example(payload).features.feature.keys())
        except OSError as exc:
            raise ShardReadError(f"cannot read shard {shard} ({exc.strerror})") from None
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and the reader's DataError
            raise DataError(f"cannot read the first record of {shard} ({error_reason(exc)})") from None
        present = [key in keys for key in BOX_KEYS]
        if any(present) and not all(present):
            missing = ", ".join(k for k, p in zip(BOX_KEYS, present) if not p)
            raise DataError(f"the first record of {shard} has some image/object/bbox keys but not {missing}")
        (with_keys if all(present) else without).append(shard)
    if with_keys and without:
        raise DataError(
            f"the records of {without[0]} have no image/object/bbox keys and those of {with_keys[0]} have "
            f"them ({len(without)} and {len(with_keys)} shards): DALI's reader cannot batch both; write the "
            "keys in every record (empty lists for an image without boxes, as build_imagenet_data.py does) "
            "or use data_backend=torch",
            settings=("data_backend",),
        )
    return not without
