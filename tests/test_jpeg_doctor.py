"""Row checkpoints and doctored streams (fasttrain.data.jpeg.doctor) against libjpeg-turbo's own decode.

The reference for every window is fasttrain.data.jpeg.decode.decode_and_crop_jpeg of the original JPEG
(libjpeg-turbo's crop decode, which the TF-fixture tests tie to TensorFlow): the doctored stream's
window must equal it bit for bit. The checkpoint walk is checked on its own against two things it does
not compute: the encoder's restart markers (a JPEG with a restart every MCU row must walk each row to
exactly the next marker) and DC predictors recomputed from the encoder's input (libjpeg's integer
forward DCT's DC term of the edge-replicated block, quantised by the file's DQT).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import simplejpeg
import skimage.data
from PIL import Image

from fasttrain.data.jpeg import doctor as jpeg_rows
from fasttrain.data.jpeg.decode import CROP_DECODE, decode_and_crop_jpeg, decode_window_rows
from fasttrain.data.jpeg.scan import COLUMN_GROUP

pytestmark = pytest.mark.skipif(not CROP_DECODE, reason="needs libjpeg-turbo's TurboJPEG library")


def _pil(image, **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "JPEG", **options)
    return buffer.getvalue()


def _exif() -> bytes:
    exif = Image.Exif()
    exif[0x010F] = "fasttrain test camera"
    exif[0x0112] = 6  # orientation: libjpeg (and TensorFlow) ignore it
    return exif.tobytes()


def _cases():
    """(name, jpeg, mcu_h) over photographs, sizes, qualities, sampling and table kinds."""
    astronaut, coffee, chelsea = skimage.data.astronaut(), skimage.data.coffee(), skimage.data.chelsea()
    camera, rocket = skimage.data.camera(), skimage.data.rocket()
    yield "astronaut-420-q90", _pil(astronaut, quality=90, subsampling=2), 16
    yield "coffee-301x217-422-q75-opt", _pil(coffee[:217, :301], quality=75, subsampling=1, optimize=True), 8
    yield "chelsea-444-q95-opt", _pil(chelsea, quality=95, subsampling=0, optimize=True), 8
    yield "camera-gray-301x217-opt", _pil(camera[:217, :301], quality=85, optimize=True), 8
    yield (
        "rocket-333x250-420-q50-opt-exif",
        _pil(rocket[:333, :250], quality=50, optimize=True, exif=_exif()),
        16,
    )
    yield "astronaut-77x100-420-q20-opt", _pil(astronaut[100:177, 50:150], quality=20, optimize=True), 16
    yield "camera-gray-37x41-q10-opt", _pil(camera[:41, :37], quality=10, optimize=True), 8
    yield "coffee-440", simplejpeg.encode_jpeg(coffee[:203, :185], 80, colorsubsampling="440"), 16
    yield "rocket-411", simplejpeg.encode_jpeg(rocket[:150, :299], 80, colorsubsampling="411"), 8
    yield "chelsea-restart-rows-420", _pil(chelsea[:250, :333], quality=85, restart_marker_rows=1), 16
    yield (
        "camera-gray-restart-rows-opt",
        _pil(camera[:99, :201], quality=60, optimize=True, restart_marker_rows=1),
        8,
    )
    # A gray scan with sampling 2x2: the same blocks in the same order, but 16-line MCU rows (libjpeg's
    # iMCU rows of a non-interleaved scan); Pillow writes 1x1, so its SOF is patched.
    gray = _pil(camera[:150, :119], quality=80)
    at = gray.index(b"\xff\xc0") + 11
    assert gray[at] == 0x11
    yield "camera-gray-2x2-sof", gray[:at] + b"\x22" + gray[at + 1 :], 16
    yield "flat-opt", _pil(np.full((90, 70, 3), 77, np.uint8), quality=70, optimize=True), 16


CASES = list(_cases())
# Optimised tables with so few codes (an all-EOB AC table) that a synthetic row may not fit: None.
SPARSE_TABLES = {"camera-gray-37x41-q10-opt", "flat-opt"}


def _vsub(name, mcu_h):
    """Vertically subsampled chroma (4:2:0, 4:4:0): an MCU row's first line reads the row above."""
    return mcu_h == 16 and "gray" not in name


