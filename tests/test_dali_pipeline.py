"""The DALI pipeline in DALI's CPU-only mode (device_id=None): order, sharding, resume, output types,
errors. (The images its graph makes: test_dali_graph.py.)

References are independent of fasttrain.data.dali_pipeline: records and labels come from the TFRecord
reader (fasttrain.data.tfrecord + imagenet.decode_record), label order from the torch pipeline. Every
record of the test data has its own label, so labels identify the records a loader read.
"""

import io
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed")

from fasttrain.config import make_config  # noqa: E402
from fasttrain.data import DataError, build_loader  # noqa: E402
from fasttrain.data.dali_pipeline import DALI_MIN_VERSION, DaliLoader, check_dali_version  # noqa: E402
from fasttrain.data.example import encode_example  # noqa: E402
from fasttrain.data.imagenet import decode_record, list_shards  # noqa: E402
from fasttrain.data.tfrecord import iter_records, write_index_file, write_records  # noqa: E402
from fasttrain.errors import SettingError  # noqa: E402
from fasttrain.precision import Precision  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARDS = {"train": (23, 17, 29), "validation": (13, 10)}  # records per shard: uneven on purpose
NUM_CLASSES = 100
EXTREME = (200, 12)  # (width, height): no window with aspect ratio in [0.75, 1.33] fits the side limits


