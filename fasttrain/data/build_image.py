"""One image of `python -m fasttrain.data build`: the JPEG bytes, height and width TensorFlow's
build_imagenet_data.py (tensorflow/models research/inception/inception/data/) stores for a file.

The script keeps a file's bytes as they are, except for two lists of names (`_process_image`):
- a path containing `n02105855_2933.JPEG` (ImageNet's one PNG) goes through decode_png(channels=3) and
  encode_jpeg(format='rgb', quality=100);
- a file named as one of 22 CMYK JPEGs goes through decode_jpeg(channels=0) and the same encode.
Then it decodes every image with decode_jpeg(channels=3) and stores the decode's height and width; a
file that does not decode kills the script's thread.

Here, without TensorFlow:
- Re-encoding: the pixels as TensorFlow decodes them (PNG: Pillow's decode, lossless, alpha dropped as
  decode_png(channels=3) drops it; CMYK: libjpeg-turbo's CMYK output through simplejpeg with the fast
  IDCT and fancy upsampling, then jpeg_mem.cc's formula, r = k * c / 255 after an Adobe APP14 marker
  and r = (255 - k) * (255 - c) / 255 without one), then Pillow's libjpeg-turbo encoder with
  encode_jpeg's settings: quality 100, 4:2:0 chroma, the accurate integer DCT, no optimised Huffman
  tables, JFIF density 300x300 dots per inch. On tests/data/tf-build those bytes equal TensorFlow's,
  so they decode to TensorFlow's pixels exactly (tests/test_data_build.py).
- The soundness check, for every other file: what makes TensorFlow's decode_jpeg fail makes the image
  bad here. It fails on libjpeg's fatal errors and whenever libjpeg asks for data past the end (TF's
  memory source has no fake end marker: a truncated file or one without its end-of-image marker), and
  accepts what libjpeg only warns about (data that hits a marker early, bytes before a marker, anything
  after the end-of-image marker). So: the file must start with the JPEG start marker, walking its
  markers as libjpeg does must reach the end-of-image marker inside the file, and libjpeg-turbo must
  decode it without a fatal error (warnings allowed), at 1/8 scale: the scaled decode still decodes
  every coefficient, where all of libjpeg's errors arise, and costs about 0.6 of a full decode. Where
  simplejpeg's TurboJPEG calls refuse a file TurboJPEG's API cannot describe (unusual sampling
  factors), Pillow's libjpeg decode gives the verdict. TensorFlow 2 decodes PNG, GIF and BMP data
  under decode_jpeg too and the script would store them as "JPEG"; here they are bad images, since
  no JPEG decoder (DALI's, fasttrain's) reads them.
"""

from __future__ import annotations

import io
import os

import numpy as np
import simplejpeg
from PIL import Image

from fasttrain.data.jpeg.decode import cmyk_to_rgb, reaches_end_marker

PNG_NAME = "n02105855_2933.JPEG"
# build_imagenet_data.py's list (from github.com/cytsai/ilsvrc-cmyk-image-list).
CMYK_NAMES = frozenset(
    f"{name}.JPEG"
    for name in (
        "n01739381_1309 n02077923_14822 n02447366_23489 n02492035_15739 n02747177_10752 "
        "n03018349_4028 n03062245_4620 n03347037_9675 n03467068_12171 n03529860_11437 "
        "n03544143_17228 n03633091_5218 n03710637_5125 n03961711_5286 n04033995_2932 "
        "n04258138_17003 n04264628_27969 n04336792_7448 n04371774_5854 n04596742_4225 "
        "n07583066_647 n13037406_4650"
    ).split()
)
# decode_jpeg refuses an image of height * width * components >= 2^29 bytes (jpeg_mem.cc).
MAX_DECODE_BYTES = 1 << 29
_MAGIC = {b"\x89PNG": "PNG", b"GIF8": "GIF", b"BM": "BMP", b"RIFF": "RIFF/WebP", b"II*\0": "TIFF"}

Image.MAX_IMAGE_PIXELS = None  # the size limit that applies is decode_jpeg's, checked below


class BadImage(Exception):
    """A file the script could not store. The message says why, without the path, as a predicate of
    the file: "is truncated (...)", "does not decode (...)"."""


def converted_by_script(relative_path: str) -> str | None:
    """'png' or 'cmyk' when build_imagenet_data.py re-encodes the file at `relative_path`
    (synset/name), else None. The script tests the PNG name against the whole path it globbed; here
    the part under the split directory, so where the tree lies cannot change what is stored."""
    if PNG_NAME in relative_path:
        return "png"
    if os.path.basename(relative_path) in CMYK_NAMES:
        return "cmyk"
    return None


