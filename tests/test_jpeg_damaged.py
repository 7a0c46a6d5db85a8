"""Damaged JPEGs decode where TensorFlow's decodes do, to its pixels (fasttrain/data/jpeg/decode.py).

The reference is TensorFlow 2.21 itself: tests/data/tf-build/damaged/ holds JPEGs cut or spoiled from
one photo (make_tf_build.py), verdicts.json whether decode_jpeg(channels=3) decodes each,
tf-crops.json whether decode_and_crop_jpeg decodes each of five windows, and tf-pixels.npz the pixels
of every decode that succeeded (make_tf_damaged_pixels.py). libjpeg's warnings (corrupt data it steps
over: "premature end of data segment", "extraneous bytes before marker") fail no TensorFlow decode;
running out of data does.

The refusals TensorFlow does not make are listed in REFUSED, each with its reason: they stop training
with one line naming the record (or are skipped with skip_corrupt), never decode to other pixels.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from record_helpers import _features
from test_thread_loader import _cfg

from fasttrain.data import DataError, build_loader
from fasttrain.data.example import encode_example
from fasttrain.data.jpeg import decode
from fasttrain.data.jpeg.doctor import decode_full_window_rows
from fasttrain.data.tfrecord import write_records

DAMAGED = Path(__file__).parent / "data" / "tf-build" / "damaged"
FULL = json.loads((DAMAGED / "verdicts.json").read_text())
CROPS = json.loads((DAMAGED / "tf-crops.json").read_text())
WINDOWS = [tuple(w) for w in CROPS["windows"]]
PIXELS = np.load(DAMAGED / "tf-pixels.npz")
ALL = range(len(WINDOWS))
# (file, decode) -> windows TensorFlow decodes and fasttrain refuses, and why.
REFUSED = {
    # TensorFlow 2's decode_jpeg reads PNGs too; the seeds' TensorFlow 1 did not, nor does
    # decode_and_crop_jpeg, and build_imagenet_data.py converts ImageNet's one PNG.
    ("png_content.jpg", "full"): "a PNG",
    # A warning and then an illegal marker: above the marker TensorFlow's crop stops before it; here a
    # warning counts only in a file whose end marker libjpeg reaches, and this one's walk stops there.
    ("reserved_marker.jpg", "crop"): [0, 1, 2],
    # Sampling factors TurboJPEG's API cannot crop (Y 2x2, Cb 2x1, Cr 1x1), damaged besides: decoded
    # whole, a window's edge columns would not be TensorFlow's cropped decode (up to 28 levels off).
    ("unusual_sampling.jpg", "crop"): list(ALL),
    ("unusual_sampling.jpg", "full"): "sampling factors TurboJPEG's API does not decode (simplejpeg)",
}
NAMES = sorted(FULL)


def _tf_full(name):
    return PIXELS[f"{name}/full"] if FULL[name] else None


@pytest.mark.parametrize("name", NAMES)
def test_the_full_decode_refuses_and_decodes_as_tensorflow(name):
    expected = _tf_full(name)
    if expected is None or (name, "full") in REFUSED:
        with pytest.raises(DataError, match=f"undecodable JPEG in record at offset 7 in shard-{name}"):
            decode.decode_jpeg((DAMAGED / name).read_bytes(), f"shard-{name}", 7)
    else:
        np.testing.assert_array_equal(decode.decode_jpeg((DAMAGED / name).read_bytes()), expected)


@pytest.mark.skipif(not decode.CROP_DECODE, reason="the turbojpeg wheel's library is not installed")
@pytest.mark.parametrize("name", NAMES)
def test_the_cropped_decodes_refuse_and_decode_as_tensorflow(name):
    """decode_and_crop_jpeg and decode_window_rows (the ResNet seed's train path), window by window."""
    jpeg = (DAMAGED / name).read_bytes()
    refused = REFUSED.get((name, "crop"), [])
    for i, window in enumerate(WINDOWS):
        top, left, h, w = window
        if not CROPS["decodes"][name][i] or i in refused:
            for call in (decode.decode_and_crop_jpeg, decode.decode_window_rows):
                with pytest.raises(DataError, match="undecodable JPEG"):
                    call(jpeg, window, "shard", 0)
            continue
        expected = PIXELS[f"{name}/crop{i}"]
        got = decode.decode_and_crop_jpeg(jpeg, window)
        np.testing.assert_array_equal(got, expected, err_msg=str(window))
        rows, x = decode.decode_window_rows(jpeg, window)
        got = rows.reshape(h, -1, 3)[:, left - x : left - x + w]
        np.testing.assert_array_equal(got, expected, err_msg=str(window))


@pytest.mark.parametrize("name", [n for n in NAMES if FULL[n] and (n, "full") not in REFUSED])
def test_the_inception_window_is_tensorflows_full_decode(name):
    """The Inception seed's train path decodes only its crop, to decode_jpeg's pixels there."""
    jpeg = (DAMAGED / name).read_bytes()
    full = _tf_full(name)
    refused = REFUSED.get((name, "crop"), []) if decode.CROP_DECODE else []
    for i, (top, left, h, w) in enumerate(WINDOWS):
        if i in refused:
            continue
        rows, x = decode_full_window_rows(jpeg, None, (top, left, h, w), full.shape[1])
        got = rows.reshape(h, -1, 3)[:, left - x : left - x + w]
        np.testing.assert_array_equal(got, full[top : top + h, left : left + w], err_msg=str((name, i)))


def test_a_sound_file_pays_for_no_end_marker_walk(monkeypatch):
    """The walk runs only after libjpeg warned: a sound file's decodes are what they were."""

    def walk(data):
        raise AssertionError("reaches_end_marker ran for a sound JPEG")

    monkeypatch.setattr(decode, "reaches_end_marker", walk)
    jpeg = (DAMAGED / "sound.jpg").read_bytes()
    decode.decode_jpeg(jpeg)
    decode.decode_and_crop_jpeg(jpeg, WINDOWS[3])
    decode.decode_window_rows(jpeg, WINDOWS[1])
    with pytest.raises(AssertionError, match="ran for"):  # and it does run after a warning
        decode.decode_jpeg((DAMAGED / "early_eoi.jpg").read_bytes())


def _shard(folder: Path, names: list[str]) -> Path:
    folder.mkdir()
    records = [
        encode_example(
            _features(**{"image/encoded": (DAMAGED / n).read_bytes(), "image/height": 64, "image/width": 64})
        )
        for n in names
    ]
    write_records(folder / "train-00000-of-00001", records)
    return folder


@pytest.mark.parametrize("preprocess", ["resnet", "inception"])
def test_the_loader_trains_on_what_tensorflow_decodes_and_stops_at_a_cut_file(tmp_path, preprocess):
    """Before: the JPEGs with a libjpeg warning stopped training with 'undecodable JPEG'."""
    warned = ["early_eoi.jpg", "spoiled_entropy.jpg", "extraneous_before_eoi.jpg", "trailing_data.jpg"]
    data = _shard(tmp_path / "warned", warned)
    options = dict(batch_size=4, num_workers=2, preprocess=preprocess, image_size=32, epoch_size=4)
    cfg = _cfg(data, num_classes=8, **options)
    (images, labels), *rest = list(build_loader(cfg, "train", training=True))
    assert not rest and images.shape == (4, 32, 32, 3) and labels.tolist() == [4] * 4

    cut = _shard(tmp_path / "cut", ["sound.jpg", "truncated_half.jpg", "sound.jpg", "sound.jpg"])
    cfg = _cfg(cut, num_classes=8, **options)
    with pytest.raises(DataError, match="undecodable JPEG in record at offset .*Premature end of JPEG file"):
        list(build_loader(cfg, "train", training=True))


@pytest.mark.skipif(not decode.CROP_DECODE, reason="the turbojpeg wheel's library is not installed")
@pytest.mark.parametrize("bad", [n for n in NAMES if not FULL[n]])
def test_a_good_image_after_a_refused_one_decodes_on_the_same_thread(bad):
    """Before: after a file cut inside its header ("missing SOS marker"), TurboJPEG's next header read on
    the thread's handle returned no size, and the next image, sound, was refused ("outside the -1x-1
    image"): with skip_corrupt a good image dropped."""
    import threading

    sound, results = (DAMAGED / "sound.jpg").read_bytes(), []

    def run():  # a thread of its own: its own TurboJPEG handle, fresh
        for call in (decode.decode_and_crop_jpeg, decode.decode_window_rows):
            try:
                call((DAMAGED / bad).read_bytes(), WINDOWS[4])  # the whole image: TensorFlow refuses
                results.append("decoded")
            except DataError:
                pass
            try:
                results.append((decode.jpeg_size(sound), decode.decode_and_crop_jpeg(sound, WINDOWS[1])))
            except DataError as e:
                results.append(str(e))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(results) == 2, results
    for result in results:
        assert isinstance(result, tuple), result
        assert result[0] == (64, 64)
        np.testing.assert_array_equal(result[1], PIXELS["sound.jpg/crop1"])
