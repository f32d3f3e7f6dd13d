"""Benchmark workloads: the `rl-longtail` generator and trace CSV files (BENCHMARK.md).

Every request carries its true length in `hidden_length` and runs with `ignore_eos=True` under
the batch's `max_tokens` cap; only the engine adapter acts on the hidden length. Lengths depend
on the seed alone, never on whether token ids are drawn, so a simulated run and a vLLM run of
the same seed decode exactly the same sequences.
"""
from __future__ import annotations

import csv
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from ..protocol import SamplingSpec, SequenceRequest
from .flags import FlagError

MIN_LENGTH = 16
TRACE_HEADER = ("group", "prompt_tokens", "response_tokens")
FIRST_TOKEN_ID = 3  # ids below are left alone: special tokens (bos/eos/pad) of small vocabularies


@dataclass(frozen=True)
class LongtailSpec:
    """The `rl-longtail` parameters; the defaults are the seed scale of BENCHMARK.md."""

    prompts: int = 512
    samples: int = 16
    median: float = 1500.0
    sigma_prompt: float = 0.9
    sigma_sample: float = 0.5
    max_tokens: int = 16384
    seed: int = 0
    prompt_min: int = 256
    prompt_max: int = 1024

    def validate(self) -> "LongtailSpec":
        """The spec, or a FlagError naming the bench flag (each field is `--<field with dashes>`)."""
        checks = [("prompts", self.prompts >= 1, ">= 1"), ("samples", self.samples >= 1, ">= 1"),
                  ("median", 0 < self.median < math.inf, "> 0 and finite"),
                  ("sigma_prompt", 0 <= self.sigma_prompt < math.inf, ">= 0 and finite"),
                  ("sigma_sample", 0 <= self.sigma_sample < math.inf, ">= 0 and finite"),
                  ("max_tokens", self.max_tokens >= MIN_LENGTH, f">= {MIN_LENGTH}"),
                  ("prompt_min", 1 <= self.prompt_min <= self.prompt_max, f">= 1 and <= --prompt-max ({self.prompt_max})")]
        for name, ok, rule in checks:
            if not ok:
                flag = "--" + name.replace("_", "-")
                raise FlagError(f"{flag}={getattr(self, name)!r}: must be {rule} for the rl-longtail workload")
        return self

    def describe(self) -> dict:
        return {"workload": "rl-longtail", **asdict(self)}


def rl_longtail(spec: LongtailSpec = LongtailSpec(), vocab_size: Optional[int] = None, ids_salt: str = "") -> list:
    """P x n SequenceRequests, grouped by prompt, in prompt order.

    Per prompt, from random.Random(seed) in this order: difficulty ~ lognormal(ln M, σp), the
    prompt length ~ uniform integer in [prompt_min, prompt_max], then each sample's length
    ~ lognormal(ln difficulty, σs), truncated to an integer and clipped to [16, max_tokens].
    With `vocab_size`, prompts get random token ids from a second stream (seeded by the seed),
    for vLLM runs; without it, `prompt_token_ids` is None and only `prompt_len` is set (sim).
    `ids_salt` draws other ids for the same lengths: runs that follow each other on one engine
    then find nothing of the previous run in the prefix cache.
    """
    ids_rng = random.Random(f"rl-longtail-ids-{spec.seed}{ids_salt}")
    sampling = SamplingSpec(max_tokens=spec.max_tokens, ignore_eos=True)
    out = []
    for p, _, plen, lengths in _longtail_draws(spec):
        ids = random_prompt(ids_rng, plen, vocab_size) if vocab_size else None
        out += [SequenceRequest(ids, sampling, p, j, hidden_length=n, prompt_len=plen) for j, n in enumerate(lengths)]
    return out


def prompt_difficulties(spec: LongtailSpec = LongtailSpec()) -> list:
    """Each prompt's difficulty (the median of its length distribution) in the batch that
    `rl_longtail(spec)` draws. Benchmarks only: what a perfect per-prompt history would know."""
    return [difficulty for _, difficulty, _, _ in _longtail_draws(spec)]


