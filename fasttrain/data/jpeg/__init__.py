"""JPEG decoding as TensorFlow does it, and the row checkpoints that let a crop skip most of its decode.

    decode.py     TF's decode_jpeg and decode_and_crop_jpeg: libjpeg-turbo, fast IDCT, fancy upsampling
                  (simplejpeg; the cropped decode through libturbojpeg 3 by ctypes)
    scan.py       one pass over a baseline JPEG's entropy-coded data: the row checkpoints (where each
                  MCU row's column groups start, to the bit, and the DC predictors there)
    doctor.py     a crop decoded through its checkpoints: a doctored stream that drops the rows above
                  the window and the columns beside it, the same pixels as the cropped decode
    synth.py      synthetic entropy-coded MCUs and bit-exact splicing, for the doctored streams
    restart.py    the doctored layouts of JPEGs with a restart marker after every MCU row
    fused.py      a train crop's decode (doctored or not), resize and colour in one call that drops the GIL
    row_index.py  the per-shard sidecar files (<shard>.rows) that store the checkpoints, and their build
                  (python -m fasttrain.data row-checkpoints DATA_DIR)

`from fasttrain.data.jpeg import decode_jpeg` (the module's path before this package) still works:
the decoder's public names are re-exported here. fasttrain's own code imports fasttrain.data.jpeg.decode.
"""

from fasttrain.data.jpeg.decode import (
    CROP_DECODE,
    decode_and_crop_jpeg,
    decode_jpeg,
    decode_window_rows,
    jpeg_size,
)

__all__ = ["CROP_DECODE", "decode_and_crop_jpeg", "decode_jpeg", "decode_window_rows", "jpeg_size"]
