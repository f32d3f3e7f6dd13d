"""Small rl-longtail batches for tests: the package's own generator (bench/workloads.py)."""
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail


def longtail_requests(prompts=16, samples=4, median=200, sigma_p=1.0, sigma_s=0.4, max_tokens=2048, seed=0,
                      prompt_range=(16, 64), with_ids=False):
    """CPU scale of BENCHMARK.md by default; hidden lengths set; token ids only if `with_ids`."""
    spec = LongtailSpec(prompts, samples, float(median), sigma_p, sigma_s, max_tokens, seed, *prompt_range)
    return rl_longtail(spec.validate(), vocab_size=1000 if with_ids else None)
