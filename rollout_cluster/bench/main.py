"""`rollout-cluster bench`: every policy on one workload per seed, on the simulator (run.py) or
on a live cluster (vllm_run.py, imported only for `--engine vllm`); writes the reports.

It sits above both engines' modules, so that vllm_run.py can take run.py's helpers without run.py
importing it back.
"""
from __future__ import annotations

from pathlib import Path

from .flags import FlagError
from .run import combine, fill_defaults, parse_policies, run_seed_sim, sim_setup


def bench(args) -> dict:
    """Run every policy on every seed, write DIR/bench.{json,md,png}, print the table."""
    from tqdm import tqdm

    from .report import write_reports

    fill_defaults(args)
    policies = parse_policies(args.policies)
    seeds = list(args.seeds) if args.seeds is not None else [args.seed]  # (--seeds: cli_types.int_list)
    repeats = getattr(args, "repeats", 1)
    if repeats < 1 or (repeats > 1 and args.engine != "vllm"):
        raise FlagError(f"--repeats={repeats}: must be >= 1, and above 1 only with --engine vllm "
                        "(the simulator is deterministic)")
    if args.engine == "vllm":
        from .vllm_run import bench_vllm

        result, traces = bench_vllm(args, policies, seeds)
    else:
        cfg, cost = sim_setup(args)
        runs, traces = [], None
        with tqdm(total=len(seeds) * len(policies), desc="bench", unit="run") as bar:
            for seed in seeds:
                run, tr = run_seed_sim(args, seed, cost, cfg, policies, bar)
                runs.append(run)
                traces = traces or tr  # the plot shows the first seed
        result = combine(runs, seeds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = write_reports(result, traces, out)
    print(table)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return result
