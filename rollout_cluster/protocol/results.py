"""Router -> driver: what a sequence became. Completion (its tokens, with the replicas and
Migrations it went through) and Partial (a sample cut off, to continue in a later batch).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field, replace
from typing import Optional


@dataclass
class Partial:
    """A sample cut off before its end (finish_reason "abort": generate's finish_fraction, cancel),
    to continue in a later batch: pass it among a batch's prompts, where it stands for one sequence.
    Partial rollouts: an RL step need not wait for its longest samples; they finish in the next
    step, on newer weights for the tokens still to come (Completion.resumed_tokens says where)."""

    prompt_token_ids: list
    token_ids: list
    logprobs: Optional[list] = None
    # Which of its prompt's n samples it was: it is seeded as that sample (SamplingSpec.for_sample),
    # so that the samples of a group cut before their first token do not start again as one sample.
    sample_index: int = 0


def partials(prompts: list, completions: list) -> list:
    """The Partial of every completion that was cut off ("abort"), in order: `prompts` is what the
    batch was given (token lists, or Partials, whose prompt is then the original one)."""
    out = []
    for c in completions:
        if c.finish_reason != "abort":
            continue
        item = prompts[c.prompt_index]
        prompt = item.prompt_token_ids if isinstance(item, Partial) else list(item)
        sample = item.sample_index if isinstance(item, Partial) else c.sample_index  # its place in the first batch
        out.append(Partial(prompt, list(c.token_ids), None if c.logprobs is None else list(c.logprobs), sample))
    return out


@dataclass(frozen=True)
class Migration:
    """A segment boundary where the sequence left `source` and continued with prompt + partial."""
    source: str
    destination: Optional[str]  # None until the continuation starts somewhere
    at_token: int
    time_s: float  # seconds since the batch was submitted
    # "policy": the policy moved it. "replica_left": Serve stopped its replica, which handed it
    # back with every token. "replica_lost": its replica died or restarted; it continued from its
    # last reported tokens (what the replica made after its last report was generated again).
    # "router_restart": the router that ran it restarted; the new one took over its output so far.
    # "weights_update": an update with running="recompute" gave it up. "report_gap": a report of
    # its replica skipped tokens; it continued from the tokens the router held. "engine_error": its
    # engine ended it with a retryable error (router.engine_error_retries); it continued from its tokens.
    reason: str = "policy"


def _as_list(values):
    """An array (the router's compact storage) as a list; anything else unchanged."""
    return values.tolist() if isinstance(values, array) else values


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    token_ids: list
    logprobs: Optional[list]
    finish_reason: str
    error: Optional[str] = None
    replicas: list = field(default_factory=list)
    migrations: list = field(default_factory=list)
    batch_id: str = ""
    index: int = -1  # position in the submitted batch
    finish_time_s: float = 0.0  # seconds from the batch's submission to this sequence's end
    weights_version: int = 0  # the weights every segment ran with (RolloutClient.update_weights)
    # A resumed Partial: its first `resumed_tokens` tokens (and logprobs) came with the request,
    # generated in an earlier batch, maybe on older weights; `weights_version` is the rest's.
    resumed_tokens: int = 0
    # Which weights made which tokens: [offset, version] at each change, from its first generated
    # token on (after `resumed_tokens`). One entry unless the weights were updated while it ran
    # (update_weights / push_weights with running="recompute" or "keep").
    weight_versions: list = field(default_factory=list)

    def with_lists(self) -> "Completion":
        """This completion with plain lists: the router keeps finished tokens in compact arrays
        until they are fetched."""
        return replace(self, token_ids=_as_list(self.token_ids), logprobs=_as_list(self.logprobs))

    def to_json(self) -> dict:
        return {
            "prompt_index": self.prompt_index,
            "sample_index": self.sample_index,
            "token_ids": list(self.token_ids),
            "logprobs": None if self.logprobs is None else list(self.logprobs),
            "finish_reason": self.finish_reason,
            "error": self.error,
            "replicas": list(self.replicas),
            "migrations": [m.__dict__ for m in self.migrations],
            "finish_time_s": round(self.finish_time_s, 4),
            "weights_version": self.weights_version,
            "resumed_tokens": self.resumed_tokens,
            "weight_versions": [list(v) for v in self.weight_versions],
        }
