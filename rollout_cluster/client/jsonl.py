"""The stable batch file formats of `rollout-cluster generate` and the Ray job.

Input, one JSON object a line: {"prompt_token_ids": [..], "n": 1, "max_tokens": 128, "temperature": 1.0,
"top_p": 1.0, "ignore_eos": false, "logprobs": null, "stop_token_ids": [], "seed": null}; all but
prompt_token_ids optional (max_tokens, temperature and top_p default to the config's `sampling`).
A line may name its multi-turn session ("session": "agent-7"): its samples go to the replica that ran
the session's previous turn while it has room (router/sessions.py). A line may resume a partial rollout (resume.py): "output_token_ids" (and "output_logprobs" when
logprobs are asked for) are the tokens an earlier batch cut off; such a line is one sample (n 1).
Output, one line per (line, sample) in input order: {"prompt_index",
"sample_index", "token_ids", "logprobs", "finish_reason", "error", "replicas", "migrations",
"finish_time_s", "weights_version", "resumed_tokens", "weight_versions"}; an output line with finish_reason "abort"
(`--finish-fraction`) resumes as an input line with its token_ids and logprobs as the output_ fields,
and its sample_index (so that a seeded sample keeps its own seed). The app's HTTP route POST /<app>/generate takes and returns the same.
A bad line yields one output line with finish_reason "error" naming the field and the value
(`temperature=-1: must be a finite number >= 0`, or `line 3=...` when it is no JSON object); the
rest still run. Refused besides a wrong value: a field given twice, an unknown field, true or false
where a number is meant, NaN, Infinity and numbers beyond a double (1e999), integers past 64 bits,
and nesting past the parser's depth (parsing.py). Ranges are vLLM's own (protocol.SamplingSpec.validate,
validation.py): temperature >= 0, top_p in (0, 1], top_k >= -1, min_p in [0, 1], penalties (repetition > 0,
presence and frequency in [-2, 2]), logprobs up to the engine's max_logprobs, seeds within 64 bits,
resumed output_logprobs finite numbers <= 0.
"""
from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Optional

from ..parsing import DuplicateKeyError, NestingError, load_json, shown
from ..config.models import LimitsConfig
from ..protocol import Completion, InputError, LimitExceeded, SamplingSpec, SequenceRequest, is_int64
from ..validation import check_prompt, check_request

SPEC_FIELDS = {f.name for f in fields(SamplingSpec)}
RESUME_FIELDS = ("output_token_ids", "output_logprobs")
# "sample_index" on a line of one sample (one that resumes, say): seeded as that sample (seed + index)
LINE_FIELDS = {"prompt_token_ids", "session", "sample_index"} | SPEC_FIELDS | set(RESUME_FIELDS)


def parse_line(text: str, index: int, defaults: Optional[dict] = None) -> tuple:
    """(prompt_token_ids, SamplingSpec, {output_token_ids, output_logprobs, session}); raises InputError naming
    the field. `defaults`: SamplingSpec fields for what the line leaves out (the config's `sampling`
    section). The rules are validation.py's; the router checks again with the engine's limits."""
    try:
        obj = load_json(text)
    except json.JSONDecodeError as e:
        raise InputError(f"line {index + 1}", text.strip()[:40], f"not valid JSON ({e.msg})") from None
    except DuplicateKeyError as e:
        raise InputError(e.key, e.value, "given twice in one object: which one is meant?") from None
    except NestingError:
        raise InputError(f"line {index + 1}", text.strip()[:40], "nested too deeply") from None
    if not isinstance(obj, dict):
        raise InputError(f"line {index + 1}", obj, "must be a JSON object")
    unknown = sorted(set(obj) - LINE_FIELDS)
    if unknown:
        raise InputError(unknown[0], obj[unknown[0]], f"unknown field (known: {', '.join(sorted(LINE_FIELDS))})")
    if "prompt_token_ids" not in obj:
        raise InputError("prompt_token_ids", None, "is required")
    ids = obj["prompt_token_ids"]
    if ids is None:  # None is a simulated prompt to check_prompt; a line must give its tokens
        raise InputError("prompt_token_ids", ids, "must be a non-empty list of token ids")
    check_prompt(ids)
    kw = dict(defaults or {})
    kw.update((k, v) for k, v in obj.items() if k in SPEC_FIELDS and v is not None or k in ("logprobs", "seed"))
    for k in ("prompt_token_ids", "session", "sample_index") + RESUME_FIELDS:
        kw.pop(k, None)
    if "stop_token_ids" in kw:
        if not isinstance(kw["stop_token_ids"], list):
            raise InputError("stop_token_ids", kw["stop_token_ids"], "must be a list of integers")
        kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    spec = SamplingSpec(**kw)
    spec.validate()
    extra = {k: obj.get(k) for k in RESUME_FIELDS}
    if extra["output_token_ids"] == [] and extra["output_logprobs"] in ([], None):
        # an "abort" line cut before its first token: it starts afresh (as a Partial of none does)
        extra["output_token_ids"] = extra["output_logprobs"] = None
    extra["session"] = obj.get("session")
    if extra["output_token_ids"] is not None and spec.n != 1:
        raise InputError("n", spec.n, "must be 1 on a line that resumes output_token_ids: it is one sample")
    sample = obj.get("sample_index")
    if sample is not None:
        if not is_int64(sample) or sample < 0:
            raise InputError("sample_index", sample, "must be an integer >= 0")
        if spec.n != 1:
            raise InputError("sample_index", sample, f"names one sample: the line's n must be 1, not {spec.n}")
        spec = spec.for_sample(sample)  # seeded as the sample it resumes
    check_request(SequenceRequest(ids, spec, index, 0, **extra))  # the resumed output and session, before the router
    return ids, spec, extra, sample or 0