def stored_image(path: str, relative_path: str) -> tuple[bytes, int, int]:
    """(JPEG bytes, height, width) as the script stores the file; BadImage if it would fail on it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise BadImage(f"cannot be read ({e.strerror})") from None
    conversion = converted_by_script(relative_path)
    if conversion is not None:
        pixels = _png_pixels(data) if conversion == "png" else _jpeg_pixels_any_channels(data)
        return encode_like_tensorflow(pixels), pixels.shape[0], pixels.shape[1]
    height, width = check_jpeg(data)
    return data, height, width


def encode_like_tensorflow(pixels: np.ndarray) -> bytes:
    """tf.io.encode_jpeg(pixels, format='rgb', quality=100) of (H, W, 3) uint8 pixels.

    jpeg_mem.cc's CompressInternal: jpeg_set_defaults (4:2:0, JDCT_ISLOW, standard Huffman tables),
    density 300x300 per inch, jpeg_set_quality(100, force_baseline=TRUE); Pillow's encoder sets the
    same, and its subsampling=2 is 4:2:0."""
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "JPEG", quality=100, subsampling=2, dpi=(300, 300))
    return buf.getvalue()


def _png_pixels(data: bytes) -> np.ndarray:
    """decode_png(channels=3): grey replicated, palette expanded, alpha dropped (not composited)."""
    if data[:2] == b"\xff\xd8":  # already a JPEG: decode it as decode_jpeg(channels=3) does
        check_jpeg(data)
        return _decode_rgb(data)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise BadImage(f"does not decode as an image ({e})") from None
    if image.mode not in ("1", "L", "LA", "P", "PA", "RGB", "RGBA"):
        raise BadImage(
            f"is a {image.mode} image; only 8-bit ones are converted as decode_png does: convert it to 8 bits"
        )
    return np.asarray(image.convert("RGB"))


def _jpeg_pixels_any_channels(data: bytes) -> np.ndarray:
    """decode_jpeg(channels=0) for the listed CMYK names: CMYK (and YCCK) converted to RGB by
    jpeg_mem.cc's formula, RGB as decode_jpeg(channels=3). A grey JPEG, where TensorFlow's encode
    (format='rgb', 1 channel) fails, is stored as RGB with three equal channels."""
    check_jpeg(data)
    try:
        _, _, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        if colorspace not in ("CMYK", "YCCK"):
            return _decode_rgb(data)
        cmyk = simplejpeg.decode_jpeg(data, colorspace="CMYK", fastdct=True, fastupsample=False, strict=False)
    except ValueError as e:  # sampling factors TurboJPEG's API cannot describe: TF's pixels are out of reach
        raise BadImage(f"is not re-encoded: TurboJPEG does not decode it ({e})") from None
    return cmyk_to_rgb(cmyk, data)


def _decode_rgb(data: bytes) -> np.ndarray:
    try:
        return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=True, fastupsample=False, strict=False)
    except ValueError as e:
        raise BadImage(f"is not re-encoded: TurboJPEG does not decode it ({e})") from None


def check_jpeg(data: bytes) -> tuple[int, int]:
    """(height, width) of a JPEG TensorFlow's decode_jpeg(channels=3) decodes; BadImage otherwise."""
    if data[:2] != b"\xff\xd8":
        kind = next((k for magic, k in _MAGIC.items() if data.startswith(magic)), None)
        raise BadImage(
            "is empty" if not data else f"is {'a ' + kind + ' image' if kind else 'not an image'}, not a JPEG"
        )
    if not reaches_end_marker(data):
        raise BadImage("is truncated (its data ends before the JPEG end-of-image marker)")
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        components = {"Gray": 1, "CMYK": 4, "YCCK": 4}.get(colorspace, 3)
        _check_size(height, width, components)
        # min_height/min_width 1: the smallest scale libjpeg offers (1/8), every coefficient decoded.
        simplejpeg.decode_jpeg(
            data,
            colorspace="CMYK" if components == 4 else "RGB",
            fastdct=True,
            min_height=1,
            min_width=1,
            strict=False,  # warnings are not errors, as in TensorFlow
        )
        return height, width
    except ValueError as turbo_error:
        error = turbo_error
    # TurboJPEG's API describes only the usual sampling factors; libjpeg itself decodes any.
    try:
        image = Image.open(io.BytesIO(data))
        _check_size(image.height, image.width, len(image.getbands()))
        image.draft(image.mode, (1, 1))
        image.load()
    except Exception:  # whatever Pillow raises on a file libjpeg refuses (OSError mostly, struct.error...)
        raise BadImage(f"does not decode ({error})") from None
    return image.height, image.width


def _check_size(height: int, width: int, components: int) -> None:
    if height * width * components >= MAX_DECODE_BYTES:
        raise BadImage(f"is {width}x{height}, beyond the 2^29 bytes TensorFlow's decode_jpeg accepts")
