#!/bin/bash
# Cold numba warm-up of the loaders' kernels: one process against `python -m fasttrain.data warm-up`.
cd /work/main
for round in 1 2; do
  for mode in sequential jobs2 jobs1; do
    rm -rf /tmp/wres/cache; mkdir -p /tmp/wres/cache
    start=$(date +%s.%N)
    if [ $mode = sequential ]; then
      NUMBA_CACHE_DIR=/tmp/wres/cache /usr/bin/time -f "%e %U %S" -o /tmp/wres/t.txt python3 -c "from fasttrain.data.warm import warm_up_all; warm_up_all()" > /tmp/wres/$mode-$round.log 2>&1
    else
      NUMBA_CACHE_DIR=/tmp/wres/cache /usr/bin/time -f "%e %U %S" -o /tmp/wres/t.txt python3 -m fasttrain.data warm-up --jobs ${mode#jobs} > /tmp/wres/$mode-$round.log 2>&1
    fi
    read wall user sys < /tmp/wres/t.txt
    echo "{\"round\": $round, \"mode\": \"$mode\", \"wall_s\": $wall, \"user_s\": $user, \"sys_s\": $sys}" >> /tmp/wres/results.jsonl
  done
done
echo done >> /tmp/wres/results.jsonl
