#!/usr/bin/env bash
# device side (untracked helper): run the 7B overhead pairs ONLY=... in the background; /tmp/res/done at the end
export PATH=/tmp/site/bin:$PATH
mkdir -p /tmp/res
cd "$(dirname "$0")/.."
setsid nohup bash -c "OUT=/tmp/res SEEDS=0,1,2 ROUNDS=2 ONLY=$ONLY SIZE=7b MEM=0.42 CORES=1 LIMIT_S=$LIMIT_S \
  bash experiments/router-overhead/gpu.sh > /tmp/res/gpu.out 2>&1; touch /tmp/res/done" > /dev/null 2>&1 < /dev/null &
echo launched
