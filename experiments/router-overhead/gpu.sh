#!/usr/bin/env bash
# Issue 29 on the lent H200, after ../shared/gpu's wheels (and py-spy's) are installed into /tmp/site:
# the 1-replica cluster against a bare AsyncLLM in paired rounds (`rollout-cluster overhead`), with
# both timelines (serve/timeline.py) and py-spy profiles of the replica's and the bare engine's
# processes. Usage: SEEDS=0,1 ROUNDS=2 SIZE=1.5b bash experiments/router-overhead/gpu.sh
# Results: $OUT/overhead-$SIZE/overhead.{json,md}, $OUT/timeline/*.jsonl, $OUT/pyspy-*.txt, $OUT/run.log
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
export ROLLOUT_TIMELINE_DIR=$OUT/timeline
SIZE=${SIZE:-1.5b}; SEEDS=${SEEDS:-0,1}; ROUNDS=${ROUNDS:-2}; LIMIT_S=${LIMIT_S:-540}
W="--prompts 64 --samples 8 --median 1500 --sigma-prompt 0.9 --sigma-sample 0.5 --max-tokens 8192 \
   --prompt-min 256 --prompt-max 1024"
CONFIG=configs/h200-$SIZE.yaml
python3 -m rollout_cluster.cli make-model models/qwen2.5-$SIZE --arch qwen2.5-$SIZE > /dev/null
profile() {  # py-spy of the first process matching $1, at 50 Hz, until it ends, as collapsed stacks
  local pid=""
  for _ in $(seq 1 300); do pid=$(pgrep -f "$1" | head -1); [ -n "$pid" ] && break; sleep 1; done
  [ -n "$pid" ] && /tmp/site/bin/py-spy record -r 50 -f raw --nonblocking -p "$pid" -o "$OUT/pyspy-$2.txt" \
    > /dev/null 2>&1
}
profile "ServeReplica:rollout:EngineReplica" replica &
profile "multiprocessing.spawn.*_serve_main|from multiprocessing.spawn" bare &
if [ -n "${CORES:-}" ]; then  # both engines' EngineCore processes: their profiles, environment, niceness, affinity
  ( sleep 330; for pid in $(pgrep -f EngineCore); do
      ppid=$(ps -o ppid= -p $pid | tr -d ' '); who=$(ps -o args= -p $ppid | cut -c1-60 | tr -c 'a-zA-Z0-9\n' _)
      { echo "== EngineCore $pid parent $ppid $who"; ps -o ni=,psr= -p $pid; taskset -cp $pid
        tr '\0' '\n' < /proc/$pid/environ | sort; } >> "$OUT/cores.txt" 2>&1
      /tmp/site/bin/py-spy record -r 100 -d 130 -f raw --nonblocking -p $pid -o "$OUT/pyspy-core-$pid.txt" > /dev/null 2>&1 &
    done ) &
fi
timeout $LIMIT_S python3 -m rollout_cluster.cli overhead --config $CONFIG $W --seeds $SEEDS --rounds $ROUNDS \
  --out "$OUT/overhead-$SIZE" 2>&1 | grep -v " INFO \|^INFO" | tail -c 200000 > "$OUT/run.log"
sleep 2; pkill -INT -f py-spy; sleep 2
tail -c 4000 "$OUT/run.log"; ls -la "$OUT" "$OUT/timeline"
