"""Subcommands `bench`, `simulate` and `calibrate`, registered by rollout_cluster/cli.py.

Nothing heavy is imported here: the commands import their modules when they run, and the sim
engine never loads ray or vllm.
"""
from __future__ import annotations

import argparse

from ..cli_types import at_least, int_list, positive, seconds


def workload_flags(p: argparse.ArgumentParser) -> None:
    """The workload flags of BENCHMARK.md; unset ones take the engine's scale (sim: seed scale,
    vllm: CPU scale)."""
    g = p.add_argument_group("workload (defaults: seed scale for sim, CPU scale for vllm)")
    g.add_argument("--workload", default="rl-longtail", choices=["rl-longtail"])
    g.add_argument("--prompts", type=at_least(1), default=None, help="P prompts")
    g.add_argument("--samples", type=at_least(1), default=None, help="n samples per prompt")
    g.add_argument("--median", type=float, default=None, help="M: median difficulty (tokens)")
    g.add_argument("--sigma-prompt", type=float, default=None, help="σp: spread of difficulty across prompts")
    g.add_argument("--sigma-sample", type=float, default=None, help="σs: spread of lengths within a prompt")
    g.add_argument("--max-tokens", type=at_least(1), default=None, help="T: the batch's max_tokens cap")
    g.add_argument("--prompt-min", type=at_least(1), default=None, help="shortest prompt (tokens)")
    g.add_argument("--prompt-max", type=at_least(1), default=None, help="longest prompt (tokens)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trace", default=None, help="CSV group,prompt_tokens,response_tokens instead of rl-longtail")
    p.add_argument("--replicas", type=at_least(1), default=None, help="sim: 32; vllm: the config's")
    p.add_argument("--profile", default=None,
                   help="cost model for the bounds (and the sim engine): a100-80g-7b | h200-7b | h200-1.5b | FILE.yaml")
    p.add_argument("--config", default=None, help="cluster YAML (vllm: required; sim: policy tunables, max_num_seqs)")
    p.add_argument("--pull-interval", type=positive, default=0.5, help="sim: seconds of virtual time between pulls")
    p.add_argument("--host-slowdown", type=float, default=0.0,
                   help="sim: replicas share one host; each runs (1 + this x share of the others busy) slower "
                        "(0: separate GPUs; experiments/host-interference measured 0.17 on a 2-core CPU host)")


def cmd_bench(a) -> int:
    from .main import bench

    bench(a)
    return 0


def cmd_simulate(a) -> int:
    from .run import simulate

    simulate(a)
    return 0


def cmd_overhead(a) -> int:
    from .overhead import overhead

    overhead(a)
    return 0


def cmd_calibrate(a) -> int:
    from .calibrate import calibrate

    calibrate(a)
    return 0


def cmd_protocols(a) -> int:
    from .protocols import protocol_overhead

    protocol_overhead(a)
    return 0


def cmd_multiturn(a) -> int:
    from .multiturn import multiturn

    multiturn(a)
    return 0


