"""JPEG decoding as TensorFlow's `decode_jpeg` and `decode_and_crop_jpeg` (channels=3) do it.

TensorFlow decodes with libjpeg-turbo, the fast integer IDCT (JDCT_IFAST) and fancy (smooth) chroma
upsampling, and asks libjpeg for RGB output, which turns 1-component (grayscale) JPEGs into three
equal channels. simplejpeg bundles libjpeg-turbo and exposes exactly those switches (fastdct=True,
fastupsample=False): its output equals TensorFlow's bit for bit on every kind of JPEG the fixture holds
(tests/test_transforms_tf.py). It decodes straight into a caller's buffer, and releases the GIL.

`decode_and_crop_jpeg` (the ResNet seed's train decode) decodes only the crop window, as TensorFlow's
jpeg_mem.cc does: libjpeg's jpeg_crop_scanline from the iMCU column at or left of the window, skipped
rows above it (entropy-decoded only), nothing below it. That costs about 0.8 of a full decode on the
benchmark's photos (bench/bench_input.py's set; a crop covers half the image on average). Chroma at
the window's edges is upsampled as at an image edge, so for 4:2:0 / 4:2:2 JPEGs the window's first or
last column differs from a crop of the full decode; the cropped decode reproduces TensorFlow's pixels
bit for bit (tests/test_transforms_tf.py). The call is libjpeg-turbo 3's TurboJPEG API
(tj3SetCroppingRegion), which no maintained Python binding exposes; the `turbojpeg` wheel bundles the
library (its own pybind module has no cropping), and fasttrain calls that library through ctypes
(ctypes drops the GIL during the call). Where the wheel is absent (it exists for x86-64 Linux, which
setup.py requires it on, and for macOS and Windows) the window is cut from the full decode instead:
the same pixels but for that edge column (`CROP_DECODE` says which path runs).
`decode_window_rows` is the same decode for a consumer that reads the pixels at once (the vgg fast
path and the resnet train transform): into one buffer per thread, reused (no allocation per image),
handed over in place (no copy of the window), with one TurboJPEG handle per thread; the decode call
releases the GIL, so threads decode in parallel. The JPEG may be bytes or a buffer (a loader passes a
view into its record buffer). Only the decode itself releases the GIL: the header and settings calls
(microseconds) go through a PyDLL, which keeps it, so a thread does not hand the GIL over and wait for
it back several times an image.

CMYK JPEGs (which build_imagenet_data converts away, so ImageNet shards hold none) are decoded to CMYK
and converted as TensorFlow's jpeg_mem.cc does, by libjpeg's saw_Adobe_marker (`saw_adobe_marker`):
after an Adobe APP14 marker the data is inverted CMYK, channel = c * k / 255; without one it is plain
CMYK, channel = (255 - c) * (255 - k) / 255 (integer division both ways; tests/test_transforms_tf.py).

Damaged files decode where TensorFlow's do, to its pixels (tests/test_jpeg_damaged.py, against what
TensorFlow 2.21 made of each file of tests/data/tf-build/damaged/). libjpeg's warnings, corrupt data it
steps over ("Corrupt JPEG data: premature end of data segment", "... extraneous bytes before marker"),
fail no TensorFlow decode, so they fail none here (`_tolerated`); what fails TensorFlow's is running
out of data: its source manager refuses to read past the end, where libjpeg-turbo's pads the data with
an end marker and warns "Premature end of JPEG file". So a warning is tolerated only in a file whose
end marker libjpeg reaches (`reaches_end_marker`, the walk TensorFlow's reads take); the cropped
decode, like TensorFlow's, reads no further than its window's last row, so a window above the point
where a file is cut decodes in both. The check runs only after a warning: a sound file costs nothing
more. Refused here though TensorFlow decodes them: a warning in a file cut or holding an illegal marker
anywhere (TensorFlow's crop stops above it), a warning in a JPEG of sampling factors TurboJPEG cannot
crop, and what only TensorFlow 2 reads under decode_jpeg (a PNG); each stops training with one line
naming the record (or is skipped with skip_corrupt). Decoded here though TensorFlow refuses it: on the
Inception seed's train path, which decodes only its crop
(fasttrain.data.jpeg.doctor.decode_full_window_rows) where TensorFlow decodes the whole file, a file
cut below the crop (the rows above a cut decode as in the intact file).
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from pathlib import Path

import numpy as np
import simplejpeg

from fasttrain.data.errors import DataError


def undecodable(file, offset, error) -> DataError:
    return DataError(
        f"undecodable JPEG in record at offset {offset} in {file} ({error}); re-create the shard "
        "or train with skip_corrupt",
        settings=("skip_corrupt",),
    )


def decode_jpeg(jpeg: bytes, file="", offset: int = 0) -> np.ndarray:
    """(H, W, 3) uint8 RGB, TensorFlow's decode_jpeg(channels=3) pixels."""
    try:
        _, _, colorspace, _ = simplejpeg.decode_jpeg_header(jpeg)
        cmyk = colorspace in ("CMYK", "YCCK")
        try:  # strict: a warning raises, so a sound file is decoded once and checked no further
            return _simplejpeg_decode(jpeg, cmyk, strict=True)
        except ValueError as e:
            if not _tolerated(str(e), jpeg):
                raise
            return _simplejpeg_decode(jpeg, cmyk, strict=False)
    except (ValueError, TypeError) as e:
        raise undecodable(file, offset, e) from None


