"""`python -m fasttrain.data.jpeg_rows DATA_DIR [--workers N] ...`: the spelling from before
fasttrain/data/jpeg/, kept for users' scripts.

Forwards to the row-checkpoint build (fasttrain.data.jpeg.row_build.main): the same arguments, output
and exit status as before. The current spelling is `python -m fasttrain.data row-checkpoints DATA_DIR`;
the doctored decode this module used to hold is fasttrain.data.jpeg.doctor.
"""

import sys

from fasttrain.data.jpeg.row_build import main

if __name__ == "__main__":
    sys.exit(main())
