"""NVIDIA DALI input pipeline over the ImageNet TFRecord shards: float NHWC batches, decoded on the GPU.

Record order (fasttrain.data.sharding, shared with the torch pipeline; no communication between ranks)
    eval: rank r of W reads records [r N // W, (r + 1) N // W) in stored order, in ceil(n_r / B)
        batches, the last cut to its real records (DALI pads it with copies of the last record,
        pad_last_batch): every record is seen exactly once across ranks.
    train, epoch e: the torch pipeline's shard permutation and rank slice, each shard's run in the slice
        permuted whole, rng(seed, e, r), instead of the torch pipeline's shuffle buffer (which interleaves
        shards record by record: one index file per record run for DALI). Every rank reads its first
        N // W records in N // W // B batches; batch composition relies on shuffled shards, as
        build_imagenet_data.py and the synthetic writer write them.
    The rank's records reach fn.readers.tfrecord as per-epoch index files (tfrecord2idx `offset size`
    lines in reading order, one per shard run; the shard's own index for a whole shard in stored
    order), so DALI reads exactly them, in that order, with num_shards=1. DALI's shuffle buffer
    (random_shuffle/initial_fill) is not used: it carries records across the epoch boundary, so an
    epoch would repeat some records and miss others.

Graph: each epoch's pipeline decodes, crops, resizes, distorts the colour and normalises as
fasttrain/data/dali_graph.py's docstring says, where it also says how that differs from the torch
pipeline.

Resume: {'epoch', 'batch'} restarts epoch `epoch` at batch `batch` with exactly the records the
uninterrupted run would have read, in the same batches (the order depends only on seed, epoch, rank
and world size, and the skipped records are left out of the index files, so nothing is decoded to
skip them). The random crops, flips and colours after a resume differ: DALI's random state cannot be
restored, so the pipeline is re-seeded from (seed, epoch, rank, batch).

Errors: DALI reports an undecodable image without naming it; the loader then decodes the failed
batch's records on the host (fasttrain.data.jpeg.decode) to name the shard and record, and points to
`python -m fasttrain.data verify DIR --decode`.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

from fasttrain.config import Config
from fasttrain.data.dali_boxes import records_have_box_keys
from fasttrain.data.dali_graph import _graph
from fasttrain.data.errors import DataError, error_reason
from fasttrain.data.imagenet import decode_record, label_range_error
from fasttrain.data.jpeg.decode import decode_jpeg
from fasttrain.data.loader import EpochPosition
from fasttrain.data.record_check import RecordCheck
from fasttrain.data.sharding import epoch_positions, open_split, rank_range
from fasttrain.data.tfrecord import ensure_index, read_record
from fasttrain.errors import SettingError
from fasttrain.threads import resolve_input

_DALI_DTYPES = {torch.float32: "FLOAT", torch.float16: "FLOAT16"}
# The first DALI with what this module uses: Pipeline(exec_dynamic=...) and stream-bound outputs,
# pipe.run(stream), with `__dlpack__` on its tensors (DALI 1.44 release notes; NVIDIA/DALI #5704,
# #5684). setup.py's floor is this version (tests/test_dali_pipeline.py checks that they agree).
DALI_MIN_VERSION = (1, 44)
_DECODE_HINT_SETTINGS = ("data_backend", "skip_corrupt")  # what a decode error's hint names


class DaliLoader(EpochPosition):
    """The loader protocol of fasttrain.data over DALI: one pipeline per epoch, float NHWC batches."""

    normalized = True

    def __init__(
        self,
        cfg: Config,
        split: str,
        training: bool,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        if cfg.skip_corrupt:
            raise SettingError(
                "skip_corrupt needs data_backend=torch: DALI cannot skip a record it fails to decode",
                settings=("skip_corrupt", "data_backend"),
            )
        if dtype not in _DALI_DTYPES:
            raise ValueError(f"DALI outputs float32 or float16, not {dtype} (cast to bf16 on the device)")
        check_dali_version()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        cfg = resolve_input(cfg, self.device.type == "cuda", "dali")  # --num_workers auto
        self.cfg, self.split, self.training = cfg, split, training
        self.rank, self.world_size, self.dtype = rank, world_size, dtype
        mode = "GPU decode" if self.device.type == "cuda" else "CPU mode"
        self.description = f"dali, {mode}, {max(1, cfg.num_workers)} CPU threads"
        self.table, self._len = open_split(cfg, split, training, rank, world_size)
        self.num_records = len(self.table)
        self._shard_index = {p: str(ensure_index(p, cfg.data_cache_dir or None)) for p in self.table.files}
        # Whether the train crop reads the records' boxes (fasttrain.data.dali_boxes: DALI reads garbage
        # for a missing key); without them it crops with the whole-image box, as TensorFlow does.
        self.box_keys = training and cfg.preprocess != "vgg" and records_have_box_keys(self.table)
        self._workdir = Path(tempfile.mkdtemp(prefix="fasttrain-dali-"))
        weakref.finalize(self, shutil.rmtree, self._workdir, True)

    # --- the protocol ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        start = self._begin_epoch()
        size = self.cfg.batch_size
        positions = self.epoch_positions()[start * size :]
        if start >= self._len or len(positions) == 0:
            return
        pipe = self._build_pipeline(positions, start)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        batches = [positions[k * size : (k + 1) * size] for k in range(self._len - start)]
        # DALI checks no CRC: each batch's records are checked (a thread, running ahead) before it is
        # handed out, as the torch backend's reader checks them (fasttrain.data.record_check).
        check = RecordCheck(self.table, batches, self._hint(), _DECODE_HINT_SETTINGS)
        try:
            yield from self._batches(pipe, stream, positions, start, check)
        finally:
            check.close()

    def _batches(self, pipe, stream, positions: np.ndarray, start: int, check: RecordCheck):
        size = self.cfg.batch_size
        for b in range(start, self._len):
            mine = positions[(b - start) * size :][:size]  # < size only for evaluation's last batch
            try:
                images, labels = pipe.run(stream) if stream is not None else pipe.run()
            except RuntimeError as exc:  # a failed batch (a DALI too old for run(stream) is refused earlier)
                raise self._decode_error(positions[(b - start) * size :], exc) from None
            check.check(b - start)  # a record whose bytes changed: named here, never trained on
            # DALI's output buffers are DALI's: a view kept past the next run(), as gradient
            # accumulation keeps its micro-batches, may see a later batch written into them (DALI's
            # "Pipeline Run Methods"). So both outputs are copied into tensors the loader owns: the
            # images on the stream DALI bound them to (one device copy: 0.15 GB for 256 x 224 px in
            # fp32, about 0.1 ms on an H100), the labels on the host (below).
            labels = self._owned_labels(self._checked_labels(labels, mine))  # (N,) int64
            images = torch.from_dlpack(images.as_tensor())[: len(mine)].clone()  # (N, S, S, 3) float
            self._position = b + 1
            yield images, labels

    # --- record order ---------------------------------------------------------------------------

    def epoch_positions(self) -> np.ndarray:
        """Global positions (fasttrain.data.sharding) of this rank's records this epoch, in order.

        Evaluation: the torch pipeline's order. Training: the torch pipeline's shard order and rank
        slice, but each shard's run in the slice is permuted whole instead of passing through a
        shuffle buffer, so that DALI reads one index file per shard run (a buffer interleaves shards
        record by record: tens of thousands of runs per epoch).
        """
        if not self.training:
            return epoch_positions(
                self.table, False, self.cfg.seed, self.epoch, self.rank, self.world_size, 0
            )
        # One rank, no buffer: the whole shard-permuted stream, of which this rank reads its slice.
        stream = epoch_positions(self.table, True, self.cfg.seed, self.epoch, 0, 1, 1)
        lo, hi = rank_range(self.num_records, self.rank, self.world_size)
        rng = np.random.default_rng([self.cfg.seed, self.epoch, self.rank, 0xDA11])
        mine = [rng.permutation(run) for run in _runs(stream[lo:hi], self.table.file_ids)]
        return np.concatenate(mine)[: self.num_records // self.world_size]

    def _write_index_files(self, positions: np.ndarray) -> tuple[list[str], list[str]]:
        """Shard paths and index files that make DALI read `positions` in order (one per shard run)."""
        for old in self._workdir.glob("*.idx"):
            old.unlink()
        table, paths, index_files = self.table, [], []
        for k, run in enumerate(_runs(positions, table.file_ids)):
            file_id = int(table.file_ids[run[0]])
            first, last = table.shard_starts[file_id], table.shard_starts[file_id + 1]
            paths.append(table.files[file_id])
            if np.array_equal(run, np.arange(first, last)):  # the whole shard in stored order
                index_files.append(self._shard_index[table.files[file_id]])
                continue
            target = self._workdir / f"{k:06d}-{Path(table.files[file_id]).name}.idx"
            lines = zip(table.offsets[run].tolist(), table.sizes[run].tolist())
            target.write_text("".join(f"{o} {s}\n" for o, s in lines), encoding="ascii")
            index_files.append(str(target))
        return paths, index_files

    # --- DALI --------------------------------------------------------------------------------------

    def _build_pipeline(self, positions: np.ndarray, start_batch: int, crop_outputs: bool = False):
        """The pipeline reading `positions`; crop_outputs adds the train crop windows (for tests)."""
        from nvidia.dali import Pipeline, types

        cuda = self.device.type == "cuda"
        seed = np.random.SeedSequence([self.cfg.seed, self.epoch, self.rank, start_batch]).generate_state(1)
        device_id = None  # DALI's CPU-only mode
        if cuda:
            device_id = self.device.index if self.device.index is not None else torch.cuda.current_device()
        pipe = Pipeline(
            batch_size=self.cfg.batch_size,
            num_threads=max(1, self.cfg.num_workers),
            device_id=device_id,
            seed=int(seed[0] % 2**31),
            prefetch_queue_depth=2,
            # Outputs bound to the trainer's stream, pipe.run(stream), need DALI's dynamic executor:
            # its default only from DALI 1.51; older releases raise on the first GPU batch.
            exec_dynamic=True,
        )
        paths, index_files = self._write_index_files(positions)
        dtype = getattr(types, _DALI_DTYPES[self.dtype])
        with pipe:
            images, labels, crop = _graph(
                self.cfg, paths, index_files, self.training, cuda, dtype, self.box_keys
            )
            pipe.set_outputs(images, labels, *(crop if crop_outputs else ()))
        pipe.build()
        return pipe

    def _where(self, position) -> tuple[str, int]:
        return self.table.files[int(self.table.file_ids[position])], int(self.table.offsets[position])

    def _checked_labels(self, labels, positions: np.ndarray) -> torch.Tensor:
        """(N,) int64 labels of the batch's real records, on the host; DataError naming a bad one."""
        values = torch.from_dlpack(labels.as_tensor())[: len(positions)]
        bad = torch.nonzero((values < 0) | (values >= self.cfg.num_classes))
        if len(bad):
            i = int(bad[0, 0])
            shard, offset = self._where(positions[i])
            stored = int(values[i]) - self.cfg.label_offset
            raise label_range_error(shard, offset, stored, self.cfg.label_offset, self.cfg.num_classes)
        return values

    def _owned_labels(self, values: torch.Tensor) -> torch.Tensor:
        """The batch's labels (a view of DALI's host buffer) copied into memory the loader owns.

        CUDA: into pinned memory and from there to the device with a non-blocking copy. From DALI's
        own (pageable) buffer the copy would either wait for the host or, queued behind the step,
        read the buffer after DALI has reused it. Torch's caching host allocator keeps a pinned block
        until the copies queued from it have run, even after the loader drops its reference.
        """
        if self.device.type != "cuda":
            return values.clone()
        return values.pin_memory().to(self.device, non_blocking=True)

    def _hint(self) -> str:
        return (
            f"run `python -m fasttrain.data verify {self.cfg.data_dir} --decode` to list every bad "
            "record, then re-create those shards or train with data_backend=torch skip_corrupt"
        )

    def _decode_error(self, positions: np.ndarray, exc: RuntimeError) -> DataError:
        """Name the record DALI failed on by decoding this batch and the two prefetched on the host."""
        hint = self._hint()
        for position in positions[: 3 * self.cfg.batch_size]:
            shard, offset = self._where(position)
            number = int(position - self.table.shard_starts[self.table.file_ids[position]])
            problem = _record_problem(shard, offset, int(self.table.sizes[position]))
            if problem:
                return DataError(
                    f"DALI cannot decode record {number} (offset {offset}) of {shard}: {problem}; {hint}",
                    settings=_DECODE_HINT_SETTINGS,
                )
        near = self._where(positions[0])[0]
        found = re.search(r"encountered:(.*?)(C\+\+ context|Current pipeline|$)", str(exc), re.S)
        detail = " ".join((found.group(1) if found else str(exc)).split())[:300]
        if "same dimensionality" in detail:  # a feature key present in some records, absent in others
            return DataError(
                f"the {self.split} records near {near} have the image/object/bbox keys in some records but "
                "not in others, which DALI's reader cannot batch; write them in every record (empty lists "
                "when there are no boxes, as build_imagenet_data.py does) or use data_backend=torch",
                settings=("data_backend",),
            )
        return DataError(
            f"DALI failed on a batch of {self.split} records near {near} ({detail}); {hint}",
            settings=_DECODE_HINT_SETTINGS,
        )


