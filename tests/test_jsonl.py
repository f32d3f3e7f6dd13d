import json

from rollout_cluster.client.jsonl import merge_results, read_requests
from rollout_cluster.protocol import Completion


def test_lines_expand_to_samples_and_bad_lines_name_the_field():
    lines = [
        json.dumps({"prompt_token_ids": [1, 2, 3], "n": 2, "max_tokens": 8}),
        "{not json",
        json.dumps({"prompt_token_ids": [], "max_tokens": 8}),
        json.dumps({"prompt_token_ids": [1, "x"]}),
        json.dumps({"prompt_token_ids": [1], "max_tokens": -1}),
        json.dumps({"prompt_token_ids": [1], "n": 0}),
        json.dumps({"prompt_token_ids": [1], "temprature": 0.5}),
        json.dumps({"max_tokens": 3}),
        "",
        json.dumps({"prompt_token_ids": [4], "logprobs": None, "seed": None, "stop_token_ids": [2], "ignore_eos": True}),
    ]
    reqs, errors = read_requests(lines)
    assert [(r.prompt_index, r.sample_index) for r in reqs] == [(0, 0), (0, 1), (9, 0)]
    assert reqs[2].sampling.stop_token_ids == (2,) and reqs[2].sampling.ignore_eos is True
    assert "line 2" in errors[1] and "not valid JSON" in errors[1]
    assert errors[2].startswith("prompt_token_ids=[]")
    assert errors[3].startswith("prompt_token_ids='x'")
    assert errors[4].startswith("max_tokens=-1")
    assert errors[5].startswith("n=0")
    assert errors[6].startswith("temprature=0.5: unknown field")
    assert errors[7].startswith("prompt_token_ids=None: is required")
    assert "empty" in errors[8]
    comps = [Completion(r.prompt_index, r.sample_index, [7], None, "length") for r in reqs]
    out = merge_results(len(lines), reqs, comps, errors)
    assert [(o["prompt_index"], o["sample_index"], o["finish_reason"]) for o in out][:4] == [
        (0, 0, "length"), (0, 1, "length"), (1, 0, "error"), (2, 0, "error")]
    assert len(out) == 11 and out[-1]["prompt_index"] == 9
    assert set(out[0]) == {"prompt_index", "sample_index", "token_ids", "logprobs", "finish_reason", "error",
                           "replicas", "migrations", "finish_time_s", "weights_version", "resumed_tokens", "weight_versions"}


def test_the_configs_sampling_section_fills_what_a_line_leaves_out():
    from rollout_cluster.config import SamplingDefaults

    defaults = SamplingDefaults(max_tokens=24, temperature=0.7, top_p=0.9).spec_fields()
    lines = [json.dumps({"prompt_token_ids": [1, 2]}),
             json.dumps({"prompt_token_ids": [3], "max_tokens": 5, "temperature": 0.0, "top_p": 1.0}),
             json.dumps({"prompt_token_ids": [4], "max_tokens": None}),  # null: the default, as if left out
             json.dumps({"prompt_token_ids": [5], "min_tokens": 30})]  # checked against the default's 24
    reqs, errors = read_requests(lines, defaults)
    got = [(r.sampling.max_tokens, r.sampling.temperature, r.sampling.top_p) for r in reqs]
    assert got == [(24, 0.7, 0.9), (5, 0.0, 1.0), (24, 0.7, 0.9)]
    assert errors[3].startswith("min_tokens=30")
    plain, _ = read_requests(lines[:1])  # no config: SamplingSpec's own defaults
    assert plain[0].sampling.max_tokens == 128


class FileClient:
    """RolloutClient's face to run_jsonl, without a cluster: every sequence comes back `length`."""

    def __init__(self, config=None):
        self.config, self.batches = config, []

    def sampling_defaults(self) -> dict:
        return {}

    def run_requests(self, requests, **kw):
        self.batches.append(requests)
        return [Completion(r.prompt_index, r.sample_index, [7], None, "length") for r in requests]


def test_an_output_that_cannot_be_written_is_refused_before_the_batch_runs(tmp_path):
    """Regression: run_jsonl (rollout-cluster generate, the Ray job) opened --output only after
    the whole batch ran: an output in a folder that does not exist, or a folder itself, lost every
    result of the run to a FileNotFoundError at the end. It is checked first now, naming it, and
    so is the input."""
    import pytest

    from rollout_cluster.client.jsonl import run_jsonl
    from rollout_cluster.protocol import InputError

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n")
    client = FileClient()
    for out, why in [(tmp_path / "no-such-dir" / "out.jsonl", "its folder does not exist"),
                     (tmp_path, "is a folder")]:
        with pytest.raises(InputError, match=f"^output=.*{why}"):
            run_jsonl(client, str(src), str(out), progress=False)
    with pytest.raises(InputError, match="^input=.*no file"):
        run_jsonl(client, str(tmp_path / "missing.jsonl"), str(tmp_path / "out.jsonl"), progress=False)
    assert client.batches == []  # nothing ran
    assert run_jsonl(client, str(src), str(tmp_path / "out.jsonl"), progress=False)["sequences"] == 1


