"""The RouterCore alone (no Ray): 110 batches of 64 sequences through fake replicas, fetched and
released; tracemalloc compares what it holds after batch 10 and after batch 110.

    PYTHONPATH=$PWD python experiments/soak/results-diag/router_core.py [policy]
"""
import gc, random, tracemalloc, sys
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress

policy = sys.argv[1] if len(sys.argv) > 1 else "steal"
core = RouterCore(make_policy(PolicyConfig(name=policy), load_profile("a100-80g-7b")), expected_replicas=2,
                  replica_timeout_s=1e9, record_tokens=True)
rids = ["r0", "r1"]
model = ModelInfo(vocab_size=2048, max_model_len=4096)
for rid in rids:
    core.on_report(Report(rid, "1", progress=[], stats=EngineStats(), model=model, capacity=64), 0.0)
rng = random.Random(0)
now = 0.0
held = {rid: [] for rid in rids}
def one_batch(seed):
    global now
    reqs = rl_longtail(LongtailSpec(prompts=16, samples=4, seed=seed), vocab_size=2048)
    for r in reqs:
        r.sampling = SamplingSpec(max_tokens=min(256, max(16, r.hidden_length or 64)), ignore_eos=True, logprobs=0)
    bid = core.submit(reqs, now)
    cursor, done = 0, False
    while not done:
        now += 0.05
        for rid in rids:
            progress, left = [], []
            for work, produced, length in held[rid]:
                n = min(8, length - produced)
                finish = "length" if produced + n >= length else None
                progress.append(SeqProgress(work.seq_id, work.attempt, [rng.randrange(2048) for _ in range(n)],
                                            [-rng.random() for _ in range(n)], finish, offset=produced))
                if finish is None:
                    left.append((work, produced + n, length))
            orders = core.on_report(Report(rid, "1", progress=progress, stats=EngineStats(), model=None, capacity=64), now)
            held[rid] = left + [(w, 0, w.sampling.max_tokens if hasattr(w, 'sampling') else core.seqs[w.seq_id].request.sampling.max_tokens) for w in orders.start]
        got, cursor, done = core.fetch(bid, cursor, now)
    core.release(bid)

tracemalloc.start(25)
for b in range(10):
    one_batch(b)
gc.collect()
s1 = tracemalloc.take_snapshot()
m1 = tracemalloc.get_traced_memory()[0]
for b in range(10, 110):
    one_batch(b)
gc.collect()
s2 = tracemalloc.take_snapshot()
m2 = tracemalloc.get_traced_memory()[0]
print("traced after 10:", m1, "after 110:", m2, "per batch:", (m2 - m1) / 100)
for st in s2.compare_to(s1, "traceback")[:8]:
    print(st.size_diff, st.count_diff)
    for line in st.traceback.format()[-12:]:
        print("   ", line)
print({k: len(v) for k, v in vars(core).items() if hasattr(v, "__len__") and not isinstance(v, str)})
print({k: len(v) for k, v in vars(core.batches).items() if hasattr(v, "__len__") and not isinstance(v, str)})