def _jpeg(rng, width, height) -> bytes:
    # Smooth content (an upsampled 4 x 4 random image) plus mild noise, like a photo at low resolution.
    small = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
    pixels = np.asarray(small.resize((width, height), Image.BICUBIC), dtype=np.float32)
    pixels = np.clip(pixels + rng.normal(0, 6, pixels.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _example(rng, label: int, jpeg: bytes | None = None, size=None) -> bytes:
    width, height = size or (int(v) for v in rng.integers(24, 97, size=2))
    boxes = []
    for _ in range(int(rng.integers(0, 3))):  # 0..2 boxes, each at least 0.2 of a side
        y0, x0 = rng.uniform(0, 0.7, size=2)
        boxes.append((y0, x0, rng.uniform(y0 + 0.2, 1.0), rng.uniform(x0 + 0.2, 1.0)))
    return encode_example(
        {
            "image/encoded": jpeg if jpeg is not None else _jpeg(rng, width, height),
            "image/class/label": label,
            **{
                f"image/object/bbox/{k}": (float, [float(b[i]) for b in boxes])
                for i, k in enumerate(("ymin", "xmin", "ymax", "xmax"))
            },
        }
    )


def write_dataset(root: Path, bad: dict | None = None) -> Path:
    """Shards of SHARDS with unique labels 1, 2, ... per split; bad[(split, shard, i)] replaces a JPEG."""
    rng = np.random.default_rng(7)
    for split, counts in SHARDS.items():
        label = 1
        for s, count in enumerate(counts):
            records = []
            for i in range(count):
                jpeg = (bad or {}).get((split, s, i))
                size = EXTREME if (split == "train" and i == 5) else None
                records.append(_example(rng, label, jpeg, size))
                label += 1
            path = root / f"{split}-{s:05d}-of-{len(counts):05d}"
            write_index_file(path.with_name(path.name + ".idx"), write_records(path, records))
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("dali-data"))


def _cfg(data_dir, **overrides):
    values = dict(
        data_dir=str(data_dir), batch_size=8, image_size=32, num_classes=NUM_CLASSES, label_offset=-1
    )
    values.update(num_workers=2, preprocess="resnet", data_cache_dir=str(Path(data_dir) / "cache"))
    return make_config(**{**values, **overrides})


def _reference_records(data_dir, split):
    """Every record of the split in stored order, read by the CRC-checking TFRecord reader."""
    return [
        decode_record(payload, shard, offset, -1, NUM_CLASSES)
        for shard in list_shards(data_dir, split)
        for offset, payload in iter_records(shard)
    ]


def _labels(loader) -> list[int]:
    return [int(v) for _, labels in loader for v in labels]


@pytest.mark.parametrize("world_size", [1, 2])
def test_eval_labels_and_batches_match_the_torch_pipeline(data_dir, world_size):
    from fasttrain.data.torch_pipeline import TorchLoader

    cfg = _cfg(data_dir, num_workers=0)
    for rank in range(world_size):
        dali = DaliLoader(cfg, "validation", False, rank, world_size)
        torch_loader = TorchLoader(cfg, "validation", False, rank, world_size)
        assert len(dali) == len(torch_loader)
        assert [y.tolist() for _, y in dali] == [y.tolist() for _, y in torch_loader]


def test_evaluation_sees_every_record_once_across_two_ranks(data_dir):
    cfg = _cfg(data_dir, batch_size=4)
    seen = []
    for rank in range(2):
        loader = DaliLoader(cfg, "validation", False, rank, 2)
        sizes = [len(y) for _, y in loader]
        assert len(sizes) == len(loader) and all(n == 4 for n in sizes[:-1]) and 0 < sizes[-1] <= 4
        seen += _labels(loader)
        assert _labels(loader) == _labels(loader)  # a second pass (EMA evaluation) reads the same
    assert sorted(seen) == list(range(23))


def test_training_ranks_read_disjoint_records_and_reshuffle_each_epoch(data_dir):
    cfg = _cfg(data_dir, batch_size=4)
    loaders = [DaliLoader(cfg, "train", True, rank, 2) for rank in range(2)]
    n = 69
    per_rank = (n // 2) // 4
    epochs = []
    for epoch in range(4):
        seen = []
        for loader in loaders:
            loader.set_epoch(epoch)
            batches = list(loader)
            assert len(batches) == len(loader) == per_rank and all(len(y) == 4 for _, y in batches)
            seen.append(_labels(batches))
        both = seen[0] + seen[1]
        assert len(both) == len(set(both)) == 2 * per_rank * 4  # no record twice in an epoch
        assert set(both) <= set(range(n))
        # Labels follow the stored order, so stored-order reading would give runs of consecutive labels.
        assert sum(b == a + 1 for a, b in zip(both, both[1:])) < len(both) // 4
        epochs.append(seen)
    first_shard = np.cumsum(SHARDS["train"])  # label l is in shard searchsorted(first_shard, l, "right")
    shards = {tuple(np.unique(np.searchsorted(first_shard, seen[0], "right"))) for seen in epochs}
    assert len(shards) > 1  # the shard order changes too, so rank 0 reads other shards


def _windows(loader, positions) -> np.ndarray:
    """The train crop windows (x, y, w, h) the loader's pipeline draws for `positions`, in order."""
    pipe = loader._build_pipeline(positions, 0, crop_outputs=True)
    out = [pipe.run() for _ in range(len(positions) // loader.cfg.batch_size)]
    return np.concatenate(
        [np.concatenate([np.array(o[2].as_tensor()), np.array(o[3].as_tensor())], 1) for o in out]
    )


def test_augmentation_is_seeded_by_the_config_seed_and_epoch(data_dir):
    positions = np.arange(16)  # the same records for every pipeline
    loaders = [DaliLoader(_cfg(data_dir, seed=seed), "train", True) for seed in (1, 1, 2, 1)]
    loaders[3].set_epoch(1)
    windows = [_windows(loader, positions) for loader in loaders]
    assert np.array_equal(windows[0], windows[1])  # reproducible
    assert not np.array_equal(windows[0], windows[2]) and not np.array_equal(windows[0], windows[3])


def test_resume_reads_the_remaining_batches_of_the_epoch(data_dir):
    cfg = _cfg(data_dir)
    loader = DaliLoader(cfg, "train", True)
    loader.set_epoch(1)
    full = [y.tolist() for _, y in loader]
    assert len(full) == 69 // 8
    stream = iter(loader)
    next(stream), next(stream)
    assert loader.state_dict() == {"epoch": 1, "batch": 2, "skipped": 0}
    resumed = DaliLoader(cfg, "train", True)
    resumed.load_state_dict({"epoch": 1, "batch": 3})
    assert [y.tolist() for _, y in resumed] == full[3:]
    resumed.set_epoch(2)
    assert len(list(resumed)) == len(full)  # the loaded position belonged to epoch 1 only


@pytest.mark.parametrize(
    "name, dtype", [("fp16", torch.float16), ("bf16", torch.float32), ("fp32", torch.float32)]
)
def test_build_loader_takes_dalis_output_type_from_the_runs_precision(data_dir, name, dtype):
    # The run's resolved policy is passed down (not resolved again from the config): DALI writes fp16
    # for an fp16 run and fp32 otherwise (it has no bf16 output; autocast casts on the device).
    precision = Precision(name, channels_last=False, cuda_graph=False)
    loader = build_loader(_cfg(data_dir, data_backend="dali"), "train", training=True, precision=precision)
    images, _ = next(iter(loader))
    assert images.dtype == dtype


def test_undecodable_jpeg_names_the_shard_and_record(tmp_path):
    data_dir = write_dataset(tmp_path, bad={("validation", 1, 4): b"\xff\xd8\xff\xe0 not a jpeg" * 8})
    loader = DaliLoader(_cfg(data_dir), "validation", False)
    with pytest.raises(DataError) as info:
        list(loader)
    message = str(info.value)
    assert "record 4 (offset " in message and "validation-00001-of-00002:" in message
    assert "python -m fasttrain.data verify" in message and "--decode" in message


def test_out_of_range_label_names_the_record(data_dir):
    first_bad = next(r for r in _reference_records(data_dir, "validation") if r.label >= 20)
    with pytest.raises(DataError) as info:  # LabelRangeError, from the check before the first batch
        list(DaliLoader(_cfg(data_dir, num_classes=20), "validation", False))
    expected = f"record at offset {first_bad.offset} in {first_bad.file}: label 21 + label_offset -1"
    assert str(info.value).startswith(expected)


def test_skip_corrupt_is_refused(data_dir):
    with pytest.raises(SettingError, match="skip_corrupt needs data_backend=torch"):
        DaliLoader(_cfg(data_dir, skip_corrupt=True), "train", True)


def test_pipelines_are_built_for_stream_bound_outputs(data_dir, monkeypatch):
    # pipe.run(stream) needs the dynamic executor, DALI's default only from 1.51: ask for it.
    import nvidia.dali

    built = []

    def recording_pipeline(*args, **kwargs):
        built.append(kwargs)
        return real_pipeline(*args, **kwargs)

    real_pipeline = nvidia.dali.Pipeline
    monkeypatch.setattr(nvidia.dali, "Pipeline", recording_pipeline)
    for split, training in (("train", True), ("validation", False)):
        next(iter(DaliLoader(_cfg(data_dir), split, training)))
    assert len(built) == 2 and all(kwargs.get("exec_dynamic") is True for kwargs in built), built


def test_the_dali_floor_is_setup_pys_and_older_releases_are_refused(data_dir, monkeypatch):
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    floors = re.findall(r"nvidia-dali-cuda120>=(\d+)\.(\d+)", setup)
    assert floors and {tuple(map(int, f)) for f in floors} == {DALI_MIN_VERSION}
    floor = ".".join(map(str, DALI_MIN_VERSION))
    for ok in (floor, f"{floor}.0", "1.51.2", "2.4.0", "10.0.0"):
        check_dali_version(ok)
    for old in ("1.40.0", "1.43.0", "0.31.0"):
        with pytest.raises(SettingError, match=rf"NVIDIA DALI {old} is older than {floor}.*>={floor}"):
            check_dali_version(old)
    import nvidia.dali

    monkeypatch.setattr(nvidia.dali, "__version__", "1.43.0")
    with pytest.raises(SettingError, match="NVIDIA DALI 1.43.0 is older than"):
        DaliLoader(_cfg(data_dir), "validation", False)


def test_labels_stay_the_loaders_after_dali_reuses_its_buffers(data_dir, monkeypatch):
    # Every output buffer DALI hands out is overwritten as soon as the loader has yielded its batch,
    # as DALI may do once run() is called again: the labels already yielded must not change.
    build = DaliLoader._build_pipeline

    class ReusingPipeline:
        def __init__(self, pipe):
            self.pipe, self.handed_out = pipe, []

        def run(self, *args):
            for outputs in self.handed_out:
                for out in outputs:
                    torch.from_dlpack(out.as_tensor()).fill_(-7)
            self.handed_out.append(self.pipe.run(*args))
            return self.handed_out[-1]

    monkeypatch.setattr(
        DaliLoader, "_build_pipeline", lambda self, *a, **k: ReusingPipeline(build(self, *a, **k))
    )
    expected = [r.label for r in _reference_records(data_dir, "validation")]
    batches = list(DaliLoader(_cfg(data_dir), "validation", False))
    assert [int(v) for _, labels in batches for v in labels] == expected
    assert not any(bool((images == -7).all()) for images, _ in batches)


def test_cli_trains_a_few_steps_with_the_dali_backend(data_dir, tmp_path):
    if not (ROOT / "fasttrain" / "train.py").exists():
        pytest.skip("the trainer is not there yet")
    command = [sys.executable, "-m", "fasttrain", "--data_backend=dali", "--max_steps=3", "--log_every=1"]
    command += [f"--data_dir={data_dir}", f"--train_dir={tmp_path / 'run'}", "--batch_size=8"]
    command += [f"--num_classes={NUM_CLASSES}", "--image_size=32", "--no-eval_at_end", "--device=cpu"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "step 3, loss = " in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixed_decode_matches_the_cpu_pipeline(data_dir):
    cfg = _cfg(data_dir)
    cpu = list(DaliLoader(cfg, "validation", False))
    gpu = list(DaliLoader(cfg, "validation", False, device=torch.device("cuda")))
    assert [y.tolist() for _, y in gpu] == [y.tolist() for _, y in cpu]
    assert all(x.is_cuda and y.is_cuda for x, y in gpu)
    # nvJPEG and libjpeg-turbo may differ by a few levels in the IDCT; the resize averages them out.
    assert max(float((g.cpu() - c).abs().max()) for (g, _), (c, _) in zip(gpu, cpu)) <= 4.0
    images, labels = next(
        iter(DaliLoader(cfg, "train", True, device=torch.device("cuda"), dtype=torch.float16))
    )
    assert images.is_cuda and images.dtype == torch.float16 and images.shape == (8, 32, 32, 3)
