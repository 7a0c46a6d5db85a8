"""JPEG decoding as TensorFlow's `decode_jpeg(contents, channels=3)` does it.

TensorFlow decodes with libjpeg-turbo, the fast integer IDCT (JDCT_IFAST) and fancy (smooth) chroma
upsampling, and asks libjpeg for RGB output, which turns 1-component (grayscale) JPEGs into three
equal channels. simplejpeg bundles libjpeg-turbo and exposes exactly those switches (fastdct=True,
fastupsample=False): its output equals TensorFlow's bit for bit on every kind of JPEG the fixture holds
(tests/test_tf_images.py). It decodes straight into a caller's buffer, and releases the GIL.

`decode_and_crop_jpeg` (the ResNet seed's train decode) is served by decoding the whole image and taking
the window: libjpeg's cropped decode skips rows with a different chroma-upsampling context, so for
4:2:0 and 4:2:2 JPEGs TensorFlow's cropped pixels differ from the full decode's in a few rows, by 0.002
levels on average over 200 random windows (identical for 4:4:4 and grayscale).

CMYK JPEGs (which build_imagenet_data converts away, so ImageNet shards hold none) are decoded to CMYK
and converted as TensorFlow's jpeg_mem.cc does for Adobe (inverted) CMYK: channel = c * k / 255.
"""

from __future__ import annotations

import numpy as np
import simplejpeg

from fasttrain.data import DataError


def undecodable(file, offset, error) -> DataError:
    return DataError(
        f"undecodable JPEG in record at offset {offset} in {file} ({error}); re-create the shard "
        "or train with --skip_corrupt"
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


def _cmyk_to_rgb(cmyk: np.ndarray) -> np.ndarray:
    k = cmyk[..., 3:4].astype(np.uint16)
    return (cmyk[..., :3].astype(np.uint16) * k // 255).astype(np.uint8)
