"""The torch backend's two loaders (Config.loader: DataLoader processes, fasttrain.data.torch_pipeline;
threads, fasttrain.data.thread_loader), each test run on both: exactly-once sharding,
worker-independent order, exact resume, corrupt records."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from fasttrain.config import make_config
from fasttrain.data import DataError
from fasttrain.data.example import encode_example
from fasttrain.data.sharding import shuffle_buffer_order
from fasttrain.data.tfrecord import build_index, write_records
from fasttrain.data.thread_loader import ThreadLoader
from fasttrain.data.torch_pipeline import TorchLoader

SHARD_SIZES = (20, 12, 16)  # 48 records; record i (file order) stores label i + 1


def _write_dataset(root, sizes=SHARD_SIZES, split="train"):
    root.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    label = 1
    for s, n in enumerate(sizes):
        records = []
        for _ in range(n):
            buf = io.BytesIO()
            pixels = rng.integers(
                0, 256, (int(rng.integers(12, 24)), int(rng.integers(12, 24)), 3), dtype=np.uint8
            )
            Image.fromarray(pixels).save(buf, "JPEG", quality=90)
            records.append(encode_example({"image/encoded": buf.getvalue(), "image/class/label": label}))
            label += 1
        write_records(root / f"{split}-{s:05d}-of-{len(sizes):05d}", records)
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    _write_dataset(root / "train48")
    _write_dataset(root / "train48", (25, 25), split="validation")
    return root / "train48"


def _cfg(data_dir, **overrides):
    values = dict(
        data_dir=str(data_dir),
        data_cache_dir=str(data_dir) + "-cache",
        batch_size=4,
        image_size=16,
        num_classes=60,
        label_offset=-1,
        num_workers=0,
        shuffle_buffer=8,
        seed=3,
    )
    values.update(overrides)
    return make_config(**values)


@pytest.fixture(params=["processes", "threads"])
def Loader(request):  # noqa: N802 - stands for the class
    return TorchLoader if request.param == "processes" else ThreadLoader


def _epoch(loader, epoch=None):
    if epoch is not None:
        loader.set_epoch(epoch)
    return [(images.clone(), labels.clone()) for images, labels in loader]


def _labels(batches):
    return [int(v) for _, labels in batches for v in labels]


def test_exactly_once_over_two_ranks_and_two_workers_across_epochs(Loader, data):
    cfg = _cfg(data, num_workers=2)
    loaders = [Loader(cfg, "train", True, rank, 2) for rank in range(2)]
    orders = []
    for epoch in (0, 1):
        seen = []
        for loader in loaders:
            batches = _epoch(loader, epoch)
            assert len(batches) == len(loader) == 6
            assert all(
                images.shape == (4, 16, 16, 3) and images.dtype == torch.uint8 for images, _ in batches
            )
            assert all(labels.dtype == torch.int64 for _, labels in batches)
            seen += _labels(batches)
        assert sorted(seen) == list(range(48))
        orders.append(seen)
    assert orders[0] != orders[1] and orders[0] != sorted(orders[0])
    assert loaders[0].num_records == 48


def test_training_ranks_get_equal_batch_counts_with_uneven_records(Loader, tmp_path):
    data = _write_dataset(tmp_path / "d", (9, 8, 10))  # 27 records over 2 ranks: 13 each, 1 left over
    seen = []
    for rank in range(2):
        loader = Loader(_cfg(data, batch_size=3, num_classes=27), "train", True, rank, 2)
        batches = _epoch(loader)
        assert len(loader) == len(batches) == 4  # 13 // 3, the partial batch dropped
        seen += _labels(batches)
    assert len(seen) == len(set(seen)) == 24


def test_evaluation_sees_every_record_once_in_order(Loader, data):
    seen = []
    for rank in range(2):
        loader = Loader(_cfg(data, num_workers=2, batch_size=4), "validation", False, rank, 2)
        batches = _epoch(loader)
        assert len(batches) == len(loader) == 7  # 25 records: six of 4 and one of 1
        assert batches[-1][1].shape == (1,)
        seen += _labels(batches)
    assert seen == list(range(50))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_batches_do_not_depend_on_the_number_of_workers(Loader, data):
    # 24 records per rank in batches of 5: 4 batches, shared unevenly by 3 workers.
    reference = _epoch(Loader(_cfg(data, batch_size=5), "train", True, 1, 2), epoch=1)
    assert len(reference) == 4
    for workers in (2, 3):
        batches = _epoch(Loader(_cfg(data, batch_size=5, num_workers=workers), "train", True, 1, 2), epoch=1)
        assert len(batches) == len(reference)
        for (a, la), (b, lb) in zip(batches, reference):
            assert torch.equal(a, b) and torch.equal(la, lb)


def _corrupt(path, offset, size):
    raw = bytearray(path.read_bytes())
    raw[offset + size // 2] ^= 0xFF  # a data byte: the data CRC fails, the index stays valid
    path.write_bytes(bytes(raw))


def _record_of_label(data, label):
    """(shard, offset, size) of the record that stores label + 1 (labels count records in file order)."""
    for shard in sorted(data.glob("train-*-of-*")):
        if shard.name.endswith(".idx"):
            continue
        index = build_index(shard)
        if label < len(index):
            return (shard, *index[label])
        label -= len(index)
    raise AssertionError("no such record")


def test_resume_reproduces_the_batch_sequence_without_decoding_skipped_batches(Loader, data, tmp_path):
    data = _write_dataset(tmp_path / "copy")
    cfg = _cfg(data, num_workers=2)
    reference = _epoch(Loader(cfg, "train", True, 0, 1), epoch=1)

    for label in _labels(reference[:3]):  # break every record of the batches the resumed run skips
        _corrupt(*_record_of_label(data, label))

    loader = Loader(cfg, "train", True, 0, 1)
    loader.load_state_dict({"epoch": 1, "batch": 3})
    loader.set_epoch(1)  # the trainer may announce the resumed epoch: the position must survive
    assert loader.state_dict() == {"epoch": 1, "batch": 3, "skipped": 0}
    resumed = []
    for images, labels in loader:
        resumed.append((images.clone(), labels.clone()))
        if len(resumed) == 2:
            assert loader.state_dict() == {"epoch": 1, "batch": 5, "skipped": 0}
    assert len(resumed) == len(reference) - 3
    for (a, la), (b, lb) in zip(resumed, reference[3:]):
        assert torch.equal(a, b) and torch.equal(la, lb)

    shard, offset, _ = _record_of_label(data, _labels(reference[:1])[0])
    with pytest.raises(DataError, match=f"^corrupted record at offset {offset} in {shard}") as error:
        _epoch(Loader(cfg, "train", True, 0, 1), epoch=1)  # a fresh run does read them
    assert "\n" not in str(error.value)  # one line, even from a worker process

    loader.load_state_dict({"epoch": 1, "batch": 3})
    loader.set_epoch(2)  # a different epoch starts at its beginning
    assert loader.state_dict()["batch"] == 0


def test_skip_corrupt_counts_and_keeps_the_training_batch_shape(Loader, tmp_path):
    data = _write_dataset(tmp_path / "d")
    shard, offset, size = _record_of_label(data, 30)
    _corrupt(shard, offset, size)
    with pytest.raises(DataError, match=f"offset {offset} in {shard}"):
        _epoch(Loader(_cfg(data), "train", True, 0, 1))

    loader = Loader(_cfg(data, skip_corrupt=True), "train", True, 0, 1)
    batches = _epoch(loader)
    assert loader.skipped == 1
    assert all(images.shape[0] == 4 for images, _ in batches)
    seen = _labels(batches)
    assert 30 not in seen and len(seen) == 48 and len(set(seen)) == 47  # one good image repeated

    evaluation = Loader(_cfg(data, skip_corrupt=True), "train", False, 0, 1)
    seen = _labels(_epoch(evaluation))
    assert seen == [i for i in range(48) if i != 30] and evaluation.skipped == 1

    # A resume goes on from the count (metrics.jsonl's skipped_records): the batches before its position
    # are not read again, so it restarted at 0 and stayed short of an uninterrupted run's.
    resumed = Loader(_cfg(data, skip_corrupt=True), "train", True, 0, 1)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.skipped == 1 and loader.state_dict()["skipped"] == 1


def test_label_out_of_range_is_an_error(Loader, data):
    with pytest.raises(DataError, match=r"label 41 \+ label_offset -1 is outside \[0, 40\)"):
        _epoch(Loader(_cfg(data, num_classes=40), "validation", False, 0, 1))


def test_too_few_records_for_one_batch_per_rank(Loader, data):
    with pytest.raises(DataError, match="fewer than one batch per rank"):
        Loader(_cfg(data, batch_size=32), "train", True, 0, 2)


def test_missing_data_dir(Loader, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        Loader(_cfg(tmp_path / "nothing"), "train", True, 0, 1)


def test_shuffle_buffer_order_is_tf_data_shuffle():
    rng = np.random.default_rng(0)
    for n, buffer in ((100, 10), (5, 10), (50, 1), (0, 4)):
        order = shuffle_buffer_order(n, buffer, rng)
        assert sorted(order) == list(range(n))
        # Element k enters the buffer after k - buffer + 1 emissions, so it cannot leave before then.
        assert all(int(order[t]) <= t + buffer - 1 for t in range(n))
    assert list(shuffle_buffer_order(50, 1, rng)) == list(range(50))
    order = shuffle_buffer_order(1000, 100, rng)
    assert np.abs(np.diff(order)).mean() > 10  # actually mixed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batches_are_pinned_with_cuda(Loader, data):
    images, labels = next(iter(Loader(_cfg(data, num_workers=1), "train", True, 0, 1)))
    assert images.is_pinned() and labels.is_pinned()


def test_garbage_is_collected_before_the_workers_fork(data):
    """A finalizer of garbage the parent left uncollected must not run in a forked worker: a dropped
    DALI pipeline's __del__ hung a DataLoader worker in CI, waiting for threads the fork had not
    copied. The loader collects before it forks, so such finalizers run in the trainer's process."""
    import gc
    import os

    ran_in = []

    class Cycle:
        def __del__(self):
            ran_in.append(os.getpid())

    gc.disable()  # (as between the collector's automatic runs): the cycle stays until collected
    try:
        cycle = Cycle()
        cycle.self = cycle
        del cycle
        batches = iter(TorchLoader(_cfg(data, num_workers=1), "train", True))
        next(batches)
        assert ran_in == [os.getpid()]
        del batches
    finally:
        gc.enable()


