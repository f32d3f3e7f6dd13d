#!/usr/bin/env bash
# Device side: runs gpu.sh in the background (setsid, so that it outlives the device call that
# starts it) with its results in /tmp/res, and touches /tmp/res/done at its end. Later calls, each
# within the machine's idle limit of the one before, poll and copy /tmp/res to $OUT. Usage, after
# the kit's install.sh: ONLY=0:0,0:1,1:0 LIMIT_S=1350 [SIZE=7b SEEDS=0,1,2 ROUNDS=2 MEM=0.42] \
#   bash experiments/router-overhead/gpu_background.sh
export PATH=/tmp/site/bin:$PATH
mkdir -p /tmp/res
cd "$(dirname "$0")/../.."
setsid nohup bash -c "OUT=/tmp/res SEEDS=${SEEDS:-0,1,2} ROUNDS=${ROUNDS:-2} ONLY=${ONLY:-} SIZE=${SIZE:-7b} \
  MEM=${MEM:-0.42} CORES=1 LIMIT_S=${LIMIT_S:-540} bash experiments/router-overhead/gpu.sh > /tmp/res/gpu.out 2>&1; \
  touch /tmp/res/done" > /dev/null 2>&1 < /dev/null &
echo launched
