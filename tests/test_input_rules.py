"""Issue 24's input rules, one named regression test each: what escaped the JSONL parser or
RouterCore.submit, what was accepted that vLLM refuses, and the config file's own rules."""
import json

import pytest

from rollout_cluster.client.jsonl import read_requests
from rollout_cluster.config import ConfigError, PolicyConfig, load_config
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import InputError, ModelInfo, Report, SamplingSpec, SequenceRequest
from rollout_cluster.router.core import RouterCore

MODEL = ModelInfo(1000, 64, max_logprobs=5, max_temperature=2.0)


def core_with(model=MODEL) -> RouterCore:
    core = RouterCore(make_policy(PolicyConfig(name="pull"), load_profile("h200-1.5b", max_num_seqs=4)), 1, 1e9)
    core.on_report(Report("a", "a-1", model=model, capacity=4), 0.0)
    return core


def error_of(line: str) -> str:
    reqs, errors = read_requests([line])
    assert not reqs and list(errors) == [0], (line[:80], errors)
    return errors[0]


def test_an_integer_literal_over_4300_digits_is_one_bad_line_not_an_escape():
    assert error_of('{"prompt_token_ids": [1], "n": ' + "7" * 5000 + "}") == (
        "n=<integer of 5000 digits>: must be an integer >= 1")
    assert error_of('{"prompt_token_ids": [' + "7" * 5000 + "]}").startswith("prompt_token_ids=<integer of 5000")


def test_deep_nesting_is_one_bad_line_not_an_escape():
    deep = "[" * 100_000 + "]" * 100_000
    assert "nested too deeply" in error_of(deep) and error_of(deep).startswith("line 1=")
    reqs, errors = read_requests([deep, json.dumps({"prompt_token_ids": [1]})])
    assert list(errors) == [0] and [r.prompt_index for r in reqs] == [1]  # the valid line still runs


def test_a_null_token_id_names_the_field_and_its_index():
    assert error_of('{"prompt_token_ids": [1, null]}') == (
        "prompt_token_ids=None: every token id must be an integer (at index 1)")


def test_duplicate_keys_are_refused():
    assert error_of('{"prompt_token_ids": [1], "n": 2, "n": 3}').startswith("n=3: given twice")


@pytest.mark.parametrize("field, value, message", [
    ("temperature", "true", "temperature=True: must be a finite number >= 0"),
    ("temperature", "NaN", "temperature=nan: must be a finite number >= 0"),
    ("top_p", "Infinity", "top_p=inf: must be a number in (0, 1]"),
    ("top_p", "1e999", "top_p=inf: must be a number in (0, 1]"),
    ("n", "true", "n=True: must be an integer >= 1"),
    ("max_tokens", "99999999999999999999", "max_tokens=99999999999999999999: must be an integer >= 1"),
    ("top_k", "-2", "top_k=-2: must be an integer >= -1"),
    ("repetition_penalty", "-Infinity", "repetition_penalty=-inf: must be a finite number > 0"),
    ("presence_penalty", "2.5", "presence_penalty=2.5: must be a number in [-2, 2]"),
    ("frequency_penalty", "NaN", "frequency_penalty=nan: must be a number in [-2, 2]"),
    ("seed", str(2**63), f"seed={2**63}: must be null or an integer in [-2**63, 2**63)"),
    ("logprobs", "false", "logprobs=False: must be null or an integer >= 0"),
    ("stop_token_ids", "[2, -1]", "stop_token_ids=-1: every stop token id must be an integer >= 0"),
])
def test_vllms_ranges_booleans_and_non_finite_numbers_are_refused_naming_the_field(field, value, message):
    assert error_of('{"prompt_token_ids": [1], "%s": %s}' % (field, value)).startswith(message)


@pytest.mark.parametrize("logprobs, message", [
    ("[null]", "output_logprobs=None: every logprob must be a finite number <= 0 (at index 0)"),
    ("[NaN]", "output_logprobs=nan: every logprob"),
    ("[0.5]", "output_logprobs=0.5: every logprob"),
    ("[-1e999]", "output_logprobs=-inf: every logprob"),
])
def test_bad_resumed_logprobs_are_refused_by_the_reader(logprobs, message):
    line = '{"prompt_token_ids": [1], "max_tokens": 8, "logprobs": 0, "output_token_ids": [3], "output_logprobs": %s}'
    assert error_of(line % logprobs).startswith(message)


def test_submit_of_a_null_resumed_logprob_fails_that_sequence_and_registers_the_rest():
    """Regression: SeqState.resume raised TypeError after the batch was registered: the caller got
    an error while the valid sequences ran on, orphaned."""
    core = core_with()
    bad = SequenceRequest([1], SamplingSpec(max_tokens=8, logprobs=0), 0, 0, output_token_ids=[3],
                          output_logprobs=[None])
    good = SequenceRequest([1], SamplingSpec(max_tokens=8), 1, 0)
    bid = core.submit([bad, good], 1.0)
    (c,), _, _ = core.fetch(bid, 0)
    assert c.finish_reason == "error" and c.error.startswith("output_logprobs=None")
    assert len(core.seqs) == 1


