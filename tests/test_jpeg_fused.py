"""The ResNet train transform's decode and resize in one call (fasttrain/data/jpeg/fused.py), the vgg
window's, and what turns the fused calls off. (The Inception transform's: test_jpeg_fused_inception.py.)

References: TensorFlow's own train images (the committed fixture, tests/data/tf-images), TensorFlow's
verdicts and pixels on damaged files (tests/data/tf-build/damaged), and the calls the fused one
replaces (the doctored or cropped decode, then the resize), which those fixtures tie to TensorFlow:
the fused call must equal them bit for bit, and must leave to them whatever it does not do.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import simplejpeg
import skimage.data
from test_jpeg_damaged import CROPS, DAMAGED, PIXELS, REFUSED, WINDOWS
from test_jpeg_doctor import CASES as PHOTOS
from test_jpeg_doctor import _windows, thread_jobs
from test_transforms_tf import CASES, FIXTURE, QUANTISATION, _levels, reference  # noqa: F401

from fasttrain.data import transforms
from fasttrain.data.jpeg import decode, doctor, fused
from fasttrain.data.transforms import _resnet_train, train_transform

pytestmark = pytest.mark.skipif(not fused.FUSED, reason="needs libjpeg-turbo's TurboJPEG library")


def _usual(jpeg, checkpoints, window, flip, size):
    """What the transform computed before: the window's rows (doctored or cropped decode), the resize."""
    rows, x = doctor.decode_window_rows(jpeg, checkpoints, window)
    _, left, h, w = window
    return _resnet_train(rows.reshape(h, -1, 3)[:, left - x : left - x + w], flip, size, None, None)


def _fused(jpeg, checkpoints, window, flip, size):
    out = np.full((size, size, 3), 7, np.uint8)
    assert fused.crop_resize(jpeg, checkpoints, window, flip, out), window
    return out


def _in_a_thread(function):
    """function() on a thread of its own: fresh buffers and a fresh TurboJPEG handle."""
    result = []
    thread = threading.Thread(target=lambda: result.append(function()))
    thread.start()
    thread.join()
    assert result, "the thread raised"
    return result[0]


@pytest.mark.parametrize(
    "case", [c for c in CASES["train"] if c["preprocess"] == "resnet"], ids=lambda c: c["key"]
)
def test_resnet_train_images_are_tensorflows(case, reference):  # noqa: F811 (the fixture)
    jpeg = (FIXTURE / case["file"]).read_bytes()
    ours = _fused(jpeg, doctor.row_checkpoints(jpeg), tuple(case["window"]), case["flip"], case["image_size"])
    mean, worst = _levels(ours, np.clip(reference[case["key"]], 0, 255))
    assert mean < 0.3, mean
    assert worst <= QUANTISATION, worst


@pytest.mark.parametrize("name,jpeg,mcu_h", PHOTOS, ids=[c[0] for c in PHOTOS])
def test_equals_the_decode_and_resize_it_replaces(name, jpeg, mcu_h):
    """Every sampling, restart layout and table kind of the doctor's tests, with and without row
    checkpoints, both flips: the same bytes as the separate calls."""
    checkpoints = doctor.row_checkpoints(jpeg)
    height, width = simplejpeg.decode_jpeg_header(jpeg)[:2]
    rng = np.random.default_rng(len(jpeg))
    windows = list(_windows(height, width, mcu_h))
    for _ in range(20):
        h, w = int(rng.integers(1, height + 1)), int(rng.integers(1, width + 1))
        windows.append((int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w))
    for i, window in enumerate(windows):
        flip, size = bool(i % 2), (24, 56)[i % 3 == 0]
        for cp in (checkpoints, None):
            np.testing.assert_array_equal(
                _fused(jpeg, cp, window, flip, size), _usual(jpeg, cp, window, flip, size), str(window)
            )