def _windows(height, width, mcu_h):
    tops = {0, 1, mcu_h - 1, mcu_h, mcu_h + 1, mcu_h + mcu_h // 2, 2 * mcu_h - 1, 2 * mcu_h, 2 * mcu_h + 1}
    tops |= {3 * mcu_h, 3 * mcu_h + 5, 8 * mcu_h, 9 * mcu_h + 1}
    tops |= {height // 2, (height - 1) // mcu_h * mcu_h, height - 1}
    for top in sorted(t for t in tops if 0 <= t < height):
        for h in {1, height - top, max((height - top) // 3, 1)}:
            yield top, 0, h, width
            if width > 20:
                yield top, 7, h, width // 2
                yield top, width - 13, h, 13


@pytest.mark.parametrize("name,jpeg,mcu_h", CASES, ids=[c[0] for c in CASES])
def test_doctored_window_equals_crop_decode(name, jpeg, mcu_h):
    checkpoints = jpeg_rows.row_checkpoints(jpeg)
    assert checkpoints is not None
    height, width = simplejpeg.decode_jpeg_header(jpeg)[:2]
    assert checkpoints.shape[0] % -(-height // mcu_h) == 0 and checkpoints.shape[1] == 5
    doctored = 0
    for window in _windows(height, width, mcu_h):
        expected = decode_and_crop_jpeg(jpeg, window)
        np.testing.assert_array_equal(jpeg_rows.decode_and_crop(jpeg, checkpoints, window), expected)
        rows, x = jpeg_rows.decode_window_rows(jpeg, checkpoints, window)
        top, left, h, w = window
        got = rows.reshape(h, -1, 3)[:, left - x : left - x + w]
        np.testing.assert_array_equal(got, expected)
        result = jpeg_rows.doctor(jpeg, checkpoints, window[0])
        # The first row kept is the window's, or the one above it for the chroma context of the row's
        # first line (4:2:0 and 4:4:0: mcu_h 16); a doctored stream needs a row to drop above it.
        first = top // mcu_h - (top % mcu_h == 0 and _vsub(name, mcu_h))
        if first < 1:
            assert result is None
        elif name not in SPARSE_TABLES:
            assert result is not None, window
        doctored += result is not None
    assert doctored > 0 or name in SPARSE_TABLES


@pytest.mark.parametrize("name,jpeg,mcu_h", CASES, ids=[c[0] for c in CASES])
def test_every_top_line_of_the_first_rows(name, jpeg, mcu_h):
    # Every line offset within an MCU row, where the chroma context of the window's first line changes
    # (dropping the row above is right only when the window starts below the row's first line).
    checkpoints = jpeg_rows.row_checkpoints(jpeg)
    height, width = simplejpeg.decode_jpeg_header(jpeg)[:2]
    for top in range(0, min(height, 4 * mcu_h + 1)):
        for window in ((top, 0, min(3, height - top), width), (top, width // 3, height - top, width // 2)):
            expected = decode_and_crop_jpeg(jpeg, window)
            np.testing.assert_array_equal(jpeg_rows.decode_and_crop(jpeg, checkpoints, window), expected)


@pytest.mark.parametrize("name,jpeg,mcu_h", CASES, ids=[c[0] for c in CASES])
def test_random_windows(name, jpeg, mcu_h):
    # Column mode: windows of every position and size (edges in and between checkpoint groups).
    checkpoints = jpeg_rows.row_checkpoints(jpeg)
    height, width = simplejpeg.decode_jpeg_header(jpeg)[:2]
    rng = np.random.default_rng(len(jpeg))
    for _ in range(60):
        h, w = int(rng.integers(1, height + 1)), int(rng.integers(1, width + 1))
        window = (int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w)
        expected = decode_and_crop_jpeg(jpeg, window)
        np.testing.assert_array_equal(jpeg_rows.decode_and_crop(jpeg, checkpoints, window), expected)
        top = window[0]
        if top // mcu_h - (top % mcu_h == 0 and _vsub(name, mcu_h)) >= 1 and name not in SPARSE_TABLES:
            assert jpeg_rows.doctor(jpeg, checkpoints, *window) is not None, window  # a row to drop


def test_doctored_stream_skips_the_rows_above():
    name, jpeg, mcu_h = CASES[0]
    checkpoints = jpeg_rows.row_checkpoints(jpeg)
    stream, new_top = jpeg_rows.doctor(jpeg, checkpoints, 10 * mcu_h + 3)
    assert new_top == mcu_h + 3  # one synthetic MCU row, then the window's
    assert simplejpeg.decode_jpeg_header(bytes(stream))[0] == 512 - 9 * mcu_h
    assert len(stream) < len(jpeg) - 0.1 * len(jpeg)
    rows = len(stream)
    stream, new_top = jpeg_rows.doctor(jpeg, checkpoints, 10 * mcu_h + 3, 200, 100, 60)
    assert new_top == mcu_h + 3 and len(stream) < 0.2 * rows  # only the window's columns and rows
    stream, new_top = jpeg_rows.doctor(jpeg, checkpoints, 0, 200, 100, 60)  # no row above to drop
    assert new_top == 0 and len(stream) < 0.5 * rows


def test_restart_jpegs_drop_columns_too():
    ((name, jpeg, mcu_h),) = [c for c in CASES if c[0] == "chelsea-restart-rows-420"]
    checkpoints = jpeg_rows.row_checkpoints(jpeg)
    rows = len(jpeg_rows.doctor(jpeg, checkpoints, 5 * mcu_h + 3)[0])
    window = (5 * mcu_h + 3, 140, 100, 60)
    stream, new_top = jpeg_rows.doctor(jpeg, checkpoints, *window)
    assert len(stream) < 0.5 * rows
    expected = decode_and_crop_jpeg(jpeg, window)
    np.testing.assert_array_equal(decode_and_crop_jpeg(bytes(stream), (new_top, *window[1:])), expected)


def test_rows_below_the_window_top_are_unchanged_in_the_doctored_stream():
    # The whole doctored image from new row 2 * mcu_h on is the original's rows from r0 * mcu_h on: a
    # full decode, not only the cropped path, sees the same data.
    name, jpeg, mcu_h = CASES[2]
    checkpoints = jpeg_rows.row_checkpoints(jpeg)
    stream, new_top = jpeg_rows.doctor(jpeg, checkpoints, 7 * mcu_h)
    full = simplejpeg.decode_jpeg(jpeg, fastdct=True, fastupsample=False)
    doctored = simplejpeg.decode_jpeg(bytes(stream), fastdct=True, fastupsample=False)
    np.testing.assert_array_equal(doctored[new_top:], full[7 * mcu_h :])


def test_progressive_and_restart_jpegs_fall_back_exactly():
    astronaut = skimage.data.astronaut()[:200, :160]
    for jpeg in (
        _pil(astronaut, quality=80, progressive=True),
        _pil(astronaut, quality=80, restart_marker_blocks=3),
    ):
        assert jpeg_rows.row_checkpoints(jpeg) is None
        window = (50, 9, 100, 77)
        np.testing.assert_array_equal(
            jpeg_rows.decode_and_crop(jpeg, None, window), decode_and_crop_jpeg(jpeg, window)
        )
        rows, x = jpeg_rows.decode_window_rows(jpeg, None, window)
        expected_rows, expected_x = decode_window_rows(jpeg, window)
        assert x == expected_x
        np.testing.assert_array_equal(rows, expected_rows)


def test_checkpoints_outside_the_data_or_out_of_order_are_refused():
    _, jpeg, mcu_h = CASES[0]  # 512 x 512, 4:2:0: 32 MCUs a row, 8 checkpoints
    checkpoints = jpeg_rows.row_checkpoints(jpeg)
    window = (5 * mcu_h + 3, 100, 200, 150)  # MCU rows 5..17, checkpoint groups 1..3 (lines 1 and 4)
    assert jpeg_rows.doctor(jpeg, checkpoints, *window) is not None
    for line in (5 * 8 + 1, 5 * 8 + 4, 9 * 8 + 1, 17 * 8 + 4):
        for position in ((0x7FFF, 0x7FFF), (0, 0), (-1, -1)):
            damaged = checkpoints.copy()
            damaged[line, :2] = position
            assert jpeg_rows.doctor(jpeg, damaged, *window) is None
    # With restart markers (333 x 250, 4:2:0: 21 MCUs a row, 6 checkpoints; groups 1..2, rows 5..11).
    ((_, jpeg, mcu_h),) = [c for c in CASES if c[0] == "chelsea-restart-rows-420"]
    checkpoints = jpeg_rows.row_checkpoints(jpeg)
    window = (5 * mcu_h + 3, 100, 100, 60)
    assert jpeg_rows.doctor(jpeg, checkpoints, *window) is not None
    for line in (5 * 6 + 1, 8 * 6 + 3, 11 * 6 + 3):
        for position in ((0x7FFF, 0x7FFF), (0, 0), (-1, -1)):
            damaged = checkpoints.copy()
            damaged[line, :2] = position
            assert jpeg_rows.doctor(jpeg, damaged, *window) is None


def test_checkpoints_of_other_images_are_refused():
    _, a, _ = CASES[0]
    _, b, _ = CASES[4]
    assert jpeg_rows.doctor(a, jpeg_rows.row_checkpoints(b), 100) is None


def _libjpeg_dc(plane: np.ndarray, q: int) -> np.ndarray:
    """Quantised DC per 8x8 block as libjpeg's compressor computes it (jfdctint.c, jcdctmgr.c): the
    plane edge-replicated to whole blocks (jcsample.c expand_right_edge, jcprepct.c expand_bottom_edge),
    DC = sum(x - 128) (the integer DCT's DC output, scaled by 8), divided by 8 q rounding half away
    from zero (jcdctmgr.c quantize)."""
    h, w = plane.shape
    padded = np.pad(plane.astype(np.int64), ((0, -h % 8), (0, -w % 8)), mode="edge")
    sums = (padded - 128).reshape(padded.shape[0] // 8, 8, -1, 8).sum(axis=(1, 3))
    return np.sign(sums) * ((np.abs(sums) + 4 * q) // (8 * q))


def _dqt0(jpeg: bytes) -> int:
    at = jpeg.index(b"\xff\xdb")
    assert jpeg[at + 4] == 0  # 8-bit table 0
    return jpeg[at + 5]  # its DC entry


def _expected_predictors(dc: np.ndarray) -> np.ndarray:
    """The predictor at each checkpoint (MCU r * mcus + c * COLUMN_GROUP, one block per MCU): the DC of
    the block before it in scan order, 0 at the scan's start."""
    rows, mcus = dc.shape
    groups = -(-mcus // COLUMN_GROUP)
    index = (np.arange(rows)[:, None] * mcus + np.arange(groups)[None, :] * COLUMN_GROUP).ravel()
    return np.concatenate([[0], dc.ravel()])[index]


@pytest.mark.parametrize("quality", [30, 90])
def test_checkpoint_dc_predictors_match_the_encoders_dc(quality):
    # Gray and 4:4:4 luma (one block per MCU and component).
    camera = skimage.data.camera()[:203, :157]
    jpeg = _pil(camera, quality=quality)
    dc = _libjpeg_dc(camera, _dqt0(jpeg))
    np.testing.assert_array_equal(jpeg_rows.row_checkpoints(jpeg)[:, 2], _expected_predictors(dc))
    rgb = skimage.data.coffee()[:101, :203].astype(np.int64)
    # jccolor.c rgb_ycc_convert: Y = (FIX(0.299) R + FIX(0.587) G + FIX(0.114) B + ONE_HALF) >> 16.
    luma = (19595 * rgb[..., 0] + 38470 * rgb[..., 1] + 7471 * rgb[..., 2] + 32768) >> 16
    jpeg = _pil(rgb.astype(np.uint8), quality=quality, subsampling=0)
    dc = _libjpeg_dc(luma, _dqt0(jpeg))
    np.testing.assert_array_equal(jpeg_rows.row_checkpoints(jpeg)[:, 2], _expected_predictors(dc))


def _restart_positions(jpeg: bytes) -> list[int]:
    """The byte after each RST marker: the encoder's own start of every interval."""
    start = jpeg.index(b"\xff\xda")
    start += 2 + int.from_bytes(jpeg[start + 2 : start + 4], "big")
    return [i + 2 for i in range(start, len(jpeg) - 1) if jpeg[i] == 0xFF and 0xD0 <= jpeg[i + 1] <= 0xD7]


@pytest.mark.parametrize("subsampling", [0, 1, 2])
def test_checkpoints_walk_each_row_to_the_encoders_restart_marker(subsampling):
    # With a restart after every MCU row, the walk must end each row exactly at the marker the encoder
    # wrote (a block decoded one bit long or short anywhere in the row misses it), and start the next
    # row right after it, with the predictors at 0.
    rocket = skimage.data.rocket()[:301, :417]
    for optimize in (False, True):
        jpeg = _pil(rocket, quality=75, subsampling=subsampling, optimize=optimize, restart_marker_rows=1)
        mcu_h = 16 if subsampling == 2 else 8
        row_starts = jpeg_rows.row_checkpoints(jpeg).reshape(-(-301 // mcu_h), -1, 5)[:, 0]
        positions = (
            row_starts[:, 0].astype(np.int64) & 0xFFFF | (row_starts[:, 1].astype(np.int64) & 0xFFFF) << 16
        )
        assert list(positions[1:]) == [8 * p for p in _restart_positions(jpeg)]
        assert not row_starts[1:, 2:].any()


def test_corrupt_and_truncated_jpegs_give_none_or_the_same_result():
    _, jpeg, mcu_h = CASES[1]
    height, width = simplejpeg.decode_jpeg_header(jpeg)[:2]
    window = (3 * mcu_h + 1, 5, height - 3 * mcu_h - 1, width - 5)
    rng = np.random.default_rng(0)
    for cut in (0, 2, 3, 100, 400, 700, len(jpeg) // 2, len(jpeg) - 300, len(jpeg) - 2, len(jpeg) - 1):
        assert jpeg_rows.row_checkpoints(jpeg[:cut]) is None
    assert jpeg_rows.row_checkpoints(b"\xff\xd8\xff") is None
    assert jpeg_rows.row_checkpoints(rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()) is None
    for _ in range(60):
        data = bytearray(jpeg)
        for at in rng.integers(0, len(jpeg), 3):
            data[at] = int(rng.integers(0, 256))
        data = bytes(data)
        checkpoints = jpeg_rows.row_checkpoints(data)
        if checkpoints is None:
            continue
        try:
            expected = decode_and_crop_jpeg(data, window)
        except Exception as error:  # noqa: BLE001 - the doctored path must then fail the same way
            with pytest.raises(type(error)):
                jpeg_rows.decode_and_crop(data, checkpoints, window)
        else:
            np.testing.assert_array_equal(jpeg_rows.decode_and_crop(data, checkpoints, window), expected)


def thread_jobs() -> list[tuple]:
    """(jpeg, checkpoints, window): doctored windows of six photos, for the tests of threads at once."""
    jobs = []
    for _, jpeg, mcu_h in CASES[:6]:
        checkpoints = jpeg_rows.row_checkpoints(jpeg)
        height, width = simplejpeg.decode_jpeg_header(jpeg)[:2]
        for top in range(2 * mcu_h, height, 3 * mcu_h + 1):
            jobs.append((jpeg, checkpoints, (top, width // 4, height - top, width // 2)))
    return jobs


def test_threads_use_their_own_buffers():
    # The loader decodes in threads: each thread's doctored stream and TurboJPEG handle are its own.
    from concurrent.futures import ThreadPoolExecutor

    jobs = thread_jobs()
    expected = [decode_and_crop_jpeg(jpeg, window) for jpeg, _, window in jobs]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda job: jpeg_rows.decode_and_crop(*job).copy(), jobs * 3))
    for i, image in enumerate(got):
        np.testing.assert_array_equal(image, expected[i % len(jobs)])


@pytest.mark.parametrize("categories", [(0, 3, 5), (0, 7), (2, 4), (1,), (0, 11)])
def test_dc_plans_sum_to_the_predictor_with_codable_diffs(categories):
    # Optimised tables hold only the categories an image used: the synthetic run's DC diffs must
    # still sum to the wanted change, each with a code, the filler summing to 0.
    from fasttrain.data.jpeg.synth import _dc_plan

    elen = np.zeros((8, 256), np.int64)
    elen[0, list(categories)] = 3
    for n in (1, 2, 5, 6):
        for pred in range(-300, 301, 7):
            diffs = np.zeros((3, 3), np.int64)
            k, m = _dc_plan(elen, 0, n, pred, diffs, 1)
            if k < 0:
                continue
            plan = list(diffs[1, :k]) + [m if i % 2 == 0 else -m for i in range(n - k)]
            assert len(plan) == n and sum(plan) == pred
            assert all(elen[0, int(abs(d)).bit_length()] for d in plan)
    # 5 over 6 blocks: 5 (cat 3); 2 + 3 and two +-2 pairs; 69 - 64; -1024 + 1029; never six +-1s.
    assert (_dc_plan(elen, 0, 6, 5, np.zeros((3, 3), np.int64), 0)[0] > 0) == (categories != (1,))
