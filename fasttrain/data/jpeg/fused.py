"""A train crop's decode, resize and colour in one call that drops the GIL once per image.

A loader thread drops the GIL at each call that runs without it and must take it back behind the
other threads: each drop may cost a wait as long as the others' GIL-held work, and a wake-up. Before
this, the train transforms dropped it three times per image (the doctored stream, the decode, the
resize; the record's read is a fourth), Inception's four (its colour distortion). Here they are one
numba call (nogil): the doctored stream (fasttrain.data.jpeg.doctor._doctor), TurboJPEG's header
read, cropping region and decode, and the transform's kernels (ResNet v1.5: resize_kernels._bilinear; the
Inception seed: the resize method drawn and color._distort; the ResNet seed's vgg window:
vgg._window_bilinear, in vgg._fused), so a thread drops the GIL twice per image: the read and this
call. Counted with perf on CPython's take_gil (bench/loader_alone.py, one thread, photo shards with
row checkpoints, 1,920 images): 2.04 takes per image against 3.88 with the separate calls
(--no-fused) for ResNet v1.5's transform, 2.05 against 3.89 for vgg's, 2.04 against 4.89 for
Inception's (with color_distort; its colour draws keep the GIL too now, color._sample_color).

What that buys depends on how many threads wait for the GIL. On the project's 2-core VM, where they
rarely do (bench/fused_decode.py, bench/results/2026-11-27-cpu-fused-decode/: 3 interleaved rounds,
2 and 8 threads), the medians are 1.03-1.05x the separate calls' images/s with 1-3% less CPU per
image, for each of the three transforms. On a GPU machine's 16 cores the GPU run measures it
(bench/gpu_e2e.py: loader-threads against loader-threads-unfused).

TurboJPEG is called from the compiled code by the functions' addresses (`_call`, an LLVM call through
a pointer): numba can call ctypes function objects too, but then refuses to cache the compiled code
on disk (a "dynamic global"), and each process would compile it anew. tj3SetCroppingRegion takes its
tjregion (four ints) by value: the SysV x86-64 and AAPCS64 ABIs pass a 16-byte struct of integers in
two 64-bit registers, x | y << 32 and w | h << 32 on a little-endian machine, which is what `_call`
passes. Elsewhere (Windows passes it by reference) `FUSED` is False and the usual calls run. Where
the guess is wrong all the same, `check` (run once per process, by the loaders' warm-up or the first
image) finds other pixels than the separate calls' on a test JPEG, says so in one line on stderr and
turns FUSED off: a loader never trains on other pixels.

Scope: exactly the pixels of fasttrain.data.jpeg.doctor.decode_window_rows (decode_full_window_rows
for Inception) followed by the transform's kernels (tests/test_jpeg_fused.py compares them bit for
bit, and against TensorFlow's train images). Whatever that path treats specially returns to it:
CMYK, a sampling TurboJPEG cannot crop, any TurboJPEG error or warning (the usual path tolerates or
reports it as before, with a fresh handle), a window outside the image. Then the image costs its
usual calls and a header read more.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import threading

import numba
import numpy as np
import simplejpeg
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from fasttrain.data.color import ColorParams, _distort
from fasttrain.data.jpeg import decode as _jpeg
from fasttrain.data.jpeg.doctor import _doctor, decode_window_rows, full_window_region, read_only_views
from fasttrain.data.jpeg.scan import COLUMN_GROUP, row_checkpoints
from fasttrain.data.resize import METHODS, resize
from fasttrain.data.resize_kernels import _area, _bicubic, _bilinear, _nearest

__all__ = ["FUSED", "check", "crop_resize", "crop_resize_inception", "decode_window", "run"]

# Statuses of the compiled calls.
DONE, USUAL, GROW_STREAM, GROW_BUFFER = 0, 1, 2, 3
# turbojpeg.h: TJPARAM_SUBSAMP, JPEGWIDTH, JPEGHEIGHT, COLORSPACE; TJCS_CMYK, YCCK; TJPF_RGB.
_SUBSAMP, _WIDTH, _HEIGHT, _COLORSPACE, _CMYK, _YCCK, _PF_RGB = 4, 5, 6, 8, 3, 4, 0
_MCU_WIDTH = np.array(_jpeg._TurboJPEG.MCU_WIDTH, np.int64)
_NAMES = ("tj3DecompressHeader", "tj3Get", "tj3SetCroppingRegion", "tj3Decompress8")


@intrinsic
def _call(typingctx, address, args):
    """int f(args...) for the C function at `address`, args a tuple of integers passed as they are
    typed (int32 for an int, 64-bit for a pointer, a size_t or half a 16-byte struct)."""
    if not isinstance(address, types.Integer) or not isinstance(args, types.BaseTuple):
        return None
    if not all(isinstance(t, types.Integer) for t in args):
        return None

    def codegen(context, builder, signature, values):
        pointer, packed = values
        argv = [builder.extract_value(packed, i) for i in range(len(signature.args[1]))]
        function = ir.FunctionType(ir.IntType(32), [v.type for v in argv])
        return builder.call(builder.inttoptr(pointer, function.as_pointer()), argv)

    return types.int32(address, args), codegen


@numba.njit(nogil=True, cache=True)
def decode_window(fns, handle, data, cp, top, left, h, w, stream, buffer):
    """(status, need, x, doctored): the window's rows decoded into buffer as doctor.decode_window_rows
    does, rows (h, span * 3) from image column x <= left on; need: the bytes a GROW_* status asks for;
    doctored: whether through a doctored stream."""
    header, get, crop, decompress = fns
    address, size, doctored = data.ctypes.data, data.size, False
    if cp.shape[0]:
        n, new_top = _doctor(data, cp, top, left, h, w, stream, COLUMN_GROUP)
        if n <= -2:
            return GROW_STREAM, -2 - n, 0, False
        if n >= 0:  # else nothing to drop: the stream as it is
            address, size, top, doctored = stream.ctypes.data, n, new_top, True
    if _call(header, (handle, address, size)) != 0:
        return USUAL, 0, 0, doctored
    width, height = _call(get, (handle, np.int32(_WIDTH))), _call(get, (handle, np.int32(_HEIGHT)))
    if not (0 <= top and 0 <= left and 0 < h and 0 < w and top + h <= height and left + w <= width):
        return USUAL, 0, 0, doctored
    subsamp = _call(get, (handle, np.int32(_SUBSAMP)))
    colorspace = _call(get, (handle, np.int32(_COLORSPACE)))
    if colorspace == _CMYK or colorspace == _YCCK or not 0 <= subsamp < _MCU_WIDTH.size:
        return USUAL, 0, 0, doctored
    x = left - left % _MCU_WIDTH[subsamp]
    span = w + left - x
    if h * span * 3 > buffer.size:
        return GROW_BUFFER, h * span * 3, 0, doctored
    region = (np.int64(x) | (np.int64(top) << 32), np.int64(span) | (np.int64(h) << 32))
    if _call(crop, (handle, region[0], region[1])) != 0:
        return USUAL, 0, 0, doctored
    pitch, pixel_format = np.int32(span * 3), np.int32(_PF_RGB)
    if _call(decompress, (handle, address, size, buffer.ctypes.data, pitch, pixel_format)) != 0:
        return USUAL, 0, 0, doctored
    return DONE, 0, x, doctored


@numba.njit(nogil=True, cache=True)
def _resnet(fns, handle, data, cp, top, left, h, w, flip, stream, buffer, out):
    """(status, need, doctored): the ResNet train transform's decode_and_crop and bilinear resize into out."""
    status, need, x, doctored = decode_window(fns, handle, data, cp, top, left, h, w, stream, buffer)
    if status != DONE:
        return status, need, doctored
    span = w + left - x
    rows = buffer[: h * span * 3].reshape(h, span * 3)[:, 3 * (left - x) : 3 * (left - x + w)]
    size_h, size_w = out.shape[0], out.shape[1]
    levels = out.reshape(size_h, size_w * 3)
    one = np.float32(1.0)
    _bilinear(rows, flip, one, np.empty((0, 0), np.float32), levels, one, False, size_h, size_w, 0, 0)
    return DONE, 0, doctored