def check_dali_version(version: str | None = None) -> None:
    """SettingError unless the installed DALI (or `version`) is DALI_MIN_VERSION or newer."""
    if version is None:
        import nvidia.dali

        version = nvidia.dali.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and (int(found.group(1)), int(found.group(2))) >= DALI_MIN_VERSION:
        return
    floor = ".".join(map(str, DALI_MIN_VERSION))
    raise SettingError(
        f"NVIDIA DALI {version} is older than {floor}, the first release whose pipelines hand their "
        f"outputs to a CUDA stream (exec_dynamic): pip install 'nvidia-dali-cuda120>={floor}', or "
        "train with data_backend=torch",
        settings=("data_backend",),
    )


def _record_problem(shard: str, offset: int, size: int) -> str | None:
    """Why the record's image cannot be decoded (CRC, Example, JPEG), read with the torch pipeline's
    decoder; None if it can."""
    try:
        with open(shard, "rb") as f:
            payload = read_record(f, offset, size, shard)
        # Any label passes here: labels are checked separately, on DALI's output.
        decode_jpeg(decode_record(payload, shard, offset, 0, 2**62).jpeg, shard, offset)
    except DataError as e:
        return error_reason(e)  # without the torch reader's advice
    return None


def _runs(positions: np.ndarray, file_ids: np.ndarray) -> list[np.ndarray]:
    """`positions` split into maximal runs of records from one shard."""
    return np.split(positions, np.flatnonzero(np.diff(file_ids[positions])) + 1)
