#!/usr/bin/env bash
# Here, before a device run (bench/gpu_run.py): fetch the CPython 3.12 x86-64 wheels that the GPU
# machine lacks into .whl/ (git-ignored; the device call carries it: carry=[".whl"]), and check that
# what travels (tracked and untracked-not-ignored files, plus .whl/) stays under the 64 MiB a call takes.
# DALI is not among them: its wheel (about 300 MB) cannot travel; the GPU tests that need it skip.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(google-crc32c==1.9.0 simplejpeg==1.9.0 turbojpeg==0.0.2)
mkdir -p .whl
for wheel in "${wheels[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$wheel"
done
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
carried=$(du -cb .whl/*.whl | tail -1 | cut -f1)
# An earlier run's inductor cache (its OUT/caches.tar.gz, copied to .gpu_cache/; bench/gpu_caches.py):
# the device call then carries [".whl", ".gpu_cache"].
if [ -f .gpu_cache/caches.tar.gz ]; then
  carried=$((carried + $(stat -c %s .gpu_cache/caches.tar.gz)))
  echo "gpu_prepare: .gpu_cache/caches.tar.gz travels too: carry [\".whl\", \".gpu_cache\"]"
else
  echo "gpu_prepare: no .gpu_cache/caches.tar.gz (an earlier run's OUT/caches.tar.gz): the compiles start cold"
fi
limit=$((64 * 1024 * 1024))
total=$((tree + carried))
echo "gpu_prepare: $(ls .whl | wc -l) wheels, $((carried / 1024)) KiB; the tree that travels $((tree / 1024)) KiB;" \
  "together $((total * 100 / limit))% of 64 MiB"
if [ "$total" -ge $((limit - 4 * 1024 * 1024)) ]; then
  echo "gpu_prepare: $((total / 1048576)) MiB would travel, over 60 MiB (64 MiB is the limit): remove untracked files"
  exit 1
fi
