"""Batch job for `ray job submit`: deploy the app on the cluster, run a JSONL batch, write results.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m rollout_cluster.jobs.rollout --config configs/local-cpu.yaml --model $PWD/models/tiny-llama \\
        --input $PWD/in.jsonl --output $PWD/out.jsonl [--weights /checkpoints/step-7] [--finish-fraction 0.9]

The job runs in Ray's copy of the working dir: --input and --output are paths on the head node,
best absolute (a relative --output lands in that copy). The copy leaves out what .gitignore lists,
models/ among them: a config's relative model path is not in it, so --model names the model where
the nodes have it (an absolute path, or a hub id).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..cli import fraction, refusing, seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rollout_cluster.jobs.rollout")
    ap.add_argument("--config", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--keep-app", action="store_true", help="leave an app this job deployed running afterwards")
    ap.add_argument("--redeploy", action="store_true", help="deploy this config over a running app of that name "
                    "(which stays afterwards: the service it replaced)")
    ap.add_argument("--model", default=None, help="the engines' model, in place of the config's engine.model: a path "
                    "on every node (absolute: Ray's copy of --working-dir leaves out what .gitignore lists, models/ "
                    "among them) or a hub id")
    ap.add_argument("--timeout-s", type=seconds, default=None)
    ap.add_argument("--ready-timeout-s", type=seconds, default=600.0,
                    help="an app this job deploys must be running within this (replicas Ray cannot place fail it)")
    ap.add_argument("--weights", default=None,
                    help="load this checkpoint directory into every replica first (update_weights)")
    ap.add_argument("--finish-fraction", type=fraction, default=None,
                    help="partial rollouts: cut the batch once this share of its sequences is done")
    ap.add_argument("--finish-by", default="sample", choices=("sample", "group"),
                    help="what --finish-fraction counts: samples, or lines whose every sample is done")
    a = ap.parse_args(argv)
    return refusing(ap.prog, run, a)


def run(a) -> int:
    import ray
    from ray import serve

    from ..config import load_config
    from ..client.client import RolloutClient
    from ..client.jsonl import check_paths, run_jsonl
    from ..serve.app import build_app
    from ..security.local import ensure_local_secrets
    from ..serve.deploy import deploy

    check_paths(a.input, a.output)  # before the app is deployed, not after its batch ran
    cfg = load_config(a.config)
    if getattr(a, "model", None):
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"model": a.model})})
    ray.init(address="auto")
    running = _app_running(cfg.app_name)
    deployed = a.redeploy or not running
    owned = deployed and not running  # an app this job brought up is its to remove; a service it redeployed is not
    if deployed:
        ensure_local_secrets(cfg)  # an app this job deploys gets its token and keys as RolloutClient.start's does
        deploy(build_app(cfg), cfg, a.ready_timeout_s)
    else:  # a long-lived rollout service: use it (once a replica pulls), never tear it down
        print(f"using the running application {cfg.app_name!r}")
    try:  # (from here on, an app this job deployed is deleted whatever fails: the client's making too)
        client = RolloutClient(cfg.app_name, config=cfg)
        client.wait_ready(cfg.replicas if deployed else 1)
        version = client.update_weights(a.weights) if a.weights else None
        summary = run_jsonl(client, a.input, a.output, progress=False, timeout_s=a.timeout_s, weights_version=version,
                            finish_fraction=a.finish_fraction, finish_by=a.finish_by)
        if version is not None:
            summary["weights_version"] = version
    finally:
        if owned and not a.keep_app:
            serve.delete(cfg.app_name)
    print(json.dumps(summary))
    return 0


def _app_running(name: str) -> bool:
    """An app of that name is there to use: running, or replacing a replica (UNHEALTHY while an
    engine that died is replaced), or being deployed; not one that failed or is being deleted.
    Deploying over a service that is replacing a replica would restart it, and then delete it."""
    from ray import serve

    try:
        app = serve.status().applications.get(name)
    except Exception:
        return False
    return app is not None and getattr(app.status, "value", str(app.status)) not in ("DEPLOY_FAILED", "DELETING",
                                                                                    "NOT_STARTED")


if __name__ == "__main__":
    sys.exit(main())