def _longtail_draws(spec: LongtailSpec):
    """(prompt index, difficulty, prompt length, sample lengths) per prompt, in draw order."""
    spec.validate()
    rng = random.Random(spec.seed)
    for p in range(spec.prompts):
        try:
            difficulty = rng.lognormvariate(math.log(spec.median), spec.sigma_prompt)
            plen = rng.randint(spec.prompt_min, spec.prompt_max)
            lengths = [int(min(spec.max_tokens, max(MIN_LENGTH, rng.lognormvariate(math.log(difficulty),
                                                                                    spec.sigma_sample))))
                       for _ in range(spec.samples)]
        except (OverflowError, ValueError) as e:  # a length past what a float holds, or one of 0
            raise FlagError(f"--median={spec.median!r} with --sigma-prompt={spec.sigma_prompt!r} and --sigma-sample="
                            f"{spec.sigma_sample!r}: prompt {p}'s lengths cannot be drawn ({e}); use a smaller median "
                            "or spread") from None
        yield p, difficulty, plen, lengths


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list:
    """`length` token ids drawn uniformly, avoiding the lowest (special) ids when the vocabulary allows."""
    low = FIRST_TOKEN_ID if vocab_size > FIRST_TOKEN_ID + 1 else 0
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def load_trace(path, max_tokens: Optional[int] = None, vocab_size: Optional[int] = None, seed: int = 0,
               ids_salt: str = "") -> list:
    """SequenceRequests from a CSV with the header `group,prompt_tokens,response_tokens`, one
    row per sequence. Rows of one group share a prompt (and its random ids, with `vocab_size`).
    `max_tokens` defaults to the longest response; `seed` and `ids_salt` pick the random ids.
    Raises FlagError naming the line and the problem for a missing or wrong header, a row with
    the wrong number of fields, a non-integer or out-of-range value, a response longer than
    `max_tokens`, or a group whose rows disagree on the prompt length."""
    rows = parse_trace(Path(path).read_text().splitlines(), str(path), max_tokens)
    if not rows:
        raise FlagError(f"{path}: no sequences after the header")
    cap = max_tokens or max(r[2] for r in rows)
    sampling = SamplingSpec(max_tokens=cap, ignore_eos=True)
    ids_rng = random.Random(f"trace-ids-{seed}{ids_salt}")
    index: dict = {}  # group name -> (prompt index, prompt ids, samples so far)
    out = []
    for group, plen, resp in rows:
        if group not in index:
            ids = random_prompt(ids_rng, plen, vocab_size) if vocab_size else None
            index[group] = [len(index), ids, 0]
        entry = index[group]
        out.append(SequenceRequest(entry[1], sampling, entry[0], entry[2], hidden_length=resp, prompt_len=plen))
        entry[2] += 1
    return out


def parse_trace(lines: list, name: str = "trace", max_tokens: Optional[int] = None) -> list:
    """[(group, prompt_tokens, response_tokens)] from CSV lines; blank lines are skipped.
    Line numbers in errors are 1-based file lines."""
    reader = csv.reader(lines)
    rows = []
    prompt_of_group: dict = {}
    header_seen = False
    for lineno, fields in enumerate(reader, start=1):
        if not fields or all(not f.strip() for f in fields):
            continue
        fields = [f.strip() for f in fields]
        if not header_seen:
            if tuple(fields) != TRACE_HEADER:
                raise FlagError(f"{name}: line {lineno}: header must be {','.join(TRACE_HEADER)}, got {','.join(fields)}")
            header_seen = True
            continue
        if len(fields) != 3:
            raise FlagError(f"{name}: line {lineno}: expected 3 fields (group,prompt_tokens,response_tokens), got {len(fields)}")
        group = fields[0]
        if not group:
            raise FlagError(f"{name}: line {lineno}: group is empty")
        plen = _int_field(fields[1], "prompt_tokens", 1, name, lineno)
        resp = _int_field(fields[2], "response_tokens", 1, name, lineno)
        if max_tokens is not None and resp > max_tokens:
            raise FlagError(f"{name}: line {lineno}: response_tokens={resp} exceeds max_tokens={max_tokens}")
        if prompt_of_group.setdefault(group, plen) != plen:
            raise FlagError(f"{name}: line {lineno}: group {group!r} has prompt_tokens={plen}, "
                            f"but an earlier row of it has {prompt_of_group[group]}")
        rows.append((group, plen, resp))
    if not header_seen:
        raise FlagError(f"{name}: line 1: empty file; expected the header {','.join(TRACE_HEADER)}")
    return rows


def _int_field(text: str, field: str, minimum: int, name: str, lineno: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise FlagError(f"{name}: line {lineno}: {field}={text!r} is not an integer") from None
    if value < minimum:
        raise FlagError(f"{name}: line {lineno}: {field}={value} must be >= {minimum}")
    return value


def write_trace(requests: list, path) -> None:
    """The inverse of load_trace (without token ids): one row per sequence."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TRACE_HEADER)
        for r in requests:
            w.writerow([r.prompt_index, r.prompt_len, r.hidden_length])


def summary(requests: list) -> dict:
    """Sequences, generated tokens, the longest and how many sit at the cap."""
    lengths = [r.hidden_length for r in requests]
    cap = max((r.sampling.max_tokens for r in requests), default=0)
    return {"sequences": len(requests), "generated_tokens": sum(lengths), "longest": max(lengths, default=0),
            "at_cap": sum(1 for n in lengths if n >= cap)}