def test_submit_refuses_a_malformed_batch_before_registering_anything():
    core = core_with()
    req = SequenceRequest([1], SamplingSpec(), 0, 0)
    for kwargs, fragment in [({"previous_ids": [["x"]]}, "previous_ids"), ({"batch_id": ["b"]}, "batch_id")]:
        with pytest.raises(InputError, match=fragment):
            core.submit([req], 1.0, **kwargs)
    req.prompt_index = [0]  # unhashable: its group could not be keyed
    with pytest.raises(InputError, match=r"requests\[0\].prompt_index"):
        core.submit([req], 1.0)
    assert not core.seqs and not core.batches.live


def test_without_a_model_token_ids_past_32_bits_fail_their_sequence_only():
    core = core_with(model=None)  # (no replica reported a model: the check is the router's own bound)
    reqs = [SequenceRequest([1], SamplingSpec(max_tokens=8), 0, 0, output_token_ids=[2**40]),
            SequenceRequest([1], SamplingSpec(max_tokens=8), 1, 0)]
    bid = core.submit(reqs, 1.0)
    (c,), _, _ = core.fetch(bid, 0)
    assert c.error.startswith(f"output_token_ids={2**40}: token id outside [0, 2147483648)")


@pytest.mark.parametrize("spec, message", [
    (SamplingSpec(logprobs=6), "logprobs=6: must be at most the engine's max_logprobs=5"),
    (SamplingSpec(temperature=2.5), "temperature=2.5: must be at most 2"),
])
def test_the_engines_own_limits_are_checked_by_the_router(spec, message):
    core = core_with()
    bid = core.submit([SequenceRequest([1], spec, 0, 0)], 1.0)
    (c,), _, _ = core.fetch(bid, 0)
    assert c.finish_reason == "error" and c.error.startswith(message)


@pytest.mark.parametrize("text, message", [
    ("router:\n  replica_timeout_s: .inf\n", "router.replica_timeout_s=inf: must be a finite number"),
    ("resources:\n  num_gpus: .nan\n", "resources.num_gpus=nan: must be a finite number"),
    ("policy:\n  min_gain_s: .inf\n", "policy.min_gain_s=inf: must be a finite number"),
    ("engine:\n  seed: 100000000000000000000\n", "engine.seed=100000000000000000000: must be an integer in"),
    ("engine:\n  seed: " + "9" * 5000 + "\n", "engine.seed=<integer of 5000 digits>: must be an integer in"),
    ("policy:\n  name: scripted\n  scripted_at_tokens: [1, 100000000000000000000]\n",
     "policy.scripted_at_tokens=[1, 100000000000000000000]: must be an integer in"),
    ("engine:\n  model: ''\n", "engine.model='': must be non-empty"),
    ("replicas: 2\nreplicas: 3\n", "replicas: key given twice (lines 1 and 2)"),
    ("engine:\n  seed: 1\n  seed: 2\n", "engine.seed: key given twice (lines 2 and 3)"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{k}: &{k} [{', '.join(['*' + p] * 10)}]\n" for p, k in zip("abcd", "bcde")),
     "aliases expand to more than 10,000 values"),
    ("a: &a [*a]\n", "an alias refers to the node that holds it"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("app_name: 2024-13-45\n", "month must be in 1..12"),
])
def test_config_files_refuse_infinities_long_integers_duplicates_and_alias_bombs(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value)


def test_aliases_and_merge_keys_within_the_bound_still_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("router: &r {replica_timeout_s: 40.0}\nengine: {<<: {seed: 3, max_num_seqs: 8}, seed: 4}\n")
    cfg = load_config(path)
    assert cfg.engine.seed == 4 and cfg.engine.max_num_seqs == 8 and cfg.router.replica_timeout_s == 40.0


def test_the_http_route_answers_every_bad_line_with_its_own_error_line_and_runs_the_rest():
    """Regression: a 5,000-digit integer or deep nesting in one line raised inside the route (500),
    and every line of the body was lost."""
    from starlette.testclient import TestClient

    from rollout_cluster.serve.gateway import gateway_app
    from test_partial_rollouts import CuttingRouter

    bad = ['{"prompt_token_ids": [1], "n": ' + "7" * 5000 + "}", "[" * 100_000 + "]" * 100_000,
           '{"prompt_token_ids": [1], "temperature": NaN}', '{"prompt_token_ids": [1], "n": 1, "n": 2}']
    body = ("\n".join(bad + [json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 8})]) + "\n").encode() + b"\xff\n"
    answer = TestClient(gateway_app(CuttingRouter(per_fetch=3), {}, 5.0)).post("/generate", content=body)
    lines = [json.loads(x) for x in answer.content.decode().splitlines()]
    assert answer.status_code == 200 and len(lines) == 6
    assert [o["finish_reason"] for o in lines] == ["error"] * 4 + ["length", "error"]
    assert [o["error"].split("=")[0] for o in lines if o["error"]] == ["n", "line 2", "temperature", "n", "line 6"]
