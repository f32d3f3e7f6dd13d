"""The simulator's and the bench tools' inputs, found by a review: a sequence of hidden length 0
is bounded as the 1-token sequence the router runs; a pull interval that would never advance the
simulator's clock, and calibrate flags that would fail only after the engines ran, are refused by
name; the calibration's median error is the median. No Ray, no vLLM engines."""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout_cluster.bench.bounds import bounds
from rollout_cluster.bench.flags import FlagError
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import SamplingSpec, SequenceRequest
from rollout_cluster.sim.simulator import Simulation
from rollout_cluster.validation import check_request

ROOT = str(Path(__file__).resolve().parents[1])
COST = load_profile("a100-80g-7b")
SPEC = SamplingSpec(max_tokens=4096, ignore_eos=True)


def simulate(policy, requests, replicas, cost=COST, **kw):
    return Simulation(make_policy(PolicyConfig(name=policy), cost), cost, replicas, **kw).run(requests)


def test_lower_bound_holds_for_a_request_with_hidden_length_zero():
    """validation.check_positions accepts hidden_length=0, and the router runs it as a 1-token
    sequence (moves.py: max(1, hidden - generated)); bounds.request_shapes reads `hidden_length or
    max_tokens` and charges it 4096 tokens: the 'lower bound' is 1800x the real makespan."""
    reqs = [SequenceRequest(None, SPEC, i, 0, hidden_length=0, prompt_len=100) for i in range(4)]
    for r in reqs:
        check_request(r)  # accepted as valid input
    b = bounds(reqs, COST, 2)
    res = simulate("pull", reqs, 2)
    assert res.counters["generated_tokens"] == 4
    assert b["lower_bound_s"] <= res.makespan_s * (1 + 1e-9), (b, res.makespan_s)


CHILD = """
import sys
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import SamplingSpec, SequenceRequest
from rollout_cluster.sim.simulator import Simulation
cost = load_profile("a100-80g-7b")
reqs = [SequenceRequest(None, SamplingSpec(max_tokens=4096, ignore_eos=True), 0, 0, hidden_length=100, prompt_len=100)]
try:
    Simulation(make_policy(PolicyConfig(name="pull"), cost), cost, 2, pull_interval_s=float(sys.argv[1])).run(reqs)
except ValueError as e:
    print("refused:", e)
else:
    print("ran")
"""


@pytest.mark.parametrize("interval", ["0", "-0.5"])
def test_simulation_refuses_a_pull_interval_that_never_advances_time(interval):
    """Simulation checks host_slowdown but not pull_interval_s (bench/simulate --pull-interval).
    With 0, an idle replica is pushed back at the same virtual time and popped again forever; a
    negative one moves virtual time backwards. Either spins forever (max_virtual_s never trips,
    as time does not grow): it must be refused up front. Run in a child so the hang is bounded."""
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, interval], capture_output=True, text=True, timeout=15,
                             cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"Simulation(pull_interval_s={interval}) hung: still running after 15 s")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused:") and "pull_interval" in out.stdout, out.stdout


@pytest.mark.parametrize("flag, value", [("decode_tokens", 0), ("repeats", 0)])
def test_calibrate_refuses_flags_that_fail_only_after_the_engines_ran(flag, value, monkeypatch):
    """`calibrate --decode-tokens 0` divides by zero in measure() ((full - one) / decode_tokens),
    and `--repeats 0` takes min([]), both after the engines started and ran their warmups (minutes
    on a GPU). calibrate() checks --batches, --contexts and --engines up front, but not these."""
    import rollout_cluster.bench.calibrate as cal

    started = []

    async def fake_calibrate(*args):
        started.append(args)
        return None

    monkeypatch.setattr(cal, "_calibrate", fake_calibrate)
    args = SimpleNamespace(from_samples=None, config="configs/cpu-bench.yaml", batches="1,2", contexts="64",
                           decode_tokens=8, repeats=3, engines=1, name=None, out="unused.yaml")
    setattr(args, flag, value)
    with pytest.raises(FlagError):
        cal.calibrate(args)
    assert not started


def test_median_rel_error_of_an_even_number_of_samples_is_the_middle_pair_mean(monkeypatch):
    """calibrate.profile_from_samples reports `sorted(rel)[len(rel) // 2]` as the median relative
    error: for an even count that is the upper of the two middle values (the worse one), written
    into the profile's header and printed. repeats.median (the bench's own) averages them."""
    import numpy as np

    import rollout_cluster.bench.calibrate as cal
    from rollout_cluster.bench.repeats import median

    rel = np.array([0.01] * 5 + [0.21] * 5)  # ten samples: the middle pair is 0.01 and 0.21
    monkeypatch.setattr(cal, "fit_step", lambda rows, steps: ((COST.a, COST.c, COST.e), rel))
    samples = [(b, 1000 * b, COST.step_s(b, 1000 * b)) for b in range(1, 11)]
    _, info = cal.profile_from_samples(samples, COST, "x")
    assert info["median_rel_error"] == pytest.approx(median(list(rel)))  # 0.11, not 0.21
