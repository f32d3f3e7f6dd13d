"""The router's CPU time per pull, on a real Ray Serve cluster: N EngineReplica deployments that
host simulated engines (engine.kind: sim) pull from the Router while idle and while a batch runs;
the router's own process CPU time (its status' router_cpu_s) is divided by the pulls it served.

    python scripts/router_pull_cost.py [--replicas 1,4] [--seconds 20] [--pull-wait-s 0.05] [--idle-pull-wait-s 1.0]
        [--max-pulls-per-s 160,20,4]   # router.max_pulls_per_s: one app per value and fleet size

(experiments/router-cost ran it with --replicas 1,4,8 --seconds 15.) Prints one JSON line per (replicas, phase): pulls/s, router CPU share, CPU ms per pull. It starts a
local Ray cluster of its own (ray.init()), so stop any other first.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

from rollout_cluster.config import ClusterConfig, EngineConfig, MetricsConfig, PolicyConfig, ReplicaResources, RouterConfig
from rollout_cluster.client.client import RolloutClient
from rollout_cluster.client.expand import expand
from rollout_cluster.protocol import SamplingSpec


def sample(client) -> tuple:
    st = client.status()
    return time.monotonic(), st["router_cpu_s"], sum(r["pulls"] for r in st["replicas"].values())


def measure(client, seconds: float) -> dict:
    t0, cpu0, pulls0 = sample(client)
    time.sleep(seconds)
    t1, cpu1, pulls1 = sample(client)
    pulls, dt, cpu = pulls1 - pulls0, t1 - t0, cpu1 - cpu0
    return {"pulls_per_s": round(pulls / dt, 1), "router_cpu_share": round(cpu / dt, 3),
            "router_cpu_ms_per_pull": round(1e3 * cpu / max(1, pulls), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="1,4")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--pull-wait-s", type=float, default=0.05)
    ap.add_argument("--idle-pull-wait-s", type=float, default=None)
    ap.add_argument("--max-pulls-per-s", default=str(RouterConfig().max_pulls_per_s))
    a = ap.parse_args()
    import ray

    ray.init(num_cpus=8)
    for n, budget in itertools.product([int(x) for x in a.replicas.split(",")],
                                       [float(x) for x in a.max_pulls_per_s.split(",")]):
        router = RouterConfig(pull_wait_s=a.pull_wait_s, replica_timeout_s=60, max_pulls_per_s=budget)
        if a.idle_pull_wait_s is not None:
            router = router.model_copy(update={"idle_pull_wait_s": a.idle_pull_wait_s})
        cfg = ClusterConfig(app_name=f"pullcost{n}-{budget:g}", replicas=n,
                            engine=EngineConfig(kind="sim", model="sim", max_model_len=20480, max_num_seqs=256,
                                                sim_profile="h200-1.5b"),
                            resources=ReplicaResources(num_cpus=0.05, num_gpus=0), router=router,
                            policy=PolicyConfig(name="pull"), metrics=MetricsConfig(port=0)).validate()
        client = RolloutClient.start(cfg, address="auto")
        time.sleep(3.0)
        row = {"replicas": n, "max_pulls_per_s": budget, "report_interval_s": router.report_interval_for(n),
               "idle_pull_wait_s": router.idle_pull_wait_for(n)}
        print(json.dumps({**row, "phase": "idle", **measure(client, a.seconds)}), flush=True)
        # Busy: 64 sequences a replica, longer than the measurement.
        reqs = expand([[1, 2, 3]] * (64 * n), SamplingSpec(max_tokens=16000, ignore_eos=True))
        bid = client.submit(reqs)
        time.sleep(2.0)
        print(json.dumps({**row, "phase": "busy", **measure(client, a.seconds)}), flush=True)
        client.cancel(bid)
        client.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
