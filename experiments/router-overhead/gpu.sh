#!/usr/bin/env bash
# Issue 29 on the lent H200, after ../shared/gpu's wheels (and py-spy's) are installed into /tmp/site:
# the 1-replica cluster against a bare AsyncLLM in paired rounds (`rollout-cluster overhead`), with
# both timelines (serve/timeline.py) and py-spy profiles of the replica's and the bare engine's
# processes. Usage: SEEDS=0,1 ROUNDS=2 SIZE=1.5b [CONTROL=1 MEM=0.28] [CORES=1] bash experiments/router-overhead/gpu.sh
# ONLY=0:1,2:1 runs only those SEED:ROUND pairs (each in its order of the full rotation).
# CONTROL=1 keeps a second bare engine up (started after the cluster) in the rotation; MEM is each
# engine's share of the GPU's memory. Results: $OUT/overhead-$SIZE/overhead.{json,md}, $OUT/run.log,
# and $OUT/detail.tar.gz (timelines, py-spy profiles, cores.txt, nvidia-smi samples).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
SIZE=${SIZE:-1.5b}; SEEDS=${SEEDS:-0,1}; ROUNDS=${ROUNDS:-2}; LIMIT_S=${LIMIT_S:-540}; MEM=${MEM:-0.42}
[ -n "${ONLY:-}" ] && EXTRA_ONLY="--only $ONLY" || EXTRA_ONLY=""
EXTRA=""; [ -n "${CONTROL:-}" ] && EXTRA="--control"
DETAIL=$OUT/detail; mkdir -p $DETAIL; export ROLLOUT_TIMELINE_DIR=$DETAIL/timeline
W="--prompts 64 --samples 8 --median 1500 --sigma-prompt 0.9 --sigma-sample 0.5 --max-tokens 8192 \
   --prompt-min 256 --prompt-max 1024"
CONFIG=configs/h200-$SIZE.yaml
python3 -m rollout_cluster.cli make-model models/qwen2.5-$SIZE --arch qwen2.5-$SIZE > /dev/null
profile() {  # py-spy of the first process matching $1, at 50 Hz, until it ends, as collapsed stacks
  local pid=""
  for _ in $(seq 1 300); do pid=$(pgrep -f "$1" | head -1); [ -n "$pid" ] && break; sleep 1; done
  [ -n "$pid" ] && /tmp/site/bin/py-spy record -r 50 -f raw --nonblocking -p "$pid" -o "$DETAIL/pyspy-$2.txt" \
    > /dev/null 2>&1
}
profile "ServeReplica:rollout:EngineReplica" replica &
profile "multiprocessing.spawn.*_serve_main|from multiprocessing.spawn" bare &
if [ -n "${CORES:-}" ]; then  # both engines' EngineCore processes: their profiles, environment, niceness, affinity
  ( sleep ${CORES_AFTER_S:-330}; for pid in $(pgrep -f EngineCore); do
      ppid=$(ps -o ppid= -p $pid | tr -d ' '); who=$(ps -o args= -p $ppid | cut -c1-60 | tr -c 'a-zA-Z0-9\n' _)
      # the parent's environment too: a bare engine's EngineCore rewrites its own environ with its
      # process title (Ray's workers set SPT_NOENV), and Ray gives its workers OMP_NUM_THREADS=num_cpus
      { echo "== EngineCore $pid parent $ppid $who"; ps -o ni=,psr=,nlwp= -p $pid; taskset -cp $pid
        tr '\0' '\n' < /proc/$pid/environ | sort; echo "-- parent $ppid"
        tr '\0' '\n' < /proc/$ppid/environ | grep -E '^(OMP|MKL|CUDA|RAY_|VLLM|TORCH|NCCL|PYTORCH)' | sort
      } >> "$DETAIL/cores.txt" 2>&1
      /tmp/site/bin/py-spy record -r 100 -d ${CORES_DURATION_S:-130} -f raw --nonblocking -p $pid -o "$DETAIL/pyspy-core-$pid.txt" > /dev/null 2>&1 &
    done ) &
fi
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu \
  --format=csv -l 5 > "$DETAIL/nvidia-smi.csv" 2>&1 &
timeout $LIMIT_S python3 -m rollout_cluster.cli overhead --config $CONFIG $W --seeds $SEEDS --rounds $ROUNDS \
  --memory-fraction $MEM $EXTRA $EXTRA_ONLY --out "$OUT/overhead-$SIZE" 2>&1 | grep --line-buffered -v " INFO \|^INFO" > "$DETAIL/run-full.log"
tail -c 200000 "$DETAIL/run-full.log" > "$OUT/run.log"
sleep 2; pkill -INT -f "[p]y-spy record"; pkill -f "[n]vidia-smi --query"; sleep 2  # bracketed: never the calling shell
tar czf "$OUT/detail.tar.gz" -C "$OUT" detail && rm -rf "$DETAIL"
tail -c 4000 "$OUT/run.log"; ls -la "$OUT"