@pytest.mark.parametrize("seconds, rank, said", [(0.4, 0, True), (0.4, 1, False), (0.0, 0, False)])
def test_a_long_kernel_warm_up_says_it_compiles(monkeypatch, capsys, seconds, rank, said):
    """A cold numba compile keeps the trainer silent for about a minute before its first step; past
    COMPILE_NOTE_AFTER_S rank 0 says why on stderr (other ranks would repeat it); from the cache (about
    1 s) nothing is said."""
    import time

    from fasttrain.data import torch_pipeline

    monkeypatch.setattr(torch_pipeline, "COMPILE_NOTE_AFTER_S", 0.1)
    monkeypatch.setattr(torch_pipeline, "warm_up", lambda: time.sleep(seconds))
    monkeypatch.setattr(torch_pipeline, "_warm_up_reader", lambda: None)
    torch_pipeline.warm_up_kernels(rank)
    time.sleep(0.2)  # a note not cancelled in time would print now
    err = capsys.readouterr().err
    assert ("compiling the input pipeline's numba kernels" in err) is said, err


def test_an_epoch_leaves_torch_s_global_random_state_as_it_was(Loader, data):
    # A DataLoader draws its workers' base seed from torch's global generator unless given its own (with
    # no workers too): the state a checkpoint saves mid-epoch was then one draw on, and a run resumed
    # from it drew again, so Inception's dropout masks parted from an uninterrupted run's (--loader
    # processes; the threads draw nothing).
    for workers in (0, 1):
        loader = Loader(_cfg(data, num_workers=workers), "train", True)
        torch.manual_seed(7)
        before = torch.get_rng_state()
        next(iter(loader))
        assert torch.equal(torch.get_rng_state(), before), workers
