"""Bad input refused before anything starts: the config models, the CLI's arguments, RolloutClient's methods.

Each test names a way bad input used to get through (a review found them): a config value that
load_config took but that failed (or misbehaved) only once a cluster ran, a CLI flag whose bad
value was a traceback or was found only after a cluster (or a model, or a bare engine) started,
a client method that reached the router before checking its arguments. The project's rule: bad input gets a clear error naming
the field and the value, before anything starts; it never hangs or crashes the cluster.

No Ray, no vLLM engine: every path that would start or join one fails the test instead.
"""
import os

import pytest

from rollout_cluster import cli
from rollout_cluster.client.client import RolloutClient
from rollout_cluster.config import ConfigError, load_config


class Reached(BaseException):
    """A cluster, a bare engine or a model was about to be made before the arguments were refused."""


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    import ray

    import rollout_cluster.bench.overhead as overhead
    import rollout_cluster.demo as demo
    import rollout_cluster.model_maker as model_maker

    def never(what):
        def fail(*args, **kw):
            raise Reached(f"reached {what} before refusing the arguments")
        return fail

    monkeypatch.setattr(RolloutClient, "start", classmethod(never("RolloutClient.start")))
    monkeypatch.setattr(RolloutClient, "connect", classmethod(never("RolloutClient.connect")))
    monkeypatch.setattr(ray, "init", never("ray.init"))
    monkeypatch.setattr(model_maker, "make_model", never("make_model (writes a model)"))
    monkeypatch.setattr(overhead, "BareEngines", never("BareEngines (starts vLLM engines)"))
    monkeypatch.setattr(overhead, "BareEngine", never("BareEngine (starts a vLLM engine)"))
    monkeypatch.setattr(demo, "start_ray_quietly", never("start_ray_quietly"))


