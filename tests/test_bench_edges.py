"""The benchmark package's pure parts at their edges (bench/): the balance bound never below the
lower bound, workload flags that cannot be drawn, a policy or seed listed twice, calibration's run
selection and output folder. No Ray, no vLLM engines, no simulator run."""
import json
import math

import pytest

from rollout_cluster.bench.bounds import balance_bound, lower_bound
from rollout_cluster.bench.flags import FlagError
from rollout_cluster.bench.run import parse_policies
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.protocol import SamplingSpec, SequenceRequest

COST = load_profile("a100-80g-7b")


def seq(prompt_index, sample_index, prompt, length):
    return SequenceRequest(None, SamplingSpec(max_tokens=4096, ignore_eos=True), prompt_index, sample_index,
                           hidden_length=length, prompt_len=prompt)


# ---- bounds.py ------------------------------------------------------------------------------
@pytest.mark.parametrize("replicas", [2, 4])
def test_balance_bound_is_at_least_the_longest_alone_when_the_longest_is_a_sibling(replicas):
    """balance_bound's docstring: "The result is at least the lower bound's longest alone", and
    lower_bound charges every sequence its prompt's prefill ("by it or by a sibling, cache or
    not"). But a sibling admitted with its group's first is floored at admitted_t + decode_alone_s
    only, while the fluid admission charges the shared prompt P / R / rate: with R > 1 and the long
    sequence a sibling, the 'balance bound' ends below the lower bound (31.43 s < 31.96 s here), so
    bench.json reports balance_bound_s < lower_bound_s."""
    reqs = [seq(0, 0, 8000, 16), seq(0, 1, 8000, 3000)]  # one prompt; its second sample is the long one
    longest = lower_bound(reqs, COST, replicas)["longest_alone_s"]
    assert balance_bound(reqs, COST, replicas) >= longest * (1 - 1e-12)


# ---- workloads.py ---------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, flag", [("sigma_prompt", math.inf, "--sigma-prompt"),
                                                ("median", 1e308, "--median")])
def test_rl_longtail_refuses_a_spread_or_median_it_cannot_draw_naming_the_flag(field, value, flag):
    """LongtailSpec.validate checks sigma_prompt >= 0 and median > 0 but not that they are finite or
    drawable: --sigma-prompt inf passes and _longtail_draws dies in math.log(0.0) ("math domain
    error"); --median 1e308 passes and lognormvariate overflows ("math range error"). Either is
    a traceback naming no flag, where every other bad workload flag is a FlagError naming it."""
    spec = LongtailSpec(prompts=64, samples=2, **{field: value})
    with pytest.raises(FlagError, match=flag):
        rl_longtail(spec)


# ---- run.py ---------------------------------------------------------------------------------
def test_policies_listed_twice_are_refused_naming_the_policy():
    """parse_policies accepts --policies pull,steal,pull. The simulator then overwrites pull's row
    with its second run; on vLLM with --repeats N, rows['pull'] gets 2N runs per seed and
    summarize_seed -> paired_pct raises "pull has 2N rounds, steal has N" only after every run of
    the seed has finished (hours on a GPU)."""
    with pytest.raises(FlagError, match="pull"):
        parse_policies("pull,steal,pull")


# ---- overhead.py ----------------------------------------------------------------------------
def test_overhead_refuses_a_seed_listed_twice_before_any_engine_starts(tmp_path, monkeypatch, capsys):
    """`overhead --seeds 0,0` runs seed 0's rounds twice with different orders (the rotation uses
    the seed's index), then reports two different pairs as "seed 0 round 0", folds both into
    per_seed_median_pct[0], and `--only 0:0` reruns both: pairs of one (seed, round) silently mix.
    It must be refused up front, naming --seeds, before the bare engines start."""
    import rollout_cluster.bench.overhead as overhead_mod
    from rollout_cluster.cli import main

    def no_engines(*args, **kwargs):
        raise AssertionError("--seeds 0,0 was accepted: the bare engines would start now")

    monkeypatch.setattr(overhead_mod, "BareEngines", no_engines)
    with pytest.raises(SystemExit) as e:  # argparse's refusal: usage, the error, exit status 2
        main(["overhead", "--config", "configs/local-cpu.yaml", "--seeds", "0,0", "--rounds", "2",
              "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--seeds" in err and "'0,0' lists 0 more than once" in err


# ---- calibrate.py ---------------------------------------------------------------------------
def samples_of(model, scale=1.0):
    return [[b, 1000 * b + 37 * j, scale * model.step_s(b, 1000 * b + 37 * j)] for b in range(1, 7) for j in range(3)]


def from_samples_args(path, out, samples_of=None):
    from types import SimpleNamespace

    return SimpleNamespace(from_samples=str(path), base_profile="a100-80g-7b", samples_of=samples_of, name=None,
                           out=str(out))


def test_samples_of_one_seed_does_not_take_the_runs_of_seed_ten(tmp_path, capsys):
    """calibrate --samples-of selects runs by substring (`args.samples_of in k`): 'seed 1' (the
    form the help gives, keys 'seed S POLICY') also takes 'seed 10 pull', 'seed 11 ...', and
    'seed 0 pull r1' takes rounds r10.. of --repeats: the fit silently mixes seeds/rounds."""
    from rollout_cluster.bench.calibrate import calibrate_from_samples

    path = tmp_path / "step_samples.json"
    path.write_text(json.dumps({"seed 1 pull": samples_of(COST), "seed 10 pull": samples_of(COST, scale=3.0)}))
    out = tmp_path / "p.yaml"
    model = calibrate_from_samples(from_samples_args(path, out, samples_of="seed 1"))
    assert "seed 10" not in out.read_text().splitlines()[0]
    assert model.e == pytest.approx(COST.e, rel=1e-6) and model.c == pytest.approx(COST.c, rel=1e-6)


def test_calibrate_from_samples_creates_the_folder_of_its_output(tmp_path, capsys):
    """write_profile (calibrate from a live engine) makes --out's folder; calibrate_from_samples
    writes Path(args.out) directly, so --out new/dir/p.yaml ends in FileNotFoundError after the fit."""
    from rollout_cluster.bench.calibrate import calibrate_from_samples

    path = tmp_path / "step_samples.json"
    path.write_text(json.dumps({"seed 0 pull": samples_of(COST)}))
    out = tmp_path / "profiles" / "fitted.yaml"
    calibrate_from_samples(from_samples_args(path, out))
    assert out.exists() and "a:" in out.read_text()
