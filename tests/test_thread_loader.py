"""fasttrain/data/thread_loader.py: the same batches as the DataLoader-process loader, the ring's
consumer contract, errors, signal masks and no thread left behind.

The reference for the images is the process loader (fasttrain.data.torch_pipeline), whose transforms
tests/test_transforms_tf.py checks against TensorFlow's pixels; equality here is exact (torch.equal):
both loaders must run the same code on the same records with the same per-sample seeds, so there is
no rounding to allow for.
"""

import shutil
import signal
import threading
import time

import pytest
import torch

from fasttrain.config import make_config
from fasttrain.data import DataError, build_loader
from fasttrain.data.tfrecord import build_index
from fasttrain.data.thread_loader import PREFETCH, ThreadLoader
from fasttrain.data.torch_pipeline import TorchLoader


def _cfg(data_dir, **overrides):
    values = dict(
        data_dir=str(data_dir),
        data_cache_dir=str(data_dir) + "-cache",
        data_backend="torch",
        batch_size=8,
        image_size=48,
        num_classes=4,
        label_offset=-1,
        num_workers=2,
        shuffle_buffer=16,
        seed=3,
    )
    values.update(overrides)
    return make_config(**values)


def _epoch(loader, epoch=None):
    if epoch is not None:
        loader.set_epoch(epoch)
    return [(images.clone(), labels.clone()) for images, labels in loader]


def _same(a, b):
    assert len(a) == len(b)
    for (ia, la), (ib, lb) in zip(a, b, strict=True):
        assert torch.equal(ia, ib) and torch.equal(la, lb)


def _loader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("fasttrain-loader")]


@pytest.mark.parametrize(
    "preprocess, colour, seed", [("resnet", False, 3), ("inception", True, 3), ("inception", False, 11)]
)
def test_threads_give_the_process_loaders_batches(synthetic, preprocess, colour, seed):
    cfg = _cfg(synthetic, preprocess=preprocess, color_distort=colour, seed=seed)
    for epoch in (0, 2):
        for rank in (0, 1):
            reference = _epoch(TorchLoader(cfg, "train", True, rank, 2), epoch)
            threads = ThreadLoader(cfg, "train", True, rank, 2)
            _same(_epoch(threads, epoch), reference)
            assert len(reference) == len(threads) == 7  # 60 records per rank in batches of 8
    # Evaluation: in order, the last batch partial (80 records over 2 ranks: 5 batches of 8).
    for rank in (0, 1):
        reference = _epoch(TorchLoader(cfg, "validation", False, rank, 2))
        _same(_epoch(ThreadLoader(cfg, "validation", False, rank, 2)), reference)


def test_one_thread_and_three_give_the_same_batches(synthetic):
    reference = _epoch(ThreadLoader(_cfg(synthetic, num_workers=1), "train", True), 1)
    _same(_epoch(ThreadLoader(_cfg(synthetic, num_workers=3), "train", True), 1), reference)


def test_a_resumed_position_reproduces_the_rest_of_the_epoch(synthetic):
    cfg = _cfg(synthetic)
    reference = _epoch(TorchLoader(cfg, "train", True), 1)
    loader = ThreadLoader(cfg, "train", True)
    loader.load_state_dict({"epoch": 1, "batch": 5})
    loader.set_epoch(1)
    resumed = _epoch(loader)
    _same(resumed, reference[5:])
    assert loader.state_dict() == {"epoch": 1, "batch": len(reference), "skipped": 0}


def test_a_batch_stays_valid_until_hold_more_are_requested_and_the_ring_is_reused(synthetic):
    for hold in (1, 3):
        loader = ThreadLoader(_cfg(synthetic), "train", True, hold=hold, reuse_buffers=True)
        reference = _epoch(TorchLoader(_cfg(synthetic), "train", True))
        held, buffers = [], set()
        for j, (images, labels) in enumerate(loader):
            time.sleep(0.02)  # let the threads fill every slot they may: an early write would show
            held.append((j, images, labels))
            held = held[-hold:]  # what batch_stream keeps for grad_accum_steps = hold
            for k, im, lb in held:  # every batch still held is intact (the threads run ahead meanwhile)
                assert torch.equal(im, reference[k][0]) and torch.equal(lb, reference[k][1])
            buffers.add(images.data_ptr())
        assert len(buffers) == hold + PREFETCH  # a ring: no batch allocated after the first ones