def refused(capsys, argv, said: str) -> None:
    """`rollout-cluster ARGV` refuses in one line naming `said`, exit code 2, no traceback, and
    before any cluster, model or engine is made."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own refusal
        rc = e.code
    except Reached as e:
        pytest.fail(f"rollout-cluster {' '.join(argv)}: {e}")
    except Exception as e:  # noqa: BLE001 (what the user gets: a traceback)
        pytest.fail(f"rollout-cluster {' '.join(argv)}: a traceback of {type(e).__name__}: {e}")
    err = capsys.readouterr().err
    assert rc == 2 and said in err and "Traceback" not in err, (rc, err)


# ---- config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["", "rollout/"])
def test_an_app_name_serve_cannot_deploy_is_refused_by_the_config(name):
    """app_name has no rule (engine.model has `non-empty`): '' and 'rollout/' pass load_config.
    RolloutClient.start / `rollout-cluster serve` / the Ray job then start Ray and call Serve's
    _run(name=app_name, route_prefix=f"/{app_name}") (serve/deploy.py), which raises
    RayServeException "Application name must a non-empty string." or ValueError "Invalid
    route_prefix '/rollout/', may not end with a trailing '/'" -- a traceback after Ray started,
    naming neither the key nor the config. Right: ConfigError `app_name=...` at load_config."""
    with pytest.raises(ConfigError, match=r"app_name="):
        load_config({"app_name": name})


def test_a_dtype_vllm_does_not_know_is_refused_by_the_config():
    """engine.dtype is a free string ("vLLM dtype (auto, bfloat16, float16, float32)"): a typo
    such as 'bfloat' passes load_config, goes to vLLM unchanged (engines/vllm_params.py) and every
    engine fails at start (vLLM's ModelConfig: dtype must be one of auto, half, float16, bfloat16,
    float, float32; "Unknown dtype: 'bfloat'"), after the app deployed and began loading the model,
    as a Serve DEPLOY_FAILED -- the same class as the max_num_batched_tokens regression in
    test_config.py. Right: ConfigError `engine.dtype='bfloat': must be one of [...]`."""
    with pytest.raises(ConfigError, match=r"engine\.dtype='bfloat'"):
        load_config({"engine": {"dtype": "bfloat"}})
    assert load_config({"engine": {"dtype": "bfloat16"}}).engine.dtype == "bfloat16"


def test_a_busy_pull_held_past_the_replica_timeout_is_refused():
    """router.pull_wait_s is only `in (0, 5]`, while idle_pull_wait_s and report_interval_s must be
    <= min(5, replica_timeout_s / 4). The router holds a busy replica's pull (no orders) for
    pull_wait_s (serve/router.py, pull); the replica bounds its pull by replica_timeout_s
    (serve/pull_loop.py) and the router declares dead any replica whose last pull arrived more than
    replica_timeout_s ago (router/fleet.py). With replica_timeout_s: 4 and pull_wait_s: 5 (taken)
    every busy replica is taken for dead while its pull is held: its sequences are requeued, its
    own pull call times out. Right: refused, naming router.pull_wait_s and its value."""
    with pytest.raises(ConfigError, match=r"router\.pull_wait_s=5\.0"):
        load_config({"router": {"replica_timeout_s": 4, "pull_wait_s": 5}})


def test_a_call_timeout_shorter_than_the_drivers_fetch_long_poll_is_refused():
    """router.call_timeout_s is only `> 0`. A driver's fetch long-polls the router for
    follower.FETCH_WAIT_S (1 s) when nothing is new, and the call is bounded by call_timeout_s
    (client/loops.py). With call_timeout_s 0.5 every such fetch raises TimeoutError, which
    router_gone() takes for a dead router: the follower pauses and, after call_timeout_s more,
    fails the batch with "the router has not answered ... since it died" while the router is
    healthy. Every generate/stream/HTTP batch longer than a second fails. Right: refused at
    load_config naming router.call_timeout_s (it must exceed the fetch's wait)."""
    from rollout_cluster.client.follower import FETCH_WAIT_S

    assert FETCH_WAIT_S > 0.5
    with pytest.raises(ConfigError, match=r"router\.call_timeout_s=0\.5"):
        load_config({"router": {"call_timeout_s": 0.5}})


def test_an_empty_checkpoint_root_is_refused():
    """security.checkpoint_roots takes '' as a root. From a file it becomes base_dir itself (the
    repository root: every folder in it may be loaded as weights); from a mapping it stays '' and
    check_under_roots resolves it with realpath('') -- the router process's working directory,
    whatever that is on its node. An empty root is no folder a trainer writes to: it silently
    widens where update_weights may load from. Right: ConfigError naming
    security.checkpoint_roots[0]=''."""
    from rollout_cluster.security.paths import check_under_roots

    assert check_under_roots(os.path.join(os.getcwd(), "anything"), [""])  # what '' allows today
    with pytest.raises(ConfigError, match=r"security\.checkpoint_roots"):
        load_config({"security": {"checkpoint_roots": [""]}})


# ---- the command line ------------------------------------------------------------------------

def test_make_model_refuses_an_unknown_arch_in_one_line(capsys, tmp_path):
    """`make-model DIR --arch nope`: write_arch_config raises ValueError, which refusing() does not
    catch: a traceback, exit code 1. Right: argparse choices (or a FlagError): one line naming
    --arch and the value, exit code 2."""
    refused(capsys, ["make-model", str(tmp_path / "m"), "--arch", "nope"], "nope")


@pytest.mark.parametrize("argv", [
    ["bench", "--seeds", "0,x"],
    ["overhead", "--config", "configs/cpu-bench.yaml", "--seeds", "0,x"],
], ids=lambda a: a[0])
def test_a_seed_that_is_no_integer_is_refused_in_one_line(capsys, tmp_path, argv):
    """`bench --seeds 0,x` and `overhead --seeds 0,x` parse with int() unguarded (bench/main.py,
    bench/overhead.py): "ValueError: invalid literal for int() with base 10: 'x'", a traceback.
    (--only is refused by name, test_cli_args.py; --seeds is not.) Right: one line naming --seeds."""
    refused(capsys, argv + ["--out", str(tmp_path / "o")], "--seeds")


@pytest.mark.parametrize("replicas", ["0", "-2"])
def test_simulate_refuses_a_fleet_of_no_replicas_in_one_line(capsys, replicas):
    """`simulate --replicas 0` ends in ZeroDivisionError (bench/bounds.py: work / replicas), and
    `--replicas -2` runs the simulation to a NoLiveReplicaError traceback (cluster_config ignores
    a falsy --replicas; sim_setup keeps it). Right: one line naming --replicas, exit code 2."""
    refused(capsys, ["simulate", "--replicas", replicas, "--prompts", "4", "--samples", "2"], "--replicas")


def test_simulate_refuses_an_unknown_profile_in_one_line(capsys):
    """`simulate --profile nope`: load_profile's ValueError ("profile='nope': neither a built-in
    profile ... nor a file") comes out as a traceback, exit code 1. Right: one line, exit code 2."""
    refused(capsys, ["simulate", "--profile", "nope", "--prompts", "4", "--samples", "2"], "nope")


def test_overhead_without_a_config_is_refused_in_one_line(capsys, tmp_path):
    """`overhead --out DIR` (no --config; README shows it as required): cluster_config returns None
    and overhead() dies with "AttributeError: 'NoneType' object has no attribute 'engine'".
    Right: one line saying overhead needs --config, exit code 2."""
    refused(capsys, ["overhead", "--out", str(tmp_path / "o")], "--config")


def test_overhead_refuses_zero_replicas_instead_of_running_one(capsys, tmp_path):
    """`overhead --replicas 0`: `args.replicas or 1` makes it 1 and the run starts (bare engines,
    then the cluster) with one replica, though `--replicas -1` is refused ("must be at least 1").
    Right: 0 is refused as -1 is, before any engine starts."""
    refused(capsys, ["overhead", "--config", "configs/cpu-bench.yaml", "--replicas", "0",
                     "--out", str(tmp_path / "o")], "--replicas")


def test_calibrate_without_an_engine_to_measure_is_one_line(capsys, tmp_path):
    """`calibrate --out F` with neither --config nor --from-samples raises a plain ValueError
    ("calibrate needs --config ...") that refusing() does not catch: a traceback. Right: a
    FlagError (one line, exit code 2)."""
    refused(capsys, ["calibrate", "--out", str(tmp_path / "p.yaml")], "--config")


def test_generate_checks_weights_version_before_starting_a_cluster(capsys, tmp_path):
    """`generate --config C --weights-version -1` starts the cluster (minutes: every engine loads),
    and only the router refuses the batch ("weights_version=-1: must be an integer >= 0"), as
    --finish-fraction 2 and --timeout-s -1 were before their regression (test_cli_args.py).
    Right: refused at once, naming --weights-version."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_token_ids": [1, 2]}\n')
    refused(capsys, ["generate", "--config", "configs/local-cpu.yaml", "--input", str(src), "--output",
                     str(tmp_path / "out.jsonl"), "--weights-version", "-1"], "--weights-version")


@pytest.mark.parametrize("argv, flag", [
    (["weights-sync", "--rounds", "0"], "--rounds"),
    (["weights-sync", "--bucket-mb", "0"], "--bucket-mb"),
    (["weights-sync", "--bucket-mb", "nan"], "--bucket-mb"),
    (["multiturn", "--turns", "1"], "--turns"),
    (["multiturn", "--timeout-s", "-1"], "--timeout-s"),
    (["protocol-overhead", "--timeout-s", "nan"], "--timeout-s"),
    (["overhead", "--config", "configs/cpu-bench.yaml", "--rounds", "0"], "--rounds"),
    (["overhead", "--config", "configs/cpu-bench.yaml", "--timeout-s", "-1"], "--timeout-s"),
    (["bench", "--engine", "vllm", "--config", "configs/cpu-bench.yaml", "--timeout-s", "-1"], "--timeout-s"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_the_cluster_bench_tools_check_their_numbers_before_starting_anything(capsys, tmp_path, argv, flag):
    """These tools take their numbers unchecked (type=int / float) and start a model, bare engines
    or a cluster first. Then: weights-sync --rounds 0 runs the whole setup and ends in
    median([]) -> IndexError; --bucket-mb 0 / nan fail in push_weights (bucket_bytes=0, or
    int(nan)) after the cluster is up; multiturn --turns 1 ends in median([]) after its first
    run; a timeout of -1 or nan is refused by the driver only after the cluster started. Right:
    each refused in one line naming its flag, before anything starts (as generate's flags are)."""
    refused(capsys, argv + ["--out", str(tmp_path / "o")], flag)


# ---- RolloutClient ---------------------------------------------------------------------------

def _no_router_client() -> RolloutClient:
    return object.__new__(RolloutClient)  # no router: reaching it raises AttributeError


@pytest.mark.parametrize("kw, field", [({"bucket_bytes": 0}, "bucket_bytes"), ({"bucket_bytes": "256MB"}, "bucket_bytes"),
                                       ({"running": "finsh"}, "running")])
def test_push_weights_checks_its_arguments_before_the_fleet_is_waited_for(kw, field):
    """push_weights checks transport, stream, version and timeout_s up front ("before the fleet is
    waited for and the model put", fleet_ops.py), but not bucket_bytes nor running: before_update
    first polls the router (with running="finish" it waits for every running sequence to end, up
    to timeout_s = 600 s), then bucket_bytes is refused by buckets.checked, and a misspelt running
    only by the router, after the tensors were put in the object store. Right: refused first,
    naming the field, without a router call."""
    with pytest.raises((ValueError, TypeError), match=field):
        _no_router_client().push_weights([], **kw)


@pytest.mark.parametrize("kw, field", [({"version": -1}, "version"), ({"version": "3"}, "version"),
                                       ({"running": "finsh"}, "running")])
def test_update_weights_checks_its_arguments_before_the_fleet_is_waited_for(kw, field):
    """update_weights sends version and running unchecked: before_update polls the router first
    (and with running="finish" waits for the running batch to end), then the router refuses them.
    push_weights checks `version` up front; update_weights should check both as well."""
    with pytest.raises(ValueError, match=field):
        _no_router_client().update_weights("ckpt", **kw)


@pytest.mark.parametrize("bad", [0, -1, "2", True, 1.5])
def test_wait_ready_names_a_bad_replica_count(bad):
    """wait_ready(replicas) checks timeout_s but not replicas: wait_ready(0) returns at once with
    no replica up, wait_ready("2") fails with a bare TypeError ('>=' between int and str) after
    its first status call. Right: InputError `replicas=...: must be an integer >= 1`, as scale()."""
    from rollout_cluster.protocol import InputError

    with pytest.raises(InputError, match=r"^replicas="):
        _no_router_client().wait_ready(bad, timeout_s=1)


def test_the_serve_builder_refuses_an_empty_config_path(monkeypatch):
    """`serve run ... rollout_cluster.serve.app:build config=` (an empty path, as from an unset
    shell variable: config=$CONFIG) reaches build({"config": ""}); `args.pop("config") or args`
    then takes the remaining (empty) args for the config mapping and deploys every default
    (models/tiny-llama, 2 replicas, no checkpoint roots) without a word. Right: ConfigError
    naming config=''."""
    import rollout_cluster.serve.app as app

    built = []
    monkeypatch.setattr(app, "build_app", lambda cfg: built.append(cfg) or "app")
    with pytest.raises(ConfigError, match="config"):
        app.build({"config": ""})
    assert not built, "deployed the default config"


@pytest.mark.parametrize("bad", [float("nan"), -1, "600"])
def test_start_checks_wait_ready_s_before_anything_starts(monkeypatch, bad):
    """RolloutClient.start(config, wait_ready_s=...) takes it unchecked (connect checks its wait_s;
    the Ray job's --ready-timeout-s is checked). deploy() exists to bound serve.run's wait
    ("a replica that no node can host would leave serve.run waiting forever"), but with NaN its
    deadline never passes (`time.monotonic() > nan` is False): the same unbounded wait; -1 deploys
    and removes the app at once; "600" is a TypeError raised after _run deployed the app, outside
    deploy's try (so deploy does not remove it), and start's _undo_start deletes only an app whose
    deploy returned: on a cluster it joined, the app and its engines are left behind. Right: InputError naming
    wait_ready_s, before secrets are made and Ray is started."""
    import rollout_cluster.security.local as local
    from rollout_cluster.client import lifecycle

    def never(*args, **kw):
        raise Reached("reached ensure_local_secrets (writes .secrets/) before refusing wait_ready_s")

    monkeypatch.setattr(local, "ensure_local_secrets", never)
    with pytest.raises(ValueError, match="wait_ready_s"):
        lifecycle.start(RolloutClient, {"engine": {"kind": "sim"}}, None, bad, {})
