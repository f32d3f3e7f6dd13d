from pathlib import Path

import pytest

from rollout_cluster.config import ClusterConfig, ConfigError, PolicyConfig, RouterConfig, load_config, to_dict
from rollout_cluster.policy import make_policy
from rollout_cluster.policy.registry import BENCH_POLICIES, POLICY_NAMES, REGISTRY

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["local-cpu.yaml", "a100x32.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.replicas >= 1 and cfg.engine.max_num_seqs >= 1


def test_a100x32_is_32_gpu_replicas():
    cfg = load_config(ROOT / "configs" / "a100x32.yaml")
    assert (cfg.replicas, cfg.resources.num_gpus, cfg.engine.max_num_seqs) == (32, 1, 256)


def test_relative_model_path_resolves_against_repo(tmp_path):
    cfg = load_config(ROOT / "configs" / "local-cpu.yaml")
    assert cfg.base_dir == str(ROOT)


def test_paths_in_a_nested_configs_folder_resolve_against_the_project(tmp_path):
    """configs/experiments/*.yaml name models/ and configs/profiles/ as the top-level configs do."""
    cfg = load_config(ROOT / "configs" / "experiments" / "cpu-bench-affine-evidence.yaml")
    assert cfg.base_dir == str(ROOT)
    assert cfg.profile_path() == str(ROOT / "configs" / "profiles" / "cpu-bench-cluster.yaml")
    (tmp_path / "elsewhere").mkdir()
    outside = tmp_path / "elsewhere" / "c.yaml"
    outside.write_text("replicas: 1\n")
    assert load_config(outside).base_dir == str(tmp_path / "elsewhere")


@pytest.mark.parametrize("data, fragment", [
    ({"replicas": 0}, "replicas=0"),
    ({"replica": 2}, "replica: unknown key"),
    ({"engine": {"max_num_seqs": "many"}}, "engine.max_num_seqs='many'"),
    ({"engine": {"modle": "x"}}, "engine.modle: unknown key"),
    ({"engine": {"kind": "tpu"}}, "engine.kind='tpu'"),
    ({"sampling": {"max_tokens": -5}}, "sampling.max_tokens=-5"),
    ({"policy": {"name": "random"}}, "policy.name='random'"),
    ({"policy": {"spread_chunk": 0}}, "policy.spread_chunk=0: must be >= 1"),
    ({"router": {"max_pulls_per_s": 0}}, "router.max_pulls_per_s=0.0: must be > 0"),
    ({"router": {"max_ongoing_requests": 5}, "replicas": 2}, "router.max_ongoing_requests=5"),
    ({"engine": {"enable_prefix_caching": "yes"}}, "engine.enable_prefix_caching='yes'"),
    ({"engine": 3}, "engine=3: must be a mapping"),
    ({"engine": {"max_num_seqs": True}}, "engine.max_num_seqs=True: must be of type int"),
    ({"router": {"pull_wait_s": "0.1"}}, "router.pull_wait_s='0.1': must be of type float"),
    ({"router": {"pull_wait_s": 0}}, "router.pull_wait_s=0.0: must be in (0, 5]"),
    ({"router": {"replica_timeout_s": 8, "idle_pull_wait_s": 4}},
     "router.idle_pull_wait_s=4.0: must be <= min(5, router.replica_timeout_s / 4) = 2"),
    ({"router": {"abandoned_batch_s": 5}}, "router.abandoned_batch_s=5.0: must be 0 (never) or >= 10"),
    ({"engine": {"niceness": 20}}, "engine.niceness=20: must be null or in [-20, 19]"),
    ({"sampling": {"max_tokens": 4096}}, "sampling.max_tokens=4096: must be < engine.max_model_len = 4096"),
    ({"engine": {"sim_profile": "no-such-profile"}}, "engine.sim_profile='no-such-profile': must be a built-in"),
    ({"policy": {"name": "pull", "chunk_tokens": 5}}, "policy.chunk_tokens: a setting of policy 'chunked', not of 'pull'"),
    ({"policy": {"min_gain_s": 1, "chunk_tokens": 5}}, "policy.chunk_tokens: a setting of policy 'chunked', not of 'steal'"),
    ({"policy": {"name": "chunked", "chunk_size": 5}}, "policy.chunk_size: unknown key (known: chunk_tokens, name)"),
    ({"policy": {"name": "scripted", "scripted_at_tokens": [10, "x"]}}, "policy.scripted_at_tokens[1]='x': must be of type int"),
    ({"policy": "steal"}, "policy='steal': must be a mapping"),
    ({"\\": None}, '"\\\\": unknown key'),
    ({"engine": {"a.b": 1}}, 'engine."a.b": unknown key'),
    ({"x" * 100: 1}, '"' + "x" * 64 + '"...: unknown key'),
])
def test_bad_config_names_key_and_value(data, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(data)
    assert fragment in str(e.value)


def test_bad_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("replicas: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_int_accepted_for_float():
    cfg = load_config({"router": {"pull_wait_s": 1}})
    assert cfg.router.pull_wait_s == 1.0


@pytest.mark.parametrize("replicas, expected", [(1, 0.2), (32, 0.2), (64, 0.4), (256, 1.6), (10_000, 5.0)])
def test_report_interval_grows_with_the_fleet_past_the_pull_budget(replicas, expected):
    assert RouterConfig(report_interval_s=0.2, max_pulls_per_s=160).report_interval_for(replicas) == pytest.approx(expected)


def test_report_interval_stays_under_a_quarter_of_the_replica_timeout():
    router = RouterConfig(report_interval_s=0.5, max_pulls_per_s=10, replica_timeout_s=8.0)
    assert router.report_interval_for(10) == pytest.approx(1.0)
    assert router.report_interval_for(1000) == pytest.approx(2.0)  # a slower report would look dead


@pytest.mark.parametrize("replicas, expected", [(2, 1.0), (160, 1.0), (320, 2.0), (10_000, 5.0)])
def test_idle_pulls_are_held_longer_past_the_pull_budget(replicas, expected):
    assert RouterConfig(idle_pull_wait_s=1.0, max_pulls_per_s=160).idle_pull_wait_for(replicas) == pytest.approx(expected)


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ConfigError) as e:
        load_config({"policy": {"name": "random"}})
    assert all(repr(name) in str(e.value) for name in POLICY_NAMES)


def test_every_broken_rule_is_reported():
    with pytest.raises(ConfigError) as e:
        load_config({"replicas": 0, "metrics": {"port": -1}})
    assert "replicas=0" in str(e.value) and "metrics.port=-1" in str(e.value)


def test_policy_is_the_named_policys_settings():
    cfg = load_config({"policy": {"name": "chunked", "chunk_tokens": 64}})
    assert (type(cfg.policy).__name__, cfg.policy.chunk_tokens) == ("ChunkedConfig", 64)
    assert load_config({"policy": {"min_gain_s": 1}}).policy.name == "steal"  # no name: the default policy
    assert PolicyConfig(name="scripted", scripted_at_tokens=[3]).scripted_at_tokens == [3]
    with pytest.raises(ConfigError, match="policy.spread_chunk: a setting of policy 'steal', not of 'pull'"):
        PolicyConfig(name="pull", spread_chunk=2)


CLUSTER_CONFIGS = sorted(p for p in (ROOT / "configs").glob("**/*.yaml") if p.parent.name != "profiles")


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_round_trips_through_a_plain_dict(path):
    cfg = load_config(path)
    assert load_config(to_dict(cfg)) == cfg  # what Serve deployments receive and load again


def test_code_that_changes_a_config_is_checked_again():
    cfg = load_config({"replicas": 2})
    cfg.router.max_ongoing_requests = 4
    with pytest.raises(ConfigError, match="router.max_ongoing_requests=4"):
        cfg.validate()
    fixed = cfg.model_copy(update={"replicas": 1, "router": RouterConfig(max_ongoing_requests=9)})
    assert isinstance(load_config(fixed), ClusterConfig)


def test_registry_feeds_the_bench_and_builds_every_policy():
    assert BENCH_POLICIES == ("static", "chunked", "least-loaded", "pull", "steal")  # the bench's columns, in order
    from rollout_cluster.bench.run import POLICIES

    assert POLICIES == BENCH_POLICIES
    for name, entry in REGISTRY.items():
        policy = make_policy(entry.settings())
        assert policy.name == name == entry.settings().name


def test_a_scheduler_that_vllm_would_refuse_is_refused_naming_both_keys():
    """Regression: engine.max_num_batched_tokens below engine.max_num_seqs passed load_config, and
    every engine then failed to start (vLLM's SchedulerConfig: "max_num_batched_tokens (256) must
    be greater than or equal to max_num_seqs (512)"), after the app was deployed and its model
    loading, as a Serve DEPLOY_FAILED."""
    with pytest.raises(ConfigError, match=r"^engine.max_num_batched_tokens=256: must be >= engine.max_num_seqs = 512"):
        load_config({"engine": {"max_num_seqs": 512, "max_num_batched_tokens": 256}})
    assert load_config({"engine": {"max_num_seqs": 512, "max_num_batched_tokens": 512}}).engine.max_num_seqs == 512


@pytest.mark.parametrize("vocab", [0, -5])
def test_a_simulated_vocabulary_has_a_token(vocab):
    """Regression: engine.sim_vocab_size took 0 and negative sizes: a simulated fleet then refused
    every prompt (no token id is below 0), or its engine divided by zero."""
    with pytest.raises(ConfigError, match=rf"^engine.sim_vocab_size={vocab}: must be >= 1"):
        load_config({"engine": {"kind": "sim", "sim_vocab_size": vocab}})


def test_a_batch_the_limits_allow_can_always_run_once_the_router_is_empty():
    """Regression: limits.max_live_sequences below limits.max_batch_sequences was taken. A batch
    between the two passed the batch limit and was then refused as a full router (RouterBusy: 429
    with Retry-After, 503 to TRL's routes) even by an empty router: its clients retried forever."""
    with pytest.raises(ConfigError, match=r"^limits.max_live_sequences=1000: must be >= limits.max_batch_sequences = 4096"):
        load_config({"limits": {"max_live_sequences": 1000, "max_batch_sequences": 4096}})
    assert load_config({"limits": {"max_live_sequences": 4096, "max_batch_sequences": 4096}}).limits.max_live_sequences == 4096