def _simplejpeg_decode(jpeg, cmyk: bool, strict: bool) -> np.ndarray:
    if cmyk:
        out = simplejpeg.decode_jpeg(jpeg, colorspace="CMYK", fastdct=True, strict=strict)
        return cmyk_to_rgb(out, jpeg)
    return simplejpeg.decode_jpeg(jpeg, colorspace="RGB", fastdct=True, fastupsample=False, strict=strict)


# The start of each of libjpeg's warnings (jerror.h, JWRN_*) but JWRN_JPEG_EOF ("Premature end of JPEG
# file", the data ran out) and JWRN_TOO_MUCH_DATA (a caller's mistake): corrupt data libjpeg steps over,
# which fails no TensorFlow decode. libjpeg's errors (JERR_*) start otherwise.
_WARNINGS = (
    "Corrupt JPEG data",
    "Warning: unknown JFIF revision",
    "Unknown Adobe color transform",
    "Inconsistent progression sequence",
    "Invalid SOS parameters for sequential JPEG",
)


def _tolerated(message: str, jpeg) -> bool:
    """Whether a decode whose last message was `message` gives TensorFlow's decode of `jpeg`: a warning
    of corrupt data, in a file whose end marker libjpeg reaches (so the data never ran out)."""
    return message.startswith(_WARNINGS) and reaches_end_marker(jpeg if type(jpeg) is bytes else bytes(jpeg))


def reaches_end_marker(data: bytes) -> bool:
    """Whether libjpeg, reading the file's markers in order, meets the end-of-image marker (EOI, FF D9)
    before the data ends, so TensorFlow's decode never asks for bytes past the end.

    After SOI each marker is found as libjpeg's next_marker finds it: the first FF (any number of them)
    followed by a byte that is not 00 (a stuffed data byte) or D0-D7 (a restart marker); a marker with
    a length field is skipped by its length, so entropy-coded data after SOS is passed over in the
    search for the marker that ends it. 40 times cheaper than the decode (0.02 ms for a 45 kB photo).
    """
    n, pos, find = len(data), 2, data.find
    while True:
        at = find(b"\xff", pos)
        while 0 <= at < n - 1:
            byte = data[at + 1]
            if byte not in (0x00, 0xFF) and not 0xD0 <= byte <= 0xD7:
                break
            at = find(b"\xff", at + 1)
        else:
            return False
        marker, pos = data[at + 1], at + 2
        if marker == 0xD9:
            return True
        if marker in (0x01, 0xD8):  # TEM, a stray SOI: no length field
            continue
        if pos + 2 > n:
            return False
        length = (data[pos] << 8) | data[pos + 1]
        if length < 2 or pos + length > n:
            return False
        pos += length


