"""`python tests/fsize_limited.py -m module args...`: run a module with the file size limit
FASTTRAIN_TEST_FSIZE (bytes) and SIGXFSZ ignored, so writes past it fail with EFBIG (torchrun runs
this as each rank's script, which a preexec_fn on the agent could not reach on one rank only)."""

import os
import resource
import runpy
import signal
import sys

if __name__ == "__main__":
    if os.environ.get("RANK", "0") == "0":
        limit = int(os.environ["FASTTRAIN_TEST_FSIZE"])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    assert sys.argv[1] == "-m"
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