@numba.njit(nogil=True, cache=True)
def _inception(fns, handle, data, cp, top, left, h, w, crop, method, flip, colour, stream, buffer, out, work):
    """(status, need, doctored): the Inception train transform (fasttrain.data.transforms.apply_train)
    into out (S, S, 3) uint8. (top, left, h, w): the decoded region, the crop's columns crop = (left,
    width) and one more on each side where the image has them (doctor.decode_full_window_rows); method:
    METHODS' index; colour: (on, ordering, brightness, saturation, hue, contrast), the float32 resize
    into work (S, S, 3) and the seed's distort_color into out when on."""
    status, need, x, doctored = decode_window(fns, handle, data, cp, top, left, h, w, stream, buffer)
    if status != DONE:
        return status, need, doctored
    span, at = w + left - x, 3 * (crop[0] - x)
    rows = buffer[: h * span * 3].reshape(h, span * 3)[:, at : at + 3 * crop[1]]
    size_h, size_w = out.shape[0], out.shape[1]
    no_floats, no_levels = np.empty((0, 0), np.float32), np.empty((0, 0), np.uint8)
    if colour[0]:  # resize() into work's floats; else into out's levels, x 255 rounded
        fout, uout, multiplier = work.reshape(size_h, size_w * 3), no_levels, np.float32(1)
    else:
        fout, uout, multiplier = no_floats, out.reshape(size_h, size_w * 3), np.float32(255)
    scale = np.float32(1 / 255)  # convert_image_dtype's, as resize() is given it
    if method == 0:
        _bilinear(rows, False, scale, fout, uout, multiplier, flip, size_h, size_w, 0, 0)
    elif method == 1:
        _nearest(rows, False, scale, fout, uout, multiplier, flip)
    elif method == 2:
        _bicubic(rows, False, scale, fout, uout, multiplier, flip)
    else:
        _area(rows, False, scale, fout, uout, multiplier, flip)
    if colour[0]:  # distort_color(work, ColorParams(*colour[1:]), out)
        factors = np.float32(colour[2]), np.float32(colour[3]), np.float32(colour[4]), np.float32(colour[5])
        _distort(work, int(colour[1]), factors[0], factors[1], factors[2], factors[3], out.reshape(-1))
    return DONE, 0, doctored


