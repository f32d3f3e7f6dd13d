"""GRPO's groups across partial rollouts: each prompt gets n samples; a batch is cut at
finish_fraction, and its unfinished samples (finish_reason "abort") are carried as `Partial`s
into the next step's batch, where they finish. A group trains once all its n samples are back.

Every sample must come back exactly once: each batch is checked to return one completion per
(prompt_index, sample_index) it was given, and each group slot to be filled once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from rollout_cluster import Partial, partials


@dataclass
class Sample:
    group: int  # the group (prompt) it belongs to
    slot: int  # its sample index within the group, 0..n-1
    prompt: list  # the prompt's token ids
    tokens: list  # every response token, those of earlier batches first
    logprobs: list  # the behaviour policy's logprob of each token (the engines' sampling logprobs)
    finish_reason: str  # "stop" (EOS) or "length"
    weights_version: int  # the weights the tokens after `resumed_tokens` came from
    resumed_tokens: int  # tokens carried from an earlier batch (generated on older weights)
    reward: float = 0.0  # filled by the trainer
    advantage: float = 0.0  # filled by the trainer


@dataclass
class Group:
    prompt: list  # the prompt's token ids
    step: int  # the step whose batch first carried it
    samples: list = field(default_factory=list)  # n slots, None until that sample is back

    def whole(self) -> bool:
        return all(s is not None for s in self.samples)


@dataclass
class BatchStats:
    sequences: int  # sequences submitted (n per new prompt, 1 per carried partial)
    returned: int  # completions back (must equal sequences)
    finished: int  # samples that ended ("stop" or "length")
    cut: int  # samples cut at finish_fraction, carried to the next step
    resumed: int  # carried partials of earlier steps among this batch's sequences
    resumed_tokens: int  # tokens those carried partials brought with them


class GroupBuffer:
    """Makes each step's batch (carried partials first, then new prompts) and files its
    completions into their groups; returns the groups that became whole."""

    def __init__(self, n: int):
        self.n = n
        self.groups: dict[int, Group] = {}  # groups not yet whole
        self.carry: list[tuple[Partial, int, int]] = []  # (partial, group, slot) for the next batch
        self.next_group = 0
        self.filled: set[tuple[int, int]] = set()  # every (group, slot) ever filled
        # the batch in flight (batch() sets them, take() reads them):
        self._origin: list[tuple[int, int]] = []  # (group, slot) of each carried Partial, in batch order
        self._first_new = 0  # index of the first new prompt in the batch
        self._new_groups: list[int] = []  # the group of each new prompt

    def batch(self, new_prompts: list, step: int) -> list:
        """The prompts for this step's generate: the carried Partials, then `new_prompts`."""
        self._origin = [(g, s) for _, g, s in self.carry]
        self._first_new = len(self.carry)
        for p in new_prompts:
            self.groups[self.next_group] = Group(list(p), step, [None] * self.n)
            self.next_group += 1
        self._new_groups = list(range(self.next_group - len(new_prompts), self.next_group))
        items = [p for p, _, _ in self.carry] + [list(p) for p in new_prompts]
        self.carry = []
        return items

    def take(self, items: list, results: list) -> tuple[list[Group], BatchStats]:
        """File the completions of `items` (what batch() returned); the groups now whole leave the buffer."""
        expected = {(i, 0) for i in range(self._first_new)}
        expected |= {(i, j) for i in range(self._first_new, len(items)) for j in range(self.n)}
        seen = [(c.prompt_index, c.sample_index) for c in results]
        if len(seen) != len(set(seen)) or set(seen) != expected:
            dup = len(seen) - len(set(seen))
            raise RuntimeError(f"batch of {len(expected)} sequences came back as {len(seen)} completions "
                               f"({dup} duplicated, {len(expected - set(seen))} missing)")
        bad = [c for c in results if c.finish_reason == "error"]
        if bad:
            raise RuntimeError(f"{len(bad)} samples failed, first: {bad[0].error}")
        short = [c for c in results if len(c.logprobs or []) != len(c.token_ids)]
        if short:  # the loss needs the behaviour logprob of every token
            c = short[0]
            raise RuntimeError(f"prompt {c.prompt_index} sample {c.sample_index}: {len(c.token_ids)} tokens but "
                               f"{len(c.logprobs or [])} logprobs (sampling.logprobs must be 0)")
        cut = [c for c in results if c.finish_reason == "abort"]
        for partial, c in zip(partials(items, results), cut):  # partials() keeps the cut ones' order
            self.carry.append((partial, *self._slot(c)))
        finished = 0
        for c in results:
            if c.finish_reason == "abort":
                continue
            g, s = self._slot(c)
            if (g, s) in self.filled:
                raise RuntimeError(f"group {g} sample {s} came back twice")
            self.filled.add((g, s))
            self.groups[g].samples[s] = Sample(g, s, self.groups[g].prompt, list(c.token_ids), list(c.logprobs or []),
                                               c.finish_reason, c.weights_version, c.resumed_tokens)
            finished += 1
        whole = [g for g, grp in self.groups.items() if grp.whole()]
        stats = BatchStats(sequences=len(expected), returned=len(results), finished=finished, cut=len(cut),
                           resumed=self._first_new, resumed_tokens=sum(len(p.token_ids) for p in items[:self._first_new]))
        return [self.groups.pop(g) for g in whole], stats

    def _slot(self, c) -> tuple[int, int]:
        if c.prompt_index < self._first_new:
            return self._origin[c.prompt_index]
        return self._new_groups[c.prompt_index - self._first_new], c.sample_index

    def pending(self) -> int:
        """Samples still out (carried to the next batch)."""
        return len(self.carry)