def jpeg_size(jpeg: bytes, file="", offset: int = 0) -> tuple[int, int]:
    """(height, width) from the JPEG's header, without decoding it. Through TurboJPEG's PyDLL view
    where the library is at hand, which keeps the GIL over the call (a microsecond): simplejpeg's
    header read drops it, and a loader thread would hand the GIL to another and wait to take it back
    once more per image."""
    try:
        if _turbo is not None:
            return _turbo.size(jpeg)
        height, width, _, _ = simplejpeg.decode_jpeg_header(jpeg)
    except (ValueError, TypeError) as e:
        raise undecodable(file, offset, e) from None
    return height, width


def decode_and_crop_jpeg(jpeg: bytes, window, file="", offset: int = 0) -> np.ndarray:
    """(h, w, 3) uint8 RGB view: TensorFlow's decode_and_crop_jpeg(window=(top, left, h, w), channels=3)."""
    top, left, h, w = window
    if _turbo is None:
        return decode_jpeg(jpeg, file, offset)[top : top + h, left : left + w]
    try:
        return _turbo.decode_window(jpeg, top, left, h, w)
    except ValueError as e:
        raise undecodable(file, offset, e) from None


def decode_window_rows(jpeg: bytes, window, file="", offset: int = 0) -> tuple[np.ndarray, int]:
    """(rows, x): decode_and_crop_jpeg's pixels without a copy, for a consumer that reads them at once.
    rows is (h, n * 3) uint8 whose row i holds the window's row i from image column x <= left on (at
    least to column left + w - 1); it may be this thread's reused decode buffer, overwritten by the
    thread's next call."""
    top, left, h, w = window
    if _turbo is None:
        image = decode_jpeg(jpeg, file, offset)
        return image.reshape(image.shape[0], -1)[top : top + h], 0
    try:
        return _turbo.decode_rows(jpeg, top, left, h, w)
    except ValueError as e:
        raise undecodable(file, offset, e) from None


