"""`rollout-cluster` and the Ray job refuse bad arguments and configs with one line naming the
flag (or key) and the value, exit code 2, and no traceback, before they start or join a cluster.
Ray is never reached here: starting, joining or connecting fails the test."""
import json
import math

import pytest

from rollout_cluster import cli
from rollout_cluster.client.client import RolloutClient
from rollout_cluster.jobs import rollout as job

ROOT_CONFIG = "configs/local-cpu.yaml"


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    import ray

    def never(*args, **kw):
        pytest.fail("reached Ray before refusing the arguments")
    monkeypatch.setattr(RolloutClient, "start", classmethod(never))
    monkeypatch.setattr(RolloutClient, "connect", classmethod(never))
    monkeypatch.setattr(ray, "init", never)


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n")
    return str(path)


def refused(capsys, argv, said: str, run=cli.main, also: str = "") -> None:
    try:
        rc = run(argv)
    except SystemExit as e:  # argparse's refusal
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert said in err and also in err and "Traceback" not in err, err


def test_a_bad_config_is_one_line_naming_it_not_a_traceback(capsys, tmp_path, src):
    """Regression: a ConfigError (a missing file, an unknown key, a value out of range) left
    `rollout-cluster generate` / `serve` and the Ray job as a traceback."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas: 0\n")
    out = str(tmp_path / "out.jsonl")
    refused(capsys, ["generate", "--config", "nope.yaml", "--input", src, "--output", out],
            "config file 'nope.yaml' does not exist")
    refused(capsys, ["generate", "--config", str(bad), "--input", src, "--output", out], "replicas=0: must be >= 1")
    refused(capsys, ["serve", str(bad)], "replicas=0: must be >= 1")
    refused(capsys, ["--config", str(bad), "--input", src, "--output", out], "replicas=0: must be >= 1", job.main)


def test_generate_checks_its_files_and_numbers_before_starting_a_cluster(capsys, tmp_path, src):
    """Regression: `rollout-cluster generate` started (or joined) the cluster first, and only then
    found a missing input, an output it could not write, or --finish-fraction 2 / --timeout-s -1,
    with a traceback, minutes later; the Ray job deployed the app first."""
    out = str(tmp_path / "out.jsonl")
    for run, base in [(cli.main, ["generate", "--config", ROOT_CONFIG]), (cli.main, ["generate", "--app-name", "x"]),
                      (job.main, ["--config", ROOT_CONFIG])]:
        refused(capsys, base + ["--input", str(tmp_path / "none.jsonl"), "--output", out], "input=", run)
        refused(capsys, base + ["--input", src, "--output", str(tmp_path / "no" / "out.jsonl")],
                "output=", run)
        for flag, value in [("--finish-fraction", "2"), ("--finish-fraction", "0"), ("--finish-fraction", "nan"),
                            ("--timeout-s", "-1"), ("--timeout-s", "0"), ("--timeout-s", "inf")]:
            refused(capsys, base + ["--input", src, "--output", out, flag, value], f"argument {flag}: ", run,
                    also=repr(value))
    refused(capsys, ["--config", ROOT_CONFIG, "--input", src, "--output", out, "--ready-timeout-s", "-5"],
            "argument --ready-timeout-s: ", job.main)


@pytest.mark.parametrize("argv", [["update-weights", "ckpt"], ["sleep"], ["wake"], ["scale", "2"], ["weights-digest"]],
                         ids=lambda a: a[0])
@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_a_fleet_command_refuses_a_timeout_that_is_no_wait(capsys, argv, value):
    """Regression: --timeout-s -1 (or 0, nan) was taken: update-weights and sleep sent their order,
    then failed at once with a TimeoutError (the order still carried out), scale set its target."""
    refused(capsys, argv + ["--timeout-s", value, "--address", "ray://nowhere:1"],
            f"argument --timeout-s: must be a finite number of seconds > 0, not {value!r}")


def test_the_numbers_parse_as_before():
    assert cli.seconds("1.5") == 1.5 and cli.fraction("0.9") == 0.9 and cli.fraction("1") == 1.0
    for bad in ("-1", "0", "nan", "inf", "soon"):
        with pytest.raises(Exception, match="must be a finite number of seconds > 0"):
            cli.seconds(bad)
    assert not math.isnan(cli.seconds("600"))


@pytest.mark.parametrize("call", ["update_weights", "push_weights", "sleep", "wake", "scale", "weights_digest",
                                  "wait_ready"])
@pytest.mark.parametrize("bad", [-1, 0, math.nan, math.inf, "10"])
def test_the_drivers_fleet_operations_refuse_a_timeout_that_is_no_wait(call, bad):
    """The same for RolloutClient: the check comes before any call to the router."""
    from rollout_cluster.protocol import InputError

    client = object.__new__(RolloutClient)  # no router: reaching it fails
    args = {"update_weights": ("ckpt",), "push_weights": ([],), "scale": (2,), "wait_ready": (2,)}.get(call, ())
    with pytest.raises(InputError, match=r"^timeout_s=.*: must be a finite number of seconds > 0$"):
        getattr(client, call)(*args, timeout_s=bad)


@pytest.mark.parametrize("state, uses_it", [("RUNNING", True), ("UNHEALTHY", True), ("DEPLOYING", True),
                                            ("DEPLOY_FAILED", False), ("DELETING", False), (None, False)])
def test_the_job_uses_a_running_service_that_is_replacing_a_replica(monkeypatch, state, uses_it):
    """Regression: the Ray job took an app of its name for a running service only while Serve
    called it RUNNING. While Serve replaced a replica (an engine that died fails its health check:
    the app is UNHEALTHY until the new one is up) or applied a scale, a job redeployed the
    long-lived service over itself (a new router and new engines: other drivers' batches lost),
    then deleted it when it ended."""
    from types import SimpleNamespace

    from ray import serve
    from ray.serve.schema import ApplicationStatus

    apps = {} if state is None else {"rollout": SimpleNamespace(status=ApplicationStatus(state))}
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications=apps))
    assert job._app_running("rollout") is uses_it


def test_generate_refuses_a_config_with_an_app_that_runs(capsys, tmp_path, src):
    """Regression: `generate --config C --app-name X` joined X and ignored C without a word (X runs
    with the config it was deployed with: its engine, policy and sampling defaults). Both flags
    at once are refused, naming them, before Ray."""
    refused(capsys, ["generate", "--config", ROOT_CONFIG, "--app-name", "x", "--input", src, "--output",
                     str(tmp_path / "out.jsonl")], f"--config {ROOT_CONFIG}", also="--app-name x")


def test_a_bench_flag_is_refused_in_one_line_naming_it(capsys, tmp_path):
    """Regression: a bench command's bad flag value (`overhead --only`, `bench --policies`) came out
    as a traceback of a ValueError; now one line and exit code 2, before any engine starts."""
    out = str(tmp_path / "o")
    refused(capsys, ["overhead", "--config", "configs/cpu-bench.yaml", "--seeds", "0,2", "--rounds", "2",
                     "--only", "1:0", "--out", out], "rollout-cluster overhead: error: --only '1:0': not a pair of")
    refused(capsys, ["overhead", "--config", "configs/cpu-bench.yaml", "--only", "0-1", "--out", out],
            "--only '0-1': each pair is SEED:ROUND")
    refused(capsys, ["bench", "--policies", "nope", "--out", out], "--policies='nope': unknown nope; choose from")
    trace = tmp_path / "t.csv"
    trace.write_text("group,prompt_tokens,response_tokens\ng,4\n")
    refused(capsys, ["bench", "--trace", str(trace), "--out", out], "line 2: expected 3 fields")


@pytest.mark.parametrize("argv, call", [(["scale", "3", "--timeout-s", "1"], "scale"),
                                        (["update-weights", "ckpt", "--timeout-s", "1"], "update_weights"),
                                        (["sleep", "--timeout-s", "1"], "sleep")], ids=lambda a: str(a))
def test_a_fleet_command_out_of_time_says_what_the_fleet_is_at_in_one_line(capsys, monkeypatch, argv, call):
    """A fleet that is not there in time (the driver's TimeoutError: where the fleet is, what stays
    ordered) is one line and exit code 1, not a traceback."""
    said = "scale: the fleet is not at 3 after 1 s: 2 replicas pull from the router. The target stays 3"

    class Late:
        def __getattr__(self, name):
            def late(*args, **kw):
                assert name == call
                raise TimeoutError(said)
            return late

    monkeypatch.setattr(cli, "_attach", lambda a: Late())
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 1 and err.strip() == f"rollout-cluster {argv[0]}: error: {said}" and "Traceback" not in err, err
