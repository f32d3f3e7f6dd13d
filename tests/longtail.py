import math
import random

from rollout_cluster.types import SamplingSpec, SequenceRequest


def longtail_requests(prompts=16, samples=4, median=200, sigma_p=1.0, sigma_s=0.4, max_tokens=2048, seed=0,
                      prompt_range=(16, 64), with_ids=False):
    """A small rl-longtail batch (BENCHMARK.md) with hidden lengths."""
    rng = random.Random(seed)
    spec = SamplingSpec(max_tokens=max_tokens, ignore_eos=True)
    out = []
    for p in range(prompts):
        difficulty = rng.lognormvariate(math.log(median), sigma_p)
        plen = rng.randint(*prompt_range)
        ids = [rng.randrange(3, 1000) for _ in range(plen)] if with_ids else None
        for j in range(samples):
            length = int(min(max_tokens, max(16, rng.lognormvariate(math.log(difficulty), sigma_s))))
            out.append(SequenceRequest(ids, spec, p, j, hidden_length=length, prompt_len=plen))
    return out