def cmyk_to_rgb(cmyk: np.ndarray, jpeg) -> np.ndarray:
    """(..., 3) uint8 RGB from libjpeg's (..., 4) CMYK output of `jpeg`, as jpeg_mem.cc converts it."""
    c, k = cmyk[..., :3].astype(np.uint16), cmyk[..., 3:4].astype(np.uint16)
    if not saw_adobe_marker(jpeg if type(jpeg) is bytes else bytes(jpeg)):
        c, k = 255 - c, 255 - k  # plain CMYK: libjpeg inverts only Adobe's
    return (c * k // 255).astype(np.uint8)


def saw_adobe_marker(data: bytes) -> bool:
    """libjpeg's cinfo.saw_Adobe_marker: an APP14 segment of at least 12 bytes starting 'Adobe',
    before the first scan."""
    n, pos = len(data), 2
    while pos + 4 <= n and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0xDA:  # start of scan: the header is over
            return False
        length = (data[pos + 2] << 8) | data[pos + 3]
        if marker == 0xEE and length - 2 >= 12 and data[pos + 4 : pos + 9] == b"Adobe":
            return True
        pos += 2 + length
    return False


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


class _TurboJPEG:
    """The few TurboJPEG 3 calls a cropped decode needs (turbojpeg.h, libjpeg-turbo >= 3.0)."""

    # Enumerations from turbojpeg.h.
    INIT_DECOMPRESS = 1
    SUBSAMP, JPEGWIDTH, JPEGHEIGHT, COLORSPACE, FASTUPSAMPLE, FASTDCT = 4, 5, 6, 8, 9, 10
    CS_CMYK, CS_YCCK = 3, 4
    PF_RGB, PF_CMYK = 0, 11
    # tjMCUWidth by TJSAMP_444, 422, 420, GRAY, 440, 411, 441: a cropping region starts on a multiple.
    MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)

    def __init__(self, path: Path):
        # Two views of one library: CDLL drops the GIL over a call, which suits the decode (a
        # millisecond); PyDLL keeps it, which suits the calls of a few microseconds or less (header,
        # settings), where handing the GIL to another thread and taking it back (futex wake-ups,
        # context switches) costs more than the call.
        lib, quick = ctypes.CDLL(str(path)), ctypes.PyDLL(str(path))
        c_void_p, c_int, c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        quick.tj3Init.restype, quick.tj3Init.argtypes = c_void_p, [c_int]
        quick.tj3Set.argtypes = [c_void_p, c_int, c_int]
        quick.tj3Get.argtypes = [c_void_p, c_int]
        quick.tj3DecompressHeader.argtypes = [c_void_p, c_void_p, c_size_t]
        quick.tj3SetCroppingRegion.argtypes = [c_void_p, _Region]
        quick.tj3GetErrorStr.restype, quick.tj3GetErrorStr.argtypes = ctypes.c_char_p, [c_void_p]
        quick.tj3Destroy.argtypes = [c_void_p]
        lib.tj3Decompress8.argtypes = [c_void_p, c_void_p, c_size_t, c_void_p, c_int, c_int]
        self.lib, self.quick = lib, quick
        self.get, self.decompress = quick.tj3Get, lib.tj3Decompress8
        self.local = threading.local()  # a TurboJPEG handle is not thread-safe: one per thread

    def _handle(self):
        owner = getattr(self.local, "handle", None)
        if owner is None:
            owner = self.local.handle = _Handle(self.quick)
            self.quick.tj3Set(owner.value, self.FASTDCT, 1)  # TensorFlow's JDCT_IFAST
            self.quick.tj3Set(owner.value, self.FASTUPSAMPLE, 0)  # and its fancy upsampling
        return owner.value

    def _check(self, handle, status: int, jpeg, tolerate: bool = True) -> None:
        # TurboJPEG returns -1 after a warning too (the decode went on to the end); its error code
        # cannot tell a warning from an error that followed one, so the message decides (the last
        # one: an error ends the decode).
        if status != 0:
            message = self.quick.tj3GetErrorStr(handle).decode(errors="replace")
            if not (tolerate and _tolerated(message, jpeg)):
                self._fail(handle, message)

    def _fail(self, handle, message: str):
        """Raise ValueError(message), with a fresh handle for this thread's next image: after an error
        TurboJPEG's decompressor can be left inside a header, and the next header read on it then
        returns 0 without reading (jpeg_read_header's answer for a tables-only stream) and no size, so
        a good image would be reported undecodable."""
        self.local.handle = None  # its _Handle destroys it
        raise ValueError(message)

    def _header(self, handle, jpeg, data) -> tuple[int, int]:
        """(width, height) of the JPEG's frame, read into the handle."""
        self._check(handle, self.quick.tj3DecompressHeader(handle, data, len(jpeg)), jpeg)
        width, height = self.get(handle, self.JPEGWIDTH), self.get(handle, self.JPEGHEIGHT)
        if width <= 0 or height <= 0:  # a tables-only stream: no frame
            self._fail(handle, "no image in the JPEG (its header holds tables only)")
        return width, height

    def size(self, jpeg) -> tuple[int, int]:
        """(height, width) from the header."""
        width, height = self._header(self._handle(), jpeg, _address(jpeg))
        return height, width

    def decode_window(self, jpeg: bytes, top: int, left: int, h: int, w: int) -> np.ndarray:
        out, x, channels = self._decode(jpeg, top, left, h, w, None)
        out = out.reshape(out.shape[0], -1, channels)[:, left - x : left - x + w]
        return cmyk_to_rgb(out, jpeg) if channels == 4 else out

    def decode_rows(self, jpeg: bytes, top: int, left: int, h: int, w: int) -> tuple[np.ndarray, int]:
        """(rows, x): rows (h, span * 3) uint8, the window's rows from column x <= left on, decoded into
        this thread's reused buffer (valid until the thread's next call)."""
        out, x, channels = self._decode(jpeg, top, left, h, w, self.local)
        if channels == 4:
            out = np.ascontiguousarray(cmyk_to_rgb(out.reshape(out.shape[0], -1, 4), jpeg))
            out = out.reshape(out.shape[0], -1)
        return out, x

    def buffer(self, size: int) -> tuple[np.ndarray, int]:
        """(array, address): this thread's decode buffer, at least `size` bytes, grown to the largest
        region seen (at least 1 MiB): no allocation per image. Valid until the thread's next call."""
        reuse = self.local
        out = getattr(reuse, "buffer", None)
        if out is None or out.size < size:
            out = reuse.buffer = np.empty(max(size, 1 << 20), np.uint8)
            reuse.address = out.ctypes.data  # (.ctypes builds an object: 10% of the GIL-held time)
        return out, reuse.address

    def _decode(self, jpeg: bytes, top: int, left: int, h: int, w: int, reuse) -> tuple[np.ndarray, int, int]:
        """(out (h, span * channels) uint8, x, channels): rows top .. top + h - 1 from column x on."""
        get, handle, data, size = self.get, self._handle(), _address(jpeg), len(jpeg)
        width, height = self._header(handle, jpeg, data)
        if not (0 <= top and 0 <= left and 0 < h and 0 < w and top + h <= height and left + w <= width):
            raise ValueError(f"crop window {(top, left, h, w)} outside the {height}x{width} image")
        subsamp = get(handle, self.SUBSAMP)
        cmyk = get(handle, self.COLORSPACE) in (self.CS_CMYK, self.CS_YCCK)
        channels, pixel_format = (4, self.PF_CMYK) if cmyk else (3, self.PF_RGB)
        if 0 <= subsamp < len(self.MCU_WIDTH):
            x = left - left % self.MCU_WIDTH[subsamp]
            region, skip, span = _Region(x, top, w + left - x, h), 0, w + left - x
        else:  # an unusual sampling layout (TJSAMP_UNKNOWN) cannot be cropped: decode it whole
            x, region, skip, span = 0, _Region(0, 0, 0, 0), top, width
        self._check(handle, self.quick.tj3SetCroppingRegion(handle, region), jpeg, tolerate=False)
        rows, pitch = region.h or height, span * channels
        if reuse is None:
            out = np.empty(rows * pitch, np.uint8)
            address = out.ctypes.data
        else:
            out, address = self.buffer(rows * pitch)
        status = self.decompress(handle, data, size, address, pitch, pixel_format)
        # Not with sampling factors TurboJPEG cannot crop: decoded whole, such a file's window is not
        # TensorFlow's cropped decode at its edges, and a damaged one is refused rather than guessed.
        self._check(handle, status, jpeg, tolerate=0 <= subsamp < len(self.MCU_WIDTH))
        return out[: rows * pitch].reshape(rows, pitch)[skip : skip + h], x, channels


