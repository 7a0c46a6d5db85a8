"""Per-image GIL-held loader work except decode/resize: read+CRC, decode_record, generator, params.

From the root of a checkout (before: 14583db, after: this branch), on the photo set's first shard:
    PYTHONPATH=$PWD python3 overhead_pieces.py {read,decode_record,generator,params,none} \
        {resnet,inception} 2000
One warm-up pass, then 5 passes timed with process_time; prints microseconds per image.
"""

import sys
import time

import numpy as np

from fasttrain.data.imagenet import decode_record, list_shards
from fasttrain.data.jpeg import jpeg_size
from fasttrain.data.tfrecord import build_index, read_record
from fasttrain.data.transforms import sample_train_params

try:
    from fasttrain.data.seeding import SampleGenerator

    gen = SampleGenerator().seeded
except ImportError:
    gen = lambda key: np.random.default_rng(list(key))
piece, setting, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
shard = list_shards("/tmp/fasttrain-photos-2048-32768-8", "train")[0]
index = build_index(shard)[:n]
f = open(shard, "rb")
payloads = [read_record(f, o, s, shard) for o, s in index]
recs = [decode_record(p, shard, o, -1, 1000) for p, (o, s) in zip(payloads, index)]
sizes = [jpeg_size(r.jpeg, shard, 0) for r in recs]
pre, col = ("resnet", False) if setting == "resnet" else ("inception", True)
keys = [(42, 3, i) for i in range(n)]


def run():
    if piece == "read":
        for o, s in index:
            read_record(f, o, s, shard)
    elif piece == "decode_record":
        for p, (o, _s) in zip(payloads, index):
            decode_record(p, shard, o, -1, 1000)
    elif piece == "generator":
        for k in keys:
            gen(k)
    elif piece == "params":
        rng = np.random.default_rng(0)
        for r, (h, w) in zip(recs, sizes):
            sample_train_params(rng, h, w, r.boxes, pre, col)
    elif piece == "none":
        pass


run()  # warm (numba cache, page cache)
t0 = time.process_time()
reps = 5
for _ in range(reps):
    run()
print(f"{piece} {setting} {(time.process_time() - t0) / reps / n * 1e6:.2f} us/image (process time)")