def _supported() -> bool:
    """A 16-byte struct passed in two 64-bit registers, low half first (see the module docstring)."""
    return (
        _jpeg._turbo is not None
        and sys.platform in ("linux", "darwin")
        and platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")
        and sys.byteorder == "little"
    )


def _address(name: str) -> int:
    return ctypes.cast(getattr(_jpeg._turbo.lib, name), ctypes.c_void_p).value


FUSED = _supported()
# The TurboJPEG functions' addresses, in decode_window's order.
_FNS = tuple(_address(name) for name in _NAMES) if FUSED else ()
_NO_CHECKPOINTS = np.zeros((0, 5), np.int16)
_NO_CHECKPOINTS.flags.writeable = False
_local = threading.local()  # this thread's doctored-stream buffer (the decode's is TurboJPEG's)


def run(kernel, jpeg, checkpoints, window, settings: tuple, outputs: tuple) -> bool:
    """kernel(fns, handle, data, cp, *window, *settings, stream, buffer, *outputs) -> (status, need,
    doctored), a compiled call that decodes `window` (top, left, h, w) of `jpeg` (decode_window) and
    transforms it into its outputs, run on this thread's buffers. False (nothing written) where the usual
    path must make the image, or where the fused calls are off (FUSED)."""
    if not FUSED or _jpeg._turbo is None:  # (None: the library taken away, as the tests without it do)
        return False
    if not _problem and not checked():  # a process that skipped the warm-up (a spawned worker)
        return False
    return _execute(kernel, jpeg, checkpoints, window, settings, outputs)


def _execute(kernel, jpeg, checkpoints, window, settings: tuple, outputs: tuple) -> bool:
    """run's call, unchecked."""
    turbo = _jpeg._turbo
    handle = turbo._handle()
    buffer, stream = turbo.buffer(0)[0], getattr(_local, "stream", None)  # the decode's: decode_rows' too
    if stream is None:
        stream = _local.stream = np.empty(1 << 18, np.uint8)
    data, cp = read_only_views(jpeg, _NO_CHECKPOINTS if checkpoints is None else checkpoints)
    for _ in range(3):  # at most one growth of each buffer
        status, need, _ = kernel(_FNS, handle, data, cp, *window, *settings, stream, buffer, *outputs)
        if status == DONE:
            return True
        if status == GROW_STREAM:
            stream = _local.stream = np.empty(max(need, 2 * stream.size), np.uint8)
        elif status == GROW_BUFFER:
            buffer = turbo.buffer(need)[0]
        else:
            break
    # After a failed call TurboJPEG's decompressor may be left inside a header (decode._TurboJPEG._fail):
    # the usual path starts on a fresh one.
    turbo.local.handle = None
    return False


def crop_resize(jpeg, checkpoints, window, flip: bool, out: np.ndarray) -> bool:
    """The ResNet train transform of `jpeg` into out (S, S, 3) uint8, C-contiguous: the crop `window`
    (top, left, h, w) decoded (through `checkpoints` when given, else None), flipped left-right when
    `flip`, resized bilinearly. True when done; False (nothing written) when the usual path must run."""
    return run(_resnet, jpeg, checkpoints, window, (bool(flip),), (out,))


