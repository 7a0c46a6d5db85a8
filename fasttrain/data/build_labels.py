"""The labels of shards already in a build's output directory, read from their records.

`python -m fasttrain.data build` keeps the synsets of the shards it writes, in label order, in
`.fasttrain-build-labels.json` and refuses a later build from another labels file (build._check_labels).
Shards copied in (`cp dir/validation-*`), made by TensorFlow's script or built elsewhere come without
that file: their records are read instead. Every record holds its synset beside its label, so one
record per synset tells the labels the shards were made with; reading stops once every synset of the
labels file has been seen (about 7,500 records of a shuffled ImageNet split, under a gigabyte), or at
the end of the shards.
"""

from __future__ import annotations

from pathlib import Path

from fasttrain.data.errors import DataError
from fasttrain.data.imagenet import decode_record
from fasttrain.data.tfrecord import iter_records

ANY_LABEL = 1 << 62  # decode_record's range check is not this reading's business


def first_mismatch(shards: list[Path], synsets: list[str], out=print) -> str | None:
    """Where the shards' records disagree with `synsets` (label = line number, from 1), as a phrase
    naming the record, or None when every synset the shards hold has the labels file's label."""
    labels = {synset: i + 1 for i, synset in enumerate(synsets)}
    unseen = set(synsets)
    out(
        f"reading the labels of the {len(shards)} shards already in {shards[0].parent} (they came "
        "without the build's record of them)"
    )
    for shard in shards:
        for offset, payload in iter_records(shard):
            try:
                record = decode_record(payload, shard, offset, 0, ANY_LABEL)
            except DataError:
                continue  # a bad record is verify's and the trainer's to report, not this check's
            if not record.synset:
                continue  # a converter that stores no synset: nothing to compare
            expected = labels.get(record.synset)
            if expected != record.stored_label:
                where = f"record at offset {offset} in {shard}"
                if expected is None:
                    return f"its {where} is synset {record.synset}, which the labels file does not list"
                return (
                    f"its {where} gives synset {record.synset} label {record.stored_label}, the labels "
                    f"file {expected}"
                )
            unseen.discard(record.synset)
            if not unseen:
                return None
    return None
