#!/usr/bin/env bash
# Every GPU check and benchmark in one call, for a lent GPU machine that returns files from $OUT:
#
#   bash bench/device_run.sh                        the whole suite (bench/run.py: rows, pipelines,
#                                                   GPU tests, kernel microbenchmarks, compile rows)
#   bash bench/device_run.sh --parts compile        a second call: row (d), torch.compile, alone
#
# Arguments go to bench/run.py. That machine has no network and lacks google-crc32c: run
# `bash bench/device_wheels.sh` beforehand where PyPI is reachable and carry the .whl/ folder it
# fills (or FASTTRAIN_WHEELS names); this script installs those wheels first, then checks in seconds that everything imports.
# Such a machine returns only a few files from $OUT, so the run's
# folder (results.json, results.md, throughput.png, run.log, the test and benchmark outputs and logs)
# comes back as one archive, $OUT/results.tar.gz, with results.md beside it for a first look.
# Unpack the archive's folder (named <date>-<gpu>) under bench/results/ and commit it; a second
# call's folder is merged into the first with `python bench/report.py FIRST SECOND`.
# bench/run.py stops itself inside --time_budget (530 s by default) and a hard limit of
# FASTTRAIN_HARD_LIMIT seconds from the script's start (default 570) leaves time to pack what was
# measured inside the lent machine's 600 s per command. The results name the commit when .git is
# there; a copy without it takes FASTTRAIN_COMMIT=<hash> from the caller.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the results should go to}"
wheels=${FASTTRAIN_WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
  # A wheel for another Python is refused here; preflight.py then names what is still missing.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fasttrain-site "$wheels"/*.whl \
    && PYTHONPATH="/tmp/fasttrain-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 bench/preflight.py || exit 3

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
nvidia-smi 2>/dev/null | head -20
# bench/run.py's default folder is $OUT/<date>-<gpu>/: here, inside the scratch folder.
# The hard limit counts from this script's start (wheels and preflight included).
OUT="$work" timeout --kill-after=10 "$(( ${FASTTRAIN_HARD_LIMIT:-570} - SECONDS ))" python3 bench/run.py "$@"
status=$?
[ "$status" -eq 124 ] && echo "bench/device_run.sh: bench/run.py passed the hard limit; packing what it wrote"
folder=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -1)
if [ -z "$folder" ]; then
  echo "bench/device_run.sh: bench/run.py wrote nothing (exit $status)" >&2
  exit "$((status == 0 ? 1 : status))"
fi
tar -czf "$OUT/results.tar.gz" -C "$work" "$(basename "$folder")"
[ -f "$folder/results.md" ] && cp "$folder/results.md" "$OUT/results.md"
echo "bench/device_run.sh: $OUT/results.tar.gz holds $(basename "$folder")/ ($(find "$folder" -type f | wc -l) files); exit $status"
exit "$status"