_NO_WORK = np.empty((0, 0, 3), np.float32)


def crop_resize_inception(jpeg, checkpoints, window, width: int, method: str, flip: bool, color, out, work):
    """The Inception train transform of `jpeg` into out (S, S, 3) uint8, C-contiguous: the crop `window`
    (top, left, h, w) of the width-wide image decoded (through `checkpoints` when given) to the whole
    decode's pixels, resized by `method` into out, or with `color` (a ColorParams, else None) into work
    (S, S, 3) float32, C-contiguous, then colour-distorted into out; flipped left-right when `flip`.
    True when done; False (nothing written to out) when the usual path must run."""
    if color is None:
        colour, work = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0), _NO_WORK
    else:
        values = (color.ordering, color.brightness, color.saturation, color.hue, color.contrast)
        colour = (1.0, *(float(v) for v in values))
    settings = ((window[1], window[3]), METHODS.index(method), bool(flip), colour)
    return run(_inception, jpeg, checkpoints, full_window_region(window, width), settings, (out, work))


def warm_up_inputs() -> tuple[bytes, list]:
    """(jpeg, [None, its checkpoints]): a 40 x 48 JPEG of three MCU rows (4:2:0), every pixel different,
    for the kernels' warm-ups and `check`."""
    y, x = np.mgrid[0:48, 0:40]
    image = np.stack([y * 5 + x, y * 3 + x * 7 % 64, (x * y) % 251], -1).astype(np.uint8)
    jpeg = simplejpeg.encode_jpeg(image, quality=95, colorsubsampling="420")
    return jpeg, [None, row_checkpoints(jpeg)]


def check() -> str:
    """'' when the fused ResNet call gives the separate calls' bytes on this machine, else why not; then
    FUSED is turned off, so the loaders take the separate calls. Windows off the MCU grid, with and
    without checkpoints (a doctored stream and a plain one): the cropping region reaches TurboJPEG in
    registers as this module assumes the machine's ABI passes it, and where that is wrong the loader
    must not train on other pixels."""
    global FUSED
    jpeg, checkpoints = warm_up_inputs()
    for cp in checkpoints:
        for window, flip in (((17, 19, 29, 15), True), ((3, 0, 45, 40), False)):
            got, expected = np.full((12, 12, 3), 7, np.uint8), np.empty((12, 12, 3), np.uint8)
            done = _execute(_resnet, jpeg, cp, window, (flip,), (got,))
            rows, x = decode_window_rows(jpeg, cp, window)
            _, left, h, w = window
            image = rows.reshape(h, -1, 3)[:, left - x : left - x + w]
            resize(image[:, ::-1] if flip else image, expected, "bilinear")
            if not done or not np.array_equal(got, expected):
                FUSED = False
                return (
                    f"the fused decode {'declined' if not done else 'gave other pixels than'} the "
                    f"separate calls' window {window} of a test JPEG on this machine "
                    f"({platform.machine()}): the loaders use the separate calls"
                )
    return ""


_checked = threading.Lock()
_problem: list[str] = []  # check()'s answer, once per process


def checked() -> bool:
    """FUSED after `check` has run once in this process (a line on stderr if it turned them off)."""
    with _checked:
        if FUSED and not _problem and _jpeg._turbo is not None:
            _problem.append(check())
            if _problem[0]:
                print(f"fasttrain: {_problem[0]}", file=sys.stderr, flush=True)
    return FUSED


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the ResNet and Inception kernels in this process,
    before a loader starts its threads (fasttrain.data.vgg.warm_up compiles vgg's), and `check` the
    fused calls (once per process); where they are off, compile the separate calls' doctored stream."""
    checked()
    if not FUSED:  # (--fused_decode=false, or check() turned them off): else the first images compile it
        if _jpeg._turbo is not None:
            jpeg, checkpoints = warm_up_inputs()
            decode_window_rows(jpeg, checkpoints[1], (17, 19, 29, 15))
        return
    warm_up_inception()


def warm_up_inception() -> None:
    """The fused Inception crop's kernels (with and without colour, with and without checkpoints); where
    FUSED is off, nothing."""
    if not FUSED:
        return
    jpeg, checkpoints = warm_up_inputs()
    out, work = np.empty((2, 2, 3), np.uint8), np.empty((2, 2, 3), np.float32)
    for cp in checkpoints:
        for color in (None, ColorParams(0, 0.0, 1.0, 0.0, 1.0)):
            crop_resize_inception(jpeg, cp, (16, 0, 16, 16), 40, "bilinear", False, color, out, work)