def test_an_output_is_whole_or_untouched(tmp_path, monkeypatch):
    """Regression: write_jsonl wrote the output in place, line by line: a job stopped (or failing)
    while it wrote left a shorter file that reads as a complete batch. It is written beside and
    moved into place once whole; an older output stays as it was until then."""
    import pytest

    from rollout_cluster.client import jsonl

    out = tmp_path / "out.jsonl"
    out.write_text('{"old": 1}\n')
    records = [{"i": 0}, {"i": 1}, {"i": object()}]  # the third cannot be written: the writer fails there
    with pytest.raises(TypeError):
        jsonl.write_jsonl(str(out), records)
    assert out.read_text() == '{"old": 1}\n' and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
    jsonl.write_jsonl(str(out), records[:2])
    assert out.read_text() == '{"i": 0}\n{"i": 1}\n'


def test_the_file_runner_applies_the_configs_limits():
    """Regression: run_jsonl read its lines under LimitsConfig's defaults, whatever the config said:
    a config that allows more lines or sequences than the defaults still had its files refused,
    naming the default (limits.max_lines=65536), and one that allows fewer samples per line had
    the line run."""
    import pytest

    from rollout_cluster.client.jsonl import run_jsonl
    from rollout_cluster.config import ClusterConfig, LimitsConfig
    from rollout_cluster.protocol import LimitExceeded

    import tempfile
    with tempfile.TemporaryDirectory() as d:
        src, out = f"{d}/in.jsonl", f"{d}/out.jsonl"
        with open(src, "w") as f:
            f.write(json.dumps({"prompt_token_ids": [1], "n": 4}) + "\n" + json.dumps({"prompt_token_ids": [2]}) + "\n")
        client = FileClient(ClusterConfig(limits=LimitsConfig(max_n=2)))
        summary = run_jsonl(client, src, out, progress=False)
        assert (summary["bad_lines"], summary["sequences"]) == (1, 1)
        assert "limits.max_n=2" in [json.loads(line) for line in open(out)][0]["error"]
        with open(src, "w") as f:
            f.write((json.dumps({"prompt_token_ids": [1]}) + "\n") * 65537)
        with pytest.raises(LimitExceeded, match="limits.max_lines=65536"):
            run_jsonl(FileClient(), src, out, progress=False)  # no config: the defaults
        summary = run_jsonl(FileClient(ClusterConfig(limits=LimitsConfig(max_lines=100000))), src, out, progress=False)
        assert summary["sequences"] == 65537


def test_lines_are_split_at_newlines_only(tmp_path):
    """Regression: the JSONL reader (the file runner and POST /generate) split lines with
    str.splitlines, which also breaks at U+2028, U+2029 and U+0085, characters JSON allows raw
    inside a string (a writer with ensure_ascii off leaves them so). A valid line with one in its
    session id became two bad lines, and every later line's output had the wrong prompt_index."""
    from starlette.testclient import TestClient

    from rollout_cluster.client.jsonl import read_jsonl_lines, run_jsonl
    from rollout_cluster.serve.gateway import gateway_app
    from test_router_restart import FakeRouter

    lines = [json.dumps({"prompt_token_ids": [1], "session": f"agent{sep}7"}, ensure_ascii=False)
             for sep in ("\u2028", "\u2029", "\u0085")] + [json.dumps({"prompt_token_ids": [2]})]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert read_jsonl_lines(str(src)) == lines
    src.write_bytes(("\r\n".join(lines) + "\r\n").encode())  # a file written on Windows
    assert read_jsonl_lines(str(src)) == lines
    summary = run_jsonl(FileClient(), str(src), str(out), progress=False)
    assert (summary["lines"], summary["bad_lines"]) == (4, 0)
    assert [json.loads(line)["prompt_index"] for line in open(out)] == [0, 1, 2, 3]
    app = TestClient(gateway_app(FakeRouter(per_fetch=8)))
    answer = app.post("/generate", content="\n".join(lines).encode())
    assert answer.status_code == 200, answer.text
    got = [json.loads(line) for line in answer.text.splitlines()]
    assert [(o["prompt_index"], o["finish_reason"]) for o in got] == [(i, "length") for i in range(4)]