class _Handle:
    """A TurboJPEG decompressor, destroyed with its owner: the thread's threading.local, which the
    thread's end clears. Loader threads are made anew each epoch, and a decompressor left undestroyed
    stays allocated to the end of the run: small (RSS grew 8.0 MB over 1,200 threads that each decoded
    a 1201 x 901 JPEG, against 6.1 MB with this), but nothing is kept that is not used."""

    def __init__(self, quick):
        self.quick, self.value = quick, quick.tj3Init(_TurboJPEG.INIT_DECOMPRESS)
        if not self.value:
            raise MemoryError("tj3Init failed")

    def __del__(self):
        if self.value:
            self.quick.tj3Destroy(self.value)
            self.value = None


def _address(jpeg):
    """The JPEG as ctypes passes it (c_void_p): bytes as they are, another buffer (a view into a
    loader's record buffer) by its address, which stays valid while the caller holds `jpeg`."""
    if type(jpeg) is bytes:
        return jpeg
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(jpeg))  # writable buffers: the quick way
    except (TypeError, ValueError):  # read-only or empty
        return np.frombuffer(jpeg, np.uint8).ctypes.data


def _load_turbojpeg() -> _TurboJPEG | None:
    """The library the `turbojpeg` wheel bundles, or None where it is absent or lacks the TJ3 calls."""
    try:
        spec = importlib.util.find_spec("turbojpeg")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    libs = sorted((Path(spec.origin).parent / "turbojpeg.libs").glob("libturbojpeg*.so*"))
    if not libs:
        return None
    try:
        return _TurboJPEG(libs[0])
    except (OSError, AttributeError):  # not loadable here, or an older library without tj3 calls
        return None


_turbo = _load_turbojpeg()
CROP_DECODE = _turbo is not None
