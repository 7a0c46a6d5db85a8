"""An ImageNet record's features as build_imagenet_data.py writes them, any field overridable (None
drops it): shared by test_data_imagenet.py and test_data_verify.py, whose tests use these names."""

import io

from PIL import Image


def _jpeg(size=(20, 16), mode="RGB", color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color if mode == "RGB" else 128).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _features(**overrides):
    features = {
        "image/encoded": _jpeg(),
        "image/class/label": 5,
        "image/height": 16,
        "image/width": 20,
        "image/filename": "n01_1.JPEG",
        "image/object/bbox/ymin": [0.1, 0.2],
        "image/object/bbox/xmin": [0.3, 0.4],
        "image/object/bbox/ymax": [0.5, 0.6],
        "image/object/bbox/xmax": [0.7, 0.8],
    }
    features.update(overrides)
    return {k: v for k, v in features.items() if v is not None}
