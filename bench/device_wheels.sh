#!/usr/bin/env bash
# Wheels the lent GPU machine lacks, fetched here (where PyPI is reachable) into .whl/ (git-ignored).
#
#   bash bench/device_wheels.sh
#
# That machine has Python 3.12, torch, triton, torchvision, numpy, pillow, protobuf, tqdm,
# matplotlib, pytest and pytest-benchmark, and no network. Of fasttrain's needs only google-crc32c
# (the TFRecord CRC checks) is missing, so without it nothing that reads data imports. Carry the
# folder to that machine (the device tool's carry: [".whl"]); bench/device_run.sh installs what it
# finds there before anything else. DALI is far over what a call can carry: its GPU mode is not
# measured there (bench/run.py times nvJPEG decoding through torchvision instead).
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(google-crc32c==1.9.0)
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest .whl \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  "${PACKAGES[@]}"
ls -l .whl
echo "bench/device_wheels.sh: carry .whl with the call that runs bench/device_run.sh"