def test_train_transform_goes_through_the_fused_call(monkeypatch):
    jpeg = (FIXTURE / "astronaut_q90.jpg").read_bytes()
    boxes = np.zeros((0, 4), np.float32)
    expected = [train_transform(jpeg, boxes, np.random.default_rng(s), 64) for s in range(6)]

    def refused(*args, **kwargs):
        raise AssertionError("the separate decode ran")

    monkeypatch.setattr(transforms, "decode_window_rows", refused)
    for seed in range(6):
        got = train_transform(jpeg, boxes, np.random.default_rng(seed), 64)
        np.testing.assert_array_equal(got, expected[seed])
    # CMYK is the usual path's (its conversion): the fused call hands it back and writes nothing.
    cmyk = (FIXTURE / "coffee_cmyk.jpg").read_bytes()
    out = np.full((64, 64, 3), 7, np.uint8)
    assert not fused.crop_resize(cmyk, None, (5, 9, 40, 50), False, out)
    assert (out == 7).all()
    with pytest.raises(AssertionError, match="the separate decode ran"):
        train_transform(cmyk, boxes, np.random.default_rng(0), 64)


@pytest.mark.parametrize("name", sorted(CROPS["decodes"]))
def test_damaged_files_decode_as_tensorflow_or_go_to_the_usual_path(name):
    """Where TensorFlow refuses a window the fused call must hand the image back (the usual path then
    refuses it with its message, tests/test_jpeg_damaged.py); where it returns an image, that image is
    TensorFlow's window resized."""
    jpeg = (DAMAGED / name).read_bytes()
    refused = REFUSED.get((name, "crop"), [])
    done = 0
    for i, window in enumerate(WINDOWS):
        out = np.full((32, 32, 3), 7, np.uint8)
        flip = i % 2 == 1
        if _in_a_thread(lambda w=window, o=out, f=flip: fused.crop_resize(jpeg, None, w, f, o)):
            assert CROPS["decodes"][name][i] and i not in refused, window
            expected = _resnet_train(PIXELS[f"{name}/crop{i}"], flip, 32, None, None)
            np.testing.assert_array_equal(out, expected, str(window))
            done += 1
        else:
            assert (out == 7).all()
    if name == "sound.jpg":
        assert done == len(WINDOWS)


@pytest.mark.parametrize("bad", [n for n in sorted(CROPS["decodes"]) if not all(CROPS["decodes"][n])])
def test_a_sound_image_after_a_refused_one_on_the_same_thread(bad):
    """A failed TurboJPEG call may leave the thread's decompressor inside a header: the next image,
    sound, must still decode, through the fused call and the usual ones."""
    sound = (DAMAGED / "sound.jpg").read_bytes()
    window = WINDOWS[1]

    def run():
        jpeg, out = (DAMAGED / bad).read_bytes(), np.empty((8, 8, 3), np.uint8)
        for w in WINDOWS:
            fused.crop_resize(jpeg, None, w, False, out)
        return decode.jpeg_size(sound), _fused(sound, None, window, False, 16)

    size, out = _in_a_thread(run)
    assert size == (64, 64)
    np.testing.assert_array_equal(out, _resnet_train(PIXELS[f"sound.jpg/crop{1}"], False, 16, None, None))


def test_the_buffers_grow_for_large_images():
    """A fresh thread's buffers (1 MiB decode, 256 KiB doctored stream) are too small for a 1500 x 1200
    window of a high-quality JPEG: both grow, and the image is the same."""
    photo = np.tile(skimage.data.astronaut(), (3, 3, 1))[:1500, :1300]
    jpeg = simplejpeg.encode_jpeg(photo, quality=98, colorsubsampling="444")
    checkpoints = doctor.row_checkpoints(jpeg)
    window = (40, 60, 1450, 1200)
    stream = doctor.doctor(jpeg, checkpoints, *window)[0]
    assert stream.size > 1 << 18 and 1450 * 1208 * 3 > 1 << 20  # both past the fresh sizes
    expected = _usual(jpeg, checkpoints, window, True, 40)
    np.testing.assert_array_equal(_in_a_thread(lambda: _fused(jpeg, checkpoints, window, True, 40)), expected)


