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
and converted as TensorFlow's jpeg_mem.cc does for Adobe (inverted) CMYK: channel = c * k / 255.
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
        if colorspace in ("CMYK", "YCCK"):
            return _cmyk_to_rgb(simplejpeg.decode_jpeg(jpeg, colorspace="CMYK", fastdct=True))
        return simplejpeg.decode_jpeg(jpeg, colorspace="RGB", fastdct=True, fastupsample=False)
    except (ValueError, TypeError) as e:
        raise undecodable(file, offset, e) from None


def jpeg_size(jpeg: bytes, file="", offset: int = 0) -> tuple[int, int]:
    """(height, width) from the JPEG's header, without decoding it."""
    try:
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


def _cmyk_to_rgb(cmyk: np.ndarray) -> np.ndarray:
    k = cmyk[..., 3:4].astype(np.uint16)
    return (cmyk[..., :3].astype(np.uint16) * k // 255).astype(np.uint8)


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
        lib.tj3Decompress8.argtypes = [c_void_p, c_void_p, c_size_t, c_void_p, c_int, c_int]
        self.lib, self.quick = lib, quick
        self.get, self.decompress = quick.tj3Get, lib.tj3Decompress8
        self.local = threading.local()  # a TurboJPEG handle is not thread-safe: one per thread

    def _handle(self):
        handle = getattr(self.local, "handle", None)
        if handle is None:
            handle = self.quick.tj3Init(self.INIT_DECOMPRESS)
            if not handle:
                raise MemoryError("tj3Init failed")
            self.quick.tj3Set(handle, self.FASTDCT, 1)  # TensorFlow's JDCT_IFAST
            self.quick.tj3Set(handle, self.FASTUPSAMPLE, 0)  # and its fancy upsampling
            self.local.handle = handle
        return handle

    def _check(self, handle, status: int) -> None:
        # Warnings (corrupt data libjpeg can step over) fail too, as simplejpeg's strict mode does.
        if status != 0:
            raise ValueError(self.quick.tj3GetErrorStr(handle).decode(errors="replace"))

    def decode_window(self, jpeg: bytes, top: int, left: int, h: int, w: int) -> np.ndarray:
        out, x, channels = self._decode(jpeg, top, left, h, w, None)
        out = out.reshape(out.shape[0], -1, channels)[:, left - x : left - x + w]
        return _cmyk_to_rgb(out) if channels == 4 else out

    def decode_rows(self, jpeg: bytes, top: int, left: int, h: int, w: int) -> tuple[np.ndarray, int]:
        """(rows, x): rows (h, span * 3) uint8, the window's rows from column x <= left on, decoded into
        this thread's reused buffer (valid until the thread's next call)."""
        out, x, channels = self._decode(jpeg, top, left, h, w, self.local)
        if channels == 4:
            out = np.ascontiguousarray(_cmyk_to_rgb(out.reshape(out.shape[0], -1, 4)))
            out = out.reshape(out.shape[0], -1)
        return out, x

    def _decode(self, jpeg: bytes, top: int, left: int, h: int, w: int, reuse) -> tuple[np.ndarray, int, int]:
        """(out (h, span * channels) uint8, x, channels): rows top .. top + h - 1 from column x on."""
        get, handle, data, size = self.get, self._handle(), _address(jpeg), len(jpeg)
        self._check(handle, self.quick.tj3DecompressHeader(handle, data, size))
        width, height = get(handle, self.JPEGWIDTH), get(handle, self.JPEGHEIGHT)
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
        self._check(handle, self.quick.tj3SetCroppingRegion(handle, region))
        rows, pitch = region.h or height, span * channels
        if reuse is None:
            out = np.empty(rows * pitch, np.uint8)
            address = out.ctypes.data
        else:  # one buffer per thread, grown to the largest region seen: no allocation per image
            out = getattr(reuse, "buffer", None)
            if out is None or out.size < rows * pitch:
                out = reuse.buffer = np.empty(max(rows * pitch, 1 << 20), np.uint8)
                reuse.address = out.ctypes.data  # (.ctypes builds an object: 10% of the GIL-held time)
            address = reuse.address
        status = self.decompress(handle, data, size, address, pitch, pixel_format)
        self._check(handle, status)
        return out[: rows * pitch].reshape(rows, pitch)[skip : skip + h], x, channels


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