def cmd_weights_sync(a) -> int:
    from .weights_sync import weights_sync

    weights_sync(a)
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("weights-sync", help="save_pretrained + update_weights against push_weights, side by side")
    p.add_argument("--config", default="configs/local-cpu.yaml")
    p.add_argument("--model-dir", default="models/llama-111m", help="made here if missing")
    p.add_argument("--hidden", type=at_least(1), default=768)
    p.add_argument("--layers", type=at_least(1), default=18, help="768 x 18 layers: 111M parameters")
    p.add_argument("--heads", type=at_least(1), default=12)
    p.add_argument("--checkpoints", default="checkpoints/weights-sync", help="where the checkpoint way saves")
    p.add_argument("--rounds", type=at_least(1), default=4)
    p.add_argument("--bucket-mb", type=positive, default=256.0, help="push_weights' bucket size (MiB)")
    p.add_argument("--out", required=True, help="output directory: weights_sync.json, weights_sync.md")
    p.set_defaults(fn=cmd_weights_sync)
    p = sub.add_parser("protocol-overhead", help="one batch via TRL's /generate/, OpenAI's /v1/completions and "
                                                 "RolloutClient.generate, in rotating rounds")
    p.add_argument("--config", default="configs/local-cpu.yaml")
    p.add_argument("--prompts", type=at_least(1), default=16)
    p.add_argument("--samples", type=at_least(1), default=4, help="n per prompt (16 x 4: the issue's 64 sequences)")
    p.add_argument("--max-tokens", type=at_least(1), default=64, help="every sequence's length (ignore_eos)")
    p.add_argument("--rounds", type=at_least(1), default=6, help="rounds; each runs the three paths in a rotated order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=seconds, default=900.0)
    p.add_argument("--out", required=True, help="output directory: protocols.json, protocols.md")
    p.set_defaults(fn=cmd_protocols)
    p = sub.add_parser("multiturn", help="prefix-cache hit rate of multi-turn sessions with and without affinity")
    p.add_argument("--config", default="configs/local-cpu.yaml")
    p.add_argument("--sessions", type=at_least(1), default=16)
    p.add_argument("--turns", type=at_least(2), default=4, help="turns per session (turns 2 on are what is measured)")
    p.add_argument("--user-tokens", type=at_least(1), default=64, help="new tokens each turn adds (turn 1: the prompt)")
    p.add_argument("--response-tokens", type=at_least(1), default=128, help="every response's length (ignore_eos)")
    p.add_argument("--rounds", type=at_least(1), default=2, help="runs per mode; the modes alternate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=seconds, default=900.0)
    p.add_argument("--out", required=True, help="output directory: multiturn.json, multiturn.md")
    p.set_defaults(fn=cmd_multiturn)

    p = sub.add_parser("overhead", help="the cluster against bare AsyncLLMs in paired rounds: one replica against "
                                        "one engine, or --replicas N against N engines that split the batch")
    workload_flags(p)
    p.add_argument("--seeds", type=int_list, default=[0, 1, 2], help="comma-separated seeds")
    p.add_argument("--rounds", type=at_least(1), default=2, help="paired rounds per seed (the order alternates)")
    p.add_argument("--only", default=None,
                   help="run only these pairs, as SEED:ROUND,... (each keeps the order it has in the full "
                        "--seeds x --rounds rotation): the pairs an earlier, cut-off run did not reach")
    p.add_argument("--memory-fraction", type=positive, default=0.42,
                   help="GPU: each engine's gpu_memory_utilization (both stay up side by side)")
    p.add_argument("--control", action="store_true",
                   help="also keep a second bare engine up (started last) and report it against the first: "
                        "what separate engine instances differ by without the cluster")
    p.add_argument("--timeout-s", type=seconds, default=3600.0, help="bound on each batch")
    p.add_argument("--out", required=True, help="output directory: overhead.json, overhead.md")
    p.set_defaults(fn=cmd_overhead)
    p = sub.add_parser("bench", help="every policy on one workload, side by side; writes DIR/bench.{json,md,png}")
    p.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    p.add_argument("--policies", default=None, help="comma-separated (default: the registry's benchable policies)")
    p.add_argument("--seeds", type=int_list, default=None, help="comma-separated seeds: per-seed results plus their mean")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--bare-engine", action="store_true",
                   help="vllm: also run the batch on one bare AsyncLLM and report router_overhead_pct "
                        "against the 1-replica pull run")
    p.add_argument("--timeout-s", type=seconds, default=3600.0, help="vllm: bound on each policy's batch")
    p.add_argument("--repeats", type=at_least(1), default=1,
                   help="vllm: run each seed's batch N times per policy in rotated order; rows are the median run "
                        "and bench.json adds per-round paired differences")
    workload_flags(p)
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("simulate", help="one policy in the simulator; bench.json's form on stdout")
    p.add_argument("--policy", default="steal")
    workload_flags(p)
    p.set_defaults(fn=cmd_simulate)

    p = sub.add_parser("calibrate", help="measure one vLLM engine's step and prefill times; write a cost profile")
    p.add_argument("--config", default=None, help="cluster YAML whose engine is measured (not with --from-samples)")
    p.add_argument("--from-samples", default=None,
                   help="instead of measuring: fit a, c, e to DIR/step_samples.json of a `bench --engine vllm` run "
                        "(the engines as they ran in the cluster); prefill and KV come from --base-profile")
    p.add_argument("--base-profile", default=None, help="with --from-samples: built-in name or YAML")
    p.add_argument("--samples-of", default=None,
                   help="with --from-samples: only runs whose key contains these whole words (keys: 'seed S POLICY', "
                        "'seed S POLICY rR' with --repeats: 'seed 1' is not 'seed 10')")
    p.add_argument("--out", required=True, help="profile YAML to write")
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--contexts", default="64,512,1024")
    p.add_argument("--decode-tokens", type=int, default=32, help="T: tokens decoded per step measurement")
    p.add_argument("--repeats", type=int, default=3, help="runs per timing; the minimum is kept")
    p.add_argument("--engines", type=int, default=1,
                   help="engines measured at the same time (ranks 0..N-1, placed as replicas are): the step "
                        "curve under a full node's load; use the cluster's replicas per host")
    p.add_argument("--name", default=None, help="profile name (default: derived from the model)")
    p.set_defaults(fn=cmd_calibrate)