def test_threads_use_their_own_buffers():
    jobs = [(jpeg, cp, window, window[0] % 2 == 0, 24) for jpeg, cp, window in thread_jobs()]
    expected = [_usual(*job) for job in jobs]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda job: _fused(*job), jobs * 3))
    for i, image in enumerate(got):
        np.testing.assert_array_equal(image, expected[i % len(jobs)])


def test_the_vgg_window_goes_through_the_fused_call(monkeypatch):
    """The ResNet seed's vgg transform (fasttrain.data.vgg: train and eval) through the fused call, with
    and without row checkpoints: the seed's steps on the whole decode, rounded in NumPy (what
    tests/test_vgg_preprocessing.py ties to TensorFlow's images)."""
    from test_vgg_preprocessing import CASES as VGG_CASES
    from test_vgg_preprocessing import _jpeg, _params, _rounded

    from fasttrain.data import vgg

    expected = {
        case["key"]: _rounded(
            vgg.full_float(decode.decode_jpeg(_jpeg(case)), _params(case), case["image_size"])
        )
        for case in VGG_CASES
    }

    def refused(*args, **kwargs):
        raise AssertionError("the separate decode ran")

    monkeypatch.setattr(vgg, "decode_window_rows", refused)
    for case in VGG_CASES:
        data, size = _jpeg(case), case["image_size"]
        if case["file"] == "coffee_cmyk.jpg":  # the usual path's: see above
            continue
        for checkpoints in (None, doctor.row_checkpoints(data)):
            out = np.full((size, size, 3), 7, np.uint8)
            vgg._window(
                data,
                decode.jpeg_size(data),
                _params(case),
                size,
                out.reshape(size, -1),
                vgg._NO_FLOATS,
                "",
                0,
                checkpoints,
            )
            np.testing.assert_array_equal(out, expected[case["key"]], case["key"])


def test_without_the_library_the_usual_path_runs(monkeypatch):
    """Where TurboJPEG's library is absent (decode._turbo None) the fused call declines, and the
    transform cuts its window from the full decode (decode.py)."""
    jpeg = (FIXTURE / "astronaut_q90.jpg").read_bytes()
    monkeypatch.setattr(decode, "_turbo", None)
    assert not fused.crop_resize(jpeg, None, (5, 9, 40, 50), False, np.empty((8, 8, 3), np.uint8))
    image = train_transform(jpeg, np.zeros((0, 4), np.float32), np.random.default_rng(0), 32)
    assert image.shape == (32, 32, 3) and image.std() > 0


@pytest.mark.parametrize("entry", ["warm-up", "first image"])
@pytest.mark.parametrize("fault", ["gave other pixels", "declined"])
def test_a_machine_where_the_fused_call_is_wrong_trains_on_the_separate_calls(
    fault, entry, monkeypatch, capsys
):
    """The loaders' warm-up (or, in a process that skipped it, the first image) checks the fused call
    against the separate ones (fused.check): where it differs (as a wrong guess of how the machine
    passes TurboJPEG its cropping region would make it) or declines a sound JPEG, the fused calls are
    turned off with one line, and the images are the separate calls'."""
    assert fused.check() == "" and fused.FUSED
    jpeg = (FIXTURE / "astronaut_q90.jpg").read_bytes()
    boxes = np.zeros((0, 4), np.float32)
    expected = train_transform(jpeg, boxes, np.random.default_rng(3), 40)
    resnet = fused._resnet

    def faulty(*args):
        if fault == "declined":
            return fused.USUAL, 0, False
        result = resnet(*args)
        args[-1][0, 0] ^= 1  # one level of one pixel
        return result

    monkeypatch.setattr(fused, "FUSED", True)  # restored after the test
    monkeypatch.setattr(fused, "_resnet", faulty)
    monkeypatch.setattr(fused, "_problem", [])  # this process has not checked yet
    if entry == "warm-up":
        fused.warm_up()
    got = train_transform(jpeg, boxes, np.random.default_rng(3), 40)
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and f"the fused decode {fault}" in line and "separate calls" in line
    assert not fused.FUSED
    np.testing.assert_array_equal(got, expected)
    fused.warm_up()  # checked once per process: no second line
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("fault", [None, "resnet", "inception"])
def test_selfchecks_row(fault, monkeypatch):
    """`fasttrain selfcheck`'s fused-decode row: the three transforms through the fused calls against
    the separate ones. A fused ResNet call that gives other pixels fails the row with the loaders' own
    check's reason; a wrong Inception kernel, which that check does not run, fails it too."""
    from fasttrain.selfcheck.data_checks import check_fused_decode

    monkeypatch.setattr(fused, "FUSED", True)  # restored after the test
    if fault is None:
        assert "24 in all" in check_fused_decode(None) and fused.FUSED
        return
    name = "_resnet" if fault == "resnet" else "_inception"
    kernel = getattr(fused, name)

    def faulty(*args):
        result = kernel(*args)
        args[-2 if fault == "inception" else -1][0, 0] ^= 1  # one pixel of the uint8 image
        return result

    monkeypatch.setattr(fused, name, faulty)
    reason = "the fused decode gave other pixels" if fault == "resnet" else "inception train image"
    with pytest.raises(AssertionError, match=reason):
        check_fused_decode(None)
    assert fused.FUSED is (fault == "inception")  # the loaders' own check turned it off, or passed


