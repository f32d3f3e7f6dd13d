#!/usr/bin/env bash
# GPU validation steps, run on the lent H200 machine after ../shared/gpu's wheels are installed
# (docs/benchmarks.md, "GPU"). Usage: [SEEDS=0] [POLICIES=static,pull,steal] [LIMIT_S=570] [TP=2] [SIZE=h,l,heads,vocab] \
#   bash scripts/gpu_validate.sh policies|steal|overhead|overhead-control|colocated|calibrate|tp
# Results go to $OUT/<step>/ (bench.json, bench.md, bench.png) and $OUT/<step>.log; `overhead`
# also samples `top` every 5 s into $OUT/overhead/top.log and runs experiments/router-overhead/run.py.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
RC="python3 -m rollout_cluster.cli"
# The GPU-scale rl-longtail batch of the issue (and of shared/profiles' anchor runs).
W="--prompts 64 --samples 8 --median 1500 --sigma-prompt 0.9 --sigma-sample 0.5 --max-tokens 8192 \
   --prompt-min 256 --prompt-max 1024"
step=$1
SEEDS=${SEEDS:-0}
POLICIES=${POLICIES:-static,pull,steal}
LIMIT_S=${LIMIT_S:-570}
case "$step" in
  policies|overhead|steal|calibrate|overhead-control|colocated|tp) ;;
  *) echo "unknown step $step: policies|steal|overhead|overhead-control|colocated|calibrate|tp" >&2; exit 2 ;;
esac
mkdir -p "$OUT/$step"
case "$step" in
  policies)
    $RC make-model models/qwen2.5-7b --arch qwen2.5-7b
    timeout $LIMIT_S $RC bench --engine vllm --config configs/h200x2-7b.yaml --policies $POLICIES $W --seeds $SEEDS \
      --profile h200-7b-calibrated --out "$OUT/policies" ;;
  overhead)
    $RC make-model models/qwen2.5-1.5b --arch qwen2.5-1.5b
    while true; do date +%T; top -b -n 2 -d 2 -o %CPU -w 200 | awk '/^top -/{n++} n==2' | sed -n 7,18p; sleep 3
    done > "$OUT/overhead/top.log" 2>&1 &
    sampler=$!
    trap 'kill $sampler 2>/dev/null' EXIT  # (also when the step is interrupted)
    timeout 330 $RC bench --engine vllm --config configs/h200-1.5b.yaml --replicas 1 --policies pull --bare-engine $W \
      --seeds $SEEDS --profile h200-1.5b --out "$OUT/overhead"
    timeout 200 python3 experiments/router-overhead/run.py --config configs/h200-1.5b.yaml $W --seed ${SEEDS%%,*} \
      --out "$OUT/overhead"
    ;;
  steal)  # the steal policy alone, on the same cluster shape as `policies`
    $RC make-model models/qwen2.5-7b --arch qwen2.5-7b
    timeout 300 $RC bench --engine vllm --config configs/h200x2-7b.yaml --policies steal $W --seeds $SEEDS \
      --profile h200-7b-calibrated --out "$OUT/steal" ;;
  calibrate)
    $RC make-model models/qwen2.5-7b --arch qwen2.5-7b
    timeout 560 $RC calibrate --config configs/h200x2-7b.yaml --out "$OUT/calibrate/h200-7b-calibrated.yaml" \
      --batches 1,16,64,256 --contexts 512,2048 --decode-tokens 64 --name h200-7b-calibrated ;;
  overhead-control)  # issue 29: the cluster against two bare engines (the second one the control), paired rounds
    SEEDS=${SEEDS:-0,1,2} ROUNDS=${ROUNDS:-2} SIZE=${SIZE:-1.5b} CONTROL=1 MEM=${MEM:-0.28} CORES=1 \
      CORES_AFTER_S=${CORES_AFTER_S:-280} CORES_DURATION_S=${CORES_DURATION_S:-1500} LIMIT_S=$LIMIT_S \
      bash experiments/router-overhead/gpu.sh ;;
  colocated)  # issue 26: co-located trainer, IPC push against save_pretrained + update_weights, digests
    # OBJECT_STORE=1 adds phase f (a push through the object store: vLLM's layerwise reload from shm slots)
    timeout $LIMIT_S python3 experiments/weights-colocated/run.py --size ${SIZE:-7b} \
      $([ -n "${OBJECT_STORE:-}" ] || echo --no-object-store) \
      --budget-s $((LIMIT_S - 30)) --out "$OUT/colocated"
    timeout 120 python3 experiments/weights-colocated/digest_gpu_check.py ;;
  tp)  # one replica whose engine spans both GPUs: a batch, a weights reload on every rank, the batch again
    timeout $LIMIT_S python3 experiments/gpu-weights-reload/run.py --tp ${TP:-2} --size ${SIZE:-256,2,4,2048} --out "$OUT/tp" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac 2>&1 | grep -v " INFO \|^INFO" | tail -c 60000 > "$OUT/$step.log"
status=${PIPESTATUS[0]}  # the step's own (a timeout: 124)
tail -c 6000 "$OUT/$step.log"
exit $status
