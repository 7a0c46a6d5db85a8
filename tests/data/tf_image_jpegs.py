"""The JPEG files of tests/data/tf-images/ (written by tests/data/make_tf_images.py, which then records
what TensorFlow makes of them): real photographs in every JPEG kind ImageNet shards hold.

JPEGs `<name>.jpg`: cut and resized (LANCZOS) from photos scikit-image ships, encoded by Pillow, except
hubble_restart.jpg (`cjpeg -restart 2B`: a DRI marker, an RST marker every 2 MCUs). Kinds ("kind" in
cases.json): baseline 4:2:0 q90 and q75, 4:2:2, 4:4:4, progressive, grayscale (1 component) plain and
progressive, restart, EXIF (Orientation 6, which TF ignores), ICC profile + COM comment, Adobe CMYK with
black (K = 255 - max(R, G, B)), the same kind of CMYK file with its Adobe APP14 segment removed (libjpeg
then takes the data as plain, not inverted, CMYK: cmyk-plain), large (1201x901, q40), tiny (7x5, 2x3,
1x1) and small (40x30, 61x47 and 400x60: Inception's central crop is under S = 56 px on a side, so its
eval resize upsamples, where the bilinear taps clamp at the crop's edge); large and tiny are decode
only, small is decode and eval.
"""

import io
import struct
import subprocess
from pathlib import Path

import numpy as np
import skimage.data
from PIL import Image, ImageCms

# name: (kind, photo, crop box (left, top, right, bottom) or None, (h, w), encoder arguments)
FILES = {
    "astronaut_q90": ("baseline-420-q90", "astronaut", (0, 60, 512, 446), (251, 333), {"quality": 90}),
    "coffee_q75": ("baseline-420-q75", "coffee", None, (257, 385), {"quality": 75}),
    "chelsea_422": ("baseline-422", "chelsea", (20, 10, 411, 297), (287, 391), {"subsampling": 1}),
    "rocket_444": ("baseline-444", "rocket", None, (213, 319), {"subsampling": 0}),
    "motorcycle_progressive": ("progressive", "motorcycle", (100, 50, 620, 446), (263, 347), {}),
    "camera_gray": ("grayscale", "camera", (60, 0, 452, 512), (257, 193), {}),
    "page_gray_progressive": ("grayscale-progressive", "page", None, (191, 383), {}),
    "hubble_restart": ("restart", "hubble_deep_field", (300, 200, 780, 560), (241, 321), {}),
    "ihc_exif": ("exif", "immunohistochemistry", (0, 100, 512, 440), (203, 307), {}),
    "retina_icc_comment": ("icc-comment", "retina", (200, 150, 1160, 1150), (311, 299), {}),
    "coffee_cmyk": ("cmyk", "coffee", (150, 40, 470, 280), (181, 241), {}),
    "coffee_cmyk_plain": ("cmyk-plain", "coffee", (60, 20, 560, 380), (223, 311), {}),
    "rocket_large": ("large", "rocket", (0, 60, 640, 427), (901, 1201), {"quality": 40}),
    "tiny_7x5": ("tiny", "chelsea", None, (5, 7), {}),
    "tiny_2x3": ("tiny", "astronaut", None, (3, 2), {}),
    "tiny_1x1": ("tiny", "coffee", (200, 100, 260, 160), (1, 1), {}),
    "chelsea_small_40x30": ("small", "chelsea", (20, 10, 411, 297), (30, 40), {}),
    "astronaut_small_61x47": ("small", "astronaut", (100, 40, 420, 300), (47, 61), {}),
    "rocket_wide_400x60": ("small", "rocket", (0, 150, 640, 250), (60, 400), {}),
}
DECODE_ONLY = {"large", "tiny"}
SMALL = {"small"}  # decode and eval only: too small for the crop windows and the train cases


def _photo(name):
    if name == "motorcycle":
        return skimage.data.stereo_motorcycle()[0]
    return getattr(skimage.data, name)()


def _cmyk(rgb):
    """RGB -> CMYK with black generation K = 255 - max(R, G, B), so TF's k * c / 255 matters."""
    rgb = rgb.astype(np.float64)
    k = 255.0 - rgb.max(axis=2)
    scale = np.where(k < 255, 255.0 / np.maximum(255.0 - k, 1e-9), 0.0)
    cmy = (255.0 - k[..., None] - rgb) * scale[..., None]
    return np.round(np.concatenate([cmy, k[..., None]], axis=2)).clip(0, 255).astype(np.uint8)


def _encode(kind, image, args):
    """The JPEG bytes of one fixture file (Pillow, or cjpeg for restart markers)."""
    if kind == "restart":
        ppm = io.BytesIO()
        image.save(ppm, "PPM")
        cmd = ["cjpeg", "-quality", "90", "-restart", "2B"]
        return subprocess.run(cmd, input=ppm.getvalue(), capture_output=True, check=True).stdout
    args = {"quality": 90, "subsampling": 2, **args}
    if kind.startswith("grayscale"):
        image = image.convert("L")
        args.pop("subsampling")
    if "progressive" in kind:
        args["progressive"] = True
    if kind == "exif":
        exif = Image.Exif()
        exif[0x0112] = 6  # Orientation: rotate 90 CW to display; decoders used for training ignore it
        exif[0x010F] = "fasttrain fixture"  # Make
        exif[0x0132] = "2026:11:23 12:00:00"  # DateTime
        args["exif"] = exif.tobytes()
    if kind == "icc-comment":
        icc = bytearray(ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes())
        icc[24:36] = struct.pack(">6H", 2026, 11, 23, 0, 0, 0)  # LittleCMS stamps the current time here
        args["icc_profile"] = bytes(icc)
        args["comment"] = b"fasttrain fixture: cut from skimage.data.retina"
    if kind.startswith("cmyk"):
        cmyk = _cmyk(np.asarray(image))
        # Pillow stores CMYK inverted (Adobe's convention); read as plain CMYK once the marker is gone,
        # the complement's data decodes to the photo's colours: (255 - c) * (255 - k) / 255 ~ R.
        image = Image.fromarray(255 - cmyk if kind == "cmyk-plain" else cmyk, "CMYK")
        # Pillow's CMYK default, all four components at full resolution: subsampling=2 would subsample
        # C alone, which TF decodes but TurboJPEG's header reader (simplejpeg) refuses
        args["subsampling"] = 0
    out = io.BytesIO()
    image.save(out, "JPEG", **args)
    return _without_adobe_marker(out.getvalue()) if kind == "cmyk-plain" else out.getvalue()


def _without_adobe_marker(data):
    """The JPEG without its APP14 (Adobe) segments: Pillow writes one with every CMYK JPEG."""
    out, pos = bytearray(data[:2]), 2
    while True:
        assert data[pos] == 0xFF
        marker, length = data[pos + 1], (data[pos + 2] << 8) | data[pos + 3]
        if marker == 0xDA:  # start of scan: the rest is kept as it is
            return bytes(out + data[pos:])
        if marker != 0xEE:
            out += data[pos : pos + 2 + length]
        pos += 2 + length


def write_jpegs(out: Path):
    """{name: (kind, bytes)}, also written as out/<name>.jpg."""
    jpegs = {}
    for name, (kind, photo, box, (h, w), args) in FILES.items():
        image = Image.fromarray(_photo(photo))
        if box is not None:
            image = image.crop(box)
        image = image.resize((w, h), Image.LANCZOS)
        data = _encode(kind, image, args)
        (out / f"{name}.jpg").write_bytes(data)
        jpegs[name] = (kind, data)
    return jpegs
