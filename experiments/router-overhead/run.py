"""Where does the router overhead come from? Runs the bare-engine batch of
`bench --bare-engine` (same workload, same engine limits) inside a plain Ray actor, with the
resources a Serve replica of the config gets. Compared with the bare engine in a plain process
and with the cluster's 1-replica `pull` run, it separates "being a Ray worker process" from
"our router and replica path".

    python experiments/router-overhead/run.py --config configs/h200-1.5b.yaml [every workload flag of bench] --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from rollout_cluster.bench.cli import workload_flags  # noqa: E402
from rollout_cluster.bench.run import cluster_config, percentile, tail_s, workload  # noqa: E402
from rollout_cluster.bench.vllm_run import bare_batches, warmup_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    workload_flags(ap)  # pass every workload flag: no engine-scale defaults are filled in here
    args = ap.parse_args()
    cfg = cluster_config(args)

    import ray

    ray.init(num_gpus=cfg.resources.num_gpus or None, include_dashboard=False)

    @ray.remote
    class BareEngineActor:
        async def run(self, engine_cfg, model, batches, warmup):
            return await bare_batches(engine_cfg, model, batches, warmup)

    vocab = json.loads((Path(cfg.model_path()) / "config.json").read_text())["vocab_size"]
    batch = workload(args, args.seed, vocab, ids_salt="-bare-ray")[0]
    actor = BareEngineActor.options(num_cpus=cfg.resources.num_cpus, num_gpus=cfg.resources.num_gpus).remote()
    result = ray.get(actor.run.remote(cfg.engine, cfg.model_path(), [batch], warmup_batch(1, vocab)))[0]
    ft = result["finish_times"]
    summary = {"variant": "bare AsyncLLM in a Ray async actor", "num_cpus": cfg.resources.num_cpus,
               "makespan_s": round(result["makespan_s"], 4), "tokens": result["tokens"],
               "tail_s": round(tail_s(ft), 4), "median_finish_s": round(percentile(ft, 0.5), 4)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "ray_actor.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    ray.shutdown()


if __name__ == "__main__":
    main()