def read_requests(lines: list, defaults: Optional[dict] = None, limits: Optional[LimitsConfig] = None) -> tuple:
    """(requests, errors): requests expanded prompt-major; errors maps line index -> message.
    `defaults`: as for parse_line. `limits` (the config's): a line with n past limits.max_n is an
    error line; a batch past limits.max_lines or limits.max_batch_sequences raises LimitExceeded
    before it is expanded further."""
    limits = limits or LimitsConfig()
    if len(lines) > limits.max_lines:
        raise LimitExceeded("limits.max_lines", f"{len(lines)} lines: at most limits.max_lines={limits.max_lines} "
                                                f"a batch (split it)")
    requests, errors = [], {}
    for i, line in enumerate(lines):
        if not line.strip():
            errors[i] = str(InputError(f"line {i + 1}", line, "is empty: expected a JSON object"))
            continue
        try:
            ids, spec, extra, first = parse_line(line, i, defaults)
        except InputError as e:
            errors[i] = str(e)
            continue
        except Exception as e:  # a value no rule foresaw: this line fails, never the others
            errors[i] = f"line {i + 1}: invalid request ({type(e).__name__}: {shown(str(e))})"
            continue
        if spec.n > limits.max_n:
            errors[i] = f"n={spec.n}: at most limits.max_n={limits.max_n} samples per prompt"
            continue
        if len(requests) + spec.n > limits.max_batch_sequences:
            raise LimitExceeded("limits.max_batch_sequences",
                                f"line {i + 1} takes the batch past limits.max_batch_sequences="
                                f"{limits.max_batch_sequences} sequences (split it)")
        for j in range(spec.n):  # (a line that names its sample_index is that one sample, seeded as it)
            requests.append(SequenceRequest(ids, spec.for_sample(j), i, first + j, **extra))
    return requests, errors


def merge_results(num_lines: int, requests: list, completions: list, errors: dict) -> list:
    """Output records in input order: each line's samples, or its one error record."""
    by_line: dict = {}
    for req, c in zip(requests, completions):
        by_line.setdefault(req.prompt_index, []).append(c.to_json())
    out = []
    for i in range(num_lines):
        if i in errors:
            out.append(Completion(i, 0, [], None, "error", errors[i]).to_json())
        else:
            out.extend(by_line.get(i, []))
    return out


def write_jsonl(path: str, records: list) -> None:
    """Written beside `path` and moved into place once whole: a writer stopped halfway leaves no
    shorter file that reads as the whole batch, and an older output stays until then."""
    part = f"{path}.part-{os.getpid()}"
    try:
        with open(part, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.remove(part)


def split_lines(text: str) -> list:
    """JSONL's lines: split at "\n" (a "\r" before it dropped), never where str.splitlines also
    splits (U+2028, U+2029, U+0085, ...), characters JSON allows raw inside a string."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the last line's newline
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_jsonl_lines(path: str) -> list:
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        return split_lines(f.read())


def check_paths(input_path: str, output_path: str) -> None:
    """InputError naming `input` or `output` unless the input is a file this process can read and
    the output one it can write: checked before a batch runs, not found once its results are in."""
    if not os.path.isfile(input_path):
        raise InputError("input", input_path, "no file there" if not os.path.exists(input_path) else "is not a file")
    if not os.access(input_path, os.R_OK):
        raise InputError("input", input_path, "cannot be read (permissions)")
    folder = os.path.dirname(os.path.abspath(output_path))
    if os.path.isdir(output_path):
        raise InputError("output", output_path, "is a folder: name a file")
    if not os.path.isdir(folder):
        raise InputError("output", output_path, f"its folder does not exist ({folder})")
    if not os.access(folder, os.W_OK) or (os.path.exists(output_path) and not os.access(output_path, os.W_OK)):
        raise InputError("output", output_path, "cannot be written (permissions)")


def run_jsonl(client, input_path: str, output_path: str, progress: bool = True,
              timeout_s: Optional[float] = None, weights_version: Optional[int] = None,
              finish_fraction: Optional[float] = None, finish_by: str = "sample") -> dict:
    check_paths(input_path, output_path)
    lines = read_jsonl_lines(input_path)
    config = getattr(client, "config", None)  # its limits, where the client knows the app's config
    requests, errors = read_requests(lines, client.sampling_defaults(), config.limits if config else None)
    completions = client.run_requests(requests, progress=progress, timeout_s=timeout_s,
                                      weights_version=weights_version, finish_fraction=finish_fraction,
                                      finish_by=finish_by) if requests else []
    records = merge_results(len(lines), requests, completions, errors)
    write_jsonl(output_path, records)
    return {"lines": len(lines), "sequences": len(requests), "bad_lines": len(errors),
            "errors": sum(1 for r in records if r["finish_reason"] == "error"),
            "cut_off": sum(1 for r in records if r["finish_reason"] == "abort")}
