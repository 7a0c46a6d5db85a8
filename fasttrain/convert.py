"""`python -m fasttrain.convert ...`: the spelling from before fasttrain/tf/, kept for users' scripts.

Forwards to `python -m fasttrain.tf.convert ...` (fasttrain/tf/convert.py): the same arguments, output
and exit status. Code imports fasttrain.tf.convert.
"""

import sys

from fasttrain.tf.convert import main

if __name__ == "__main__":
    sys.exit(main())
