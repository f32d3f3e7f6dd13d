"""Decode-step cost model shared by the simulator, SimEngine and the steal policy.

step_s(B, C) = a + c * C + e * B, with B sequences in the batch and C context tokens among
them (weights read once per step: a; KV read per context token: c; per-sequence work: e).
Pure: no clock, no I/O besides loading a YAML profile.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml


@dataclass(frozen=True)
class CostModel:
    name: str
    a: float  # s per step
    c: float  # s per context token per step
    e: float  # s per sequence per step
    prefill_tokens_per_s: float
    kv_tokens: int  # KV capacity in tokens; past it the engine preempts
    max_num_seqs: int = 256
    source: str = ""

    def step_s(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.a + self.c * context_tokens + self.e * batch

    def decode_run(self, batch: int, context_tokens: int, max_steps: int, budget_s: float = math.inf) -> tuple:
        """(k, seconds) for k decode steps of an unchanged batch whose context grows by `batch`
        tokens a step: the most steps (at least one, at most `max_steps`) that fit in `budget_s`.
        Step j costs a + e*B + c*(C + B*j), so k steps cost k*base + c*B*k(k-1)/2."""
        base = self.a + self.e * batch + self.c * context_tokens
        grow = self.c * batch
        k = max_steps
        if budget_s < math.inf and k > 1:
            if grow > 0:  # largest k with k*base + grow*k(k-1)/2 <= budget
                disc = (base - grow / 2) ** 2 + 2 * grow * budget_s
                k_fit = int((-(base - grow / 2) + math.sqrt(max(0.0, disc))) / grow)
            else:
                k_fit = int(budget_s / base)
            k = max(1, min(k, k_fit))
        return k, k * base + grow * k * (k - 1) / 2

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def to_yaml(self) -> str:
        return yaml.safe_dump(asdict(self), sort_keys=False)


# Derivations: docs/cost_model.md. The H200 numbers are least-squares fits of vLLM 0.26.0
# measurements (shared/profiles/calib-qwen2.5-*.json); the A100 one comes from specifications.
PROFILES = {
    "a100-80g-7b": CostModel(
        name="a100-80g-7b", a=10.1e-3, c=3.8e-8, e=1.43e-5, prefill_tokens_per_s=15_000,
        kv_tokens=1_000_000, max_num_seqs=256,
        source="public specs: 15.2 GB bf16 weights and 57 KB/token KV at ~1.5 TB/s effective",
    ),
    "h200-7b": CostModel(
        name="h200-7b", a=4.60e-3, c=1.44e-8, e=1.43e-5, prefill_tokens_per_s=47_000,
        kv_tokens=1_912_944, max_num_seqs=256,
        source="fit of vLLM 0.26.0 on one H200, dummy Qwen2.5-7B, bf16 (shared/profiles)",
    ),
    "h200-7b-calibrated": CostModel(
        name="h200-7b-calibrated", a=4.462e-3, c=1.507e-8, e=1.352e-5, prefill_tokens_per_s=46_956,
        kv_tokens=1_914_048, max_num_seqs=256,
        source="`rollout-cluster calibrate` on one H200 of this project's GPU run: vLLM 0.26.0, dummy "
               "Qwen2.5-7B, bf16 (configs/profiles/h200-7b-calibrated.yaml; max rel. error 9.5 %)",
    ),
    "h200-1.5b": CostModel(
        name="h200-1.5b", a=1.99e-3, c=5.49e-9, e=2.06e-5, prefill_tokens_per_s=196_000,
        kv_tokens=4_274_528, max_num_seqs=256,
        source="fit of vLLM 0.26.0 on one H200, dummy Qwen2.5-1.5B, bf16 (shared/profiles)",
    ),
}


def load_profile(name_or_path: str, max_num_seqs: int | None = None) -> CostModel:
    """A built-in profile by name, or a YAML file written by `rollout-cluster calibrate`."""
    if name_or_path in PROFILES:
        model = PROFILES[name_or_path]
    else:
        path = Path(name_or_path)
        if not path.exists():
            raise ValueError(
                f"profile={name_or_path!r}: neither a built-in profile ({', '.join(PROFILES)}) nor a file"
            )
        data = yaml.safe_load(path.read_text())
        try:
            model = CostModel(**data)
        except TypeError as e:
            raise ValueError(f"profile file {name_or_path!r}: {e}") from e
    if max_num_seqs is not None:
        model = replace(model, max_num_seqs=max_num_seqs)
    return model