def _corrupt(shard, offset, size):
    raw = bytearray(shard.read_bytes())
    raw[offset + size // 2] ^= 0xFF  # a data byte: the data CRC fails, the index stays valid
    shard.write_bytes(bytes(raw))


def _copy_with_corrupt_records(synthetic, tmp_path, records):
    data = tmp_path / "data"
    shutil.copytree(synthetic, data)
    shard = data / "train-00001-of-00003"
    index = build_index(shard)
    for r in records:
        _corrupt(shard, *index[r])
    return data, shard, index


def test_skip_corrupt_counts_and_tops_up_as_the_process_loader(synthetic, tmp_path):
    data, _, _ = _copy_with_corrupt_records(synthetic, tmp_path, (3, 4, 20))
    for training, split in ((True, "train"), (False, "train")):
        cfg = _cfg(data, skip_corrupt=True, batch_size=4, num_workers=2)
        processes, threads = TorchLoader(cfg, split, training), ThreadLoader(cfg, split, training)
        _same(_epoch(threads), _epoch(processes))
        assert threads.skipped == processes.skipped == 3


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_a_corrupt_record_is_one_line_naming_the_first_bad_row(synthetic, tmp_path):
    data, shard, index = _copy_with_corrupt_records(synthetic, tmp_path, (5, 6))
    cfg = _cfg(data, num_workers=3)
    errors = []
    for cls in (TorchLoader, ThreadLoader):  # evaluation order: records 5 and 6 share batch 5 of 8
        with pytest.raises(DataError) as error:
            _epoch(cls(cfg, "train", False))
        errors.append(str(error.value))
    assert errors[0] == errors[1]
    assert errors[1].startswith(f"corrupted record at offset {index[5][0]} in {shard}")
    assert "\n" not in errors[1]
    assert not _loader_threads()


def test_every_record_of_a_batch_corrupt_is_the_process_loaders_error(synthetic, tmp_path):
    data, _, _ = _copy_with_corrupt_records(synthetic, tmp_path, range(40))  # a whole shard
    cfg = _cfg(data, skip_corrupt=True, shuffle_buffer=1)  # unshuffled: some batch is all shard 1
    messages = []
    for cls in (TorchLoader, ThreadLoader):
        with pytest.raises(DataError, match="every record of training batch") as error:
            _epoch(cls(cfg, "train", True))
        messages.append(str(error.value))
    assert messages[0] == messages[1]


def test_no_thread_is_left_after_exhaustion_close_or_an_exception(synthetic):
    loader = ThreadLoader(_cfg(synthetic), "train", True)
    _epoch(loader)
    assert not _loader_threads()

    batches = iter(loader)
    next(batches)
    assert len(_loader_threads()) == 2
    batches.close()
    assert not _loader_threads()

    with pytest.raises(ZeroDivisionError):
        for _ in loader:
            1 / 0  # noqa: B018 - the consumer failing mid-epoch
    assert not _loader_threads()

    for _ in loader:
        break  # the generator is dropped: CPython closes it at once
    assert not _loader_threads()


def _blocked_signals(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as f:
        line = next(x for x in f if x.startswith("SigBlk:"))
    return int(line.split()[1], 16)


def test_stop_signals_go_to_the_main_thread_not_the_loaders(synthetic):
    """The threads block SIGTERM and SIGINT, so the kernel delivers them to the main thread, whose
    handler stops the trainer; the main thread's own mask is left as it was."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    batches = iter(ThreadLoader(_cfg(synthetic), "train", True))
    next(batches)
    try:
        for t in _loader_threads():
            mask = _blocked_signals(t.native_id)
            assert mask >> (signal.SIGTERM - 1) & 1 and mask >> (signal.SIGINT - 1) & 1
    finally:
        batches.close()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


@pytest.mark.parametrize("loader", ["threads", "processes"])
def test_batches_a_caller_keeps_stay_what_they_were(synthetic, loader):
    """build_loader's default iteration hands out batches the caller owns: a whole epoch kept in a
    list (and labels kept apart from their images) equals a pass that cloned each batch at once."""
    cfg = _cfg(synthetic, loader=loader)
    for split, training in (("train", True), ("validation", False)):
        reference = _epoch(build_loader(cfg, split, training=training))  # each batch cloned at once
        kept = list(build_loader(cfg, split, training=training))
        _same(kept, reference)
        labels = [y for _, y in build_loader(cfg, split, training=training)]
        assert all(torch.equal(y, r) for y, (_, r) in zip(labels, reference, strict=True))
        assert len({images.data_ptr() for images, _ in kept}) == len(kept)


def test_the_trainers_zero_copy_ring_is_an_explicit_option(synthetic):
    ring = build_loader(_cfg(synthetic), "train", training=True, reuse_buffers=True)
    assert len({images.data_ptr() for images, _ in ring}) == 1 + PREFETCH  # hold 1: reused slots


def test_build_loader_takes_the_loader_setting(synthetic):
    threads = build_loader(_cfg(synthetic, grad_accum_steps=2), "train", training=True)
    assert isinstance(threads, ThreadLoader) and threads.hold == 2  # batch_stream keeps 2 micro-batches
    assert build_loader(_cfg(synthetic, grad_accum_steps=2), "validation", training=False).hold == 1
    processes = build_loader(_cfg(synthetic, loader="processes"), "train", training=True)
    assert isinstance(processes, TorchLoader)


def test_the_hot_path_kernels_release_the_gil():
    """The threads decode and transform in parallel only where these calls drop the GIL: every numba
    kernel of the transforms (nogil=True) and the cropped JPEG decode's library (a ctypes.CDLL,
    which releases the GIL around each call; a PyDLL would hold it). The exceptions are the calls of
    a microsecond, which keep it: dropping it hands it to another loader thread and waits to take it
    back, once more per image (perf's count of take_gil per image, one thread: 5.89 with the crop
    search's kernel and the header read dropping it, 3.89 without, 2.04 with the decode and resize
    in one call, fasttrain.data.jpeg.fused, whose kernels must drop it too)."""
    import ctypes

    import numba

    from fasttrain.data import color, resize, transforms
    from fasttrain.data.jpeg import decode as jpeg
    from fasttrain.data.jpeg import fused

    kernels = [
        getattr(module, name)
        for module in (color, resize, transforms, fused)
        for name in dir(module)
        if isinstance(getattr(module, name), numba.core.registry.CPUDispatcher)
    ]
    quick = {transforms._sample_box, color._sample_color}  # the crop search, the colour draws: ~1 us
    assert len(kernels) >= 10 and quick <= set(kernels)
    assert all(k.targetoptions.get("nogil") for k in kernels if k not in quick), [
        k for k in kernels if not k.targetoptions.get("nogil") and k not in quick
    ]
    assert not any(k.targetoptions.get("nogil") for k in quick)
    if jpeg.CROP_DECODE:
        assert not jpeg._turbo.lib._func_flags_ & ctypes._FUNCFLAG_PYTHONAPI
        assert jpeg._turbo.quick._func_flags_ & ctypes._FUNCFLAG_PYTHONAPI  # the header read


def _doctored(monkeypatch) -> list[bool]:
    """Counts the doctored decodes: one entry per decode that went through the row checkpoints
    (True) or found none usable (False)."""
    from fasttrain.data.jpeg import doctor as jpeg_rows

    doctored, doctor = [], jpeg_rows.doctor

    def counted(*args):
        result = doctor(*args)
        doctored.append(result is not None)
        return result

    monkeypatch.setattr(jpeg_rows, "doctor", counted)
    # The fused decode and resize (fasttrain.data.jpeg.fused) doctor their stream in one compiled call.
    from fasttrain.data.jpeg import fused

    run = fused.run

    def counted_run(kernel, jpeg, checkpoints, *rest):
        def counted_kernel(*args):
            result = kernel(*args)
            if result[0] == fused.DONE and checkpoints is not None:
                doctored.append(bool(result[2]))
            return result

        return run(counted_kernel, jpeg, checkpoints, *rest)

    monkeypatch.setattr(fused, "run", counted_run)
    return doctored


@pytest.mark.parametrize("preprocess", ["resnet", "inception", "vgg"])
def test_row_checkpoints_leave_the_batches_as_they_are(synthetic, tmp_path, monkeypatch, preprocess):
    """With the shards' JPEG row checkpoints built (python -m fasttrain.data row-checkpoints), both loaders'
    train batches equal those decoded without them (the reference: the same loader on the same shards
    with no sidecars, which the tests above hold to the process loader and to TensorFlow's pixels)."""
    from fasttrain.data.jpeg import row_index
    from fasttrain.data.jpeg.row_build import main

    doctored = _doctored(monkeypatch)
    # The note is given once per directory and process; pytest may hand the next parameter the same
    # path (tmp_path_retention_policy "failed" removes a passing test's directory, and its number is
    # reused): start from a process that has noted nothing.
    monkeypatch.setattr(row_index, "_noted", set())
    data = tmp_path / "data"
    shutil.copytree(synthetic, data)  # copytree keeps the mtimes the sidecars are checked against
    plain = ThreadLoader(_cfg(data, preprocess=preprocess), "train", True)
    assert len(plain.notes) == 1 and "no JPEG row checkpoints" in plain.notes[0]  # the trainer prints it
    reference = _epoch(plain, 1)
    assert main([str(data), "--workers", "1"]) == 0
    assert list(data.glob("train-*.rows"))
    cfg = _cfg(data, preprocess=preprocess)
    threads = ThreadLoader(cfg, "train", True)
    assert threads.notes == []
    _same(_epoch(threads, 1), reference)
    _same(_epoch(TorchLoader(cfg, "train", True), 1), reference)
    assert sum(doctored) > len(doctored) // 2  # most decodes did go through a doctored stream


def test_a_thread_dying_outside_a_sample_is_an_error_not_a_hang(synthetic, monkeypatch):
    """A loader thread that dies outside the per-sample try (its reader's set-up; with CUDA, a slot's
    release event whose synchronize raises after an asynchronous CUDA error) must not leave the
    consumer waiting forever for a batch no thread will finish."""
    import fasttrain.data.thread_loader as tl

    class FailingEvent:
        def synchronize(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(tl, "_release_events", lambda: True)
    monkeypatch.setattr(tl, "_recorded_event", FailingEvent)
    loader = ThreadLoader(_cfg(synthetic, batch_size=2), "train", True, reuse_buffers=True)
    result = {}

    def consume():
        try:
            for _ in loader:
                pass
        except RuntimeError as e:
            result["error"] = e

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the consumer hangs"
    assert "illegal memory access" in str(result["error"])
    assert not _loader_threads()


@pytest.mark.parametrize("skip_corrupt", [False, True])
@pytest.mark.parametrize("loader", ["threads", "processes"])
def test_a_shard_deleted_while_training_is_one_error(synthetic, tmp_path, loader, skip_corrupt):
    # open() of a shard gone since the split was listed raised FileNotFoundError: a traceback, as for a
    # bug (with processes, "Caught FileNotFoundError in DataLoader worker process 0"), and skip_corrupt
    # would have skipped every record of it, a line each.
    data = tmp_path / "data"
    shutil.copytree(synthetic, data)
    cfg = _cfg(data, loader=loader, skip_corrupt=skip_corrupt, input_order="one_stream")
    train = build_loader(cfg, "train", training=True)
    gone = data / "train-00001-of-00003"
    gone.unlink()
    with pytest.raises(DataError, match=f"cannot read shard {gone} \\(No such file or directory\\)"):
        _epoch(train, 0)
