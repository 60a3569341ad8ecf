#!/usr/bin/env bash
# SSD as an engine on ONE GPU in under 8 minutes: AR, ssd, SJD and ZipAR at batch 1 and 16 on the shipped backbone
# and on a random backbone of Janus-Pro-1B's shape (experiments/gpu_engine/run.py; README.md beside it).
#
#   bash experiments/gpu_engine/run.sh            # -> $LOGS/metrics.json, summary.txt, run.log
#   SMOKE=1 bash experiments/gpu_engine/run.sh    # tiny sizes on the CPU (tests/test_gpu_scripts.py)
set -u
PY=${PY:-python}
LOGS=${LOGS:-logs/gpu_engine}
SMOKE=${SMOKE:-0}
DEADLINE=${DEADLINE:-420}  # seconds of measurements; the hard limit below leaves the imports and model builds 50 s
mkdir -p "$LOGS"
FLAGS="--out $LOGS --deadline $DEADLINE"
[ "$SMOKE" = 1 ] && FLAGS="$FLAGS --smoke"
timeout $(( DEADLINE + 50 )) $PY experiments/gpu_engine/run.py $FLAGS 2>&1 | tee "$LOGS/run.log"
rc=${PIPESTATUS[0]}
echo "gpu_engine rc=$rc" | tee -a "$LOGS/run.log"
exit $rc