@pytest.mark.parametrize("preprocess", ["resnet", "vgg", "inception"])
def test_the_fused_decode_flag(synthetic, monkeypatch, preprocess):
    """--fused_decode=false: the loader's images through the separate calls, the same batches; the
    fused calls made the default's images (counted)."""
    from test_thread_loader import _cfg, _epoch, _same

    from fasttrain.data.thread_loader import ThreadLoader

    monkeypatch.setattr(fused, "FUSED", True)  # restored after the test
    execute, taken = fused._execute, []

    def counted(*args):
        taken.append(execute(*args))
        return taken[-1]

    monkeypatch.setattr(fused, "_execute", counted)
    default = _epoch(ThreadLoader(_cfg(synthetic, preprocess=preprocess), "train", True), 1)
    assert taken and all(taken) and fused.FUSED
    count = len(taken)
    separate = ThreadLoader(_cfg(synthetic, preprocess=preprocess, fused_decode=False), "train", True)
    _same(_epoch(separate, 1), default)
    assert not fused.FUSED and len(taken) == count


def test_the_separate_calls_compile_one_doctor():
    """The separate calls' doctored stream runs on the kernel the warm-up compiled whatever it is given:
    bytes or a writable record buffer, sidecar (read-only) or built checkpoints. Before, a loader with
    --fused_decode=false compiled _doctor again on its first image (27 s here, longer than the GPU run's
    20 s for its loader-alone run): its record buffers are writable, the warm-up's bytes are not."""
    jpeg, (_, checkpoints) = fused.warm_up_inputs()
    writable = np.frombuffer(bytearray(jpeg), np.uint8)
    assert writable.flags.writeable and checkpoints.flags.writeable
    for data, cp in ((jpeg, checkpoints), (memoryview(writable), checkpoints.copy())):
        rows, x = doctor.decode_window_rows(data, cp, (17, 19, 29, 15))
        assert rows.shape[0] == 29
    signatures = doctor._doctor.signatures
    assert signatures and all(not sig[0].mutable and not sig[1].mutable for sig in signatures), signatures


def test_the_warm_up_compiles_the_separate_calls_when_fused_is_off(monkeypatch):
    """With the fused calls off, the warm-up makes the separate calls' doctored decode once, so the
    loaders' threads do not compile it on their first images."""
    monkeypatch.setattr(fused, "FUSED", False)  # restored after the test
    made, separate = [], fused.decode_window_rows

    def counted(jpeg, checkpoints, window, *rest):
        made.append(checkpoints is not None)
        return separate(jpeg, checkpoints, window, *rest)

    monkeypatch.setattr(fused, "decode_window_rows", counted)
    fused.warm_up()
    assert made == [True]
