"""A pull decision does not depend on the process's string-hash seed.

policy/pull.py take_for walked `{s.group for s in rep.seqs.values()}`: a set of (batch_id,
prompt_index) tuples, whose iteration order follows hash(batch_id), randomised per process
(PYTHONHASHSEED); it now walks them in the order they came. When the puller runs two groups that both still have fresh samples queued and
its limit takes only some of them, which group's sample it gets depends on that order: the same
router state, the same pulls, a different placement in another process. Reached with session
affinity: a session's samples kept for their home (kept_for_homes) leave its group partly
queued, and the home then leaves the fleet."""
import json
import os
import subprocess
import sys

SCENARIO = r'''
import json
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest
from rollout_cluster.router.core import RouterCore

core = RouterCore(make_policy(PolicyConfig(name="pull"), load_profile("h200-1.5b", max_num_seqs=8)),
                  expected_replicas=3, replica_timeout_s=100.0)
M = ModelInfo(1000, 4096)
def pull(rid, cap, now, progress=(), model=None):
    return core.on_report(Report(rid, "i1", progress=list(progress), stats=EngineStats(), model=model, capacity=cap), now)
pull("h", 1, 0.0, model=M)
core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=2), 0, 0, session="s")], 0.0, batch_id="turn1")
(w,) = pull("h", 1, 0.1).start
pull("h", 1, 0.2, [SeqProgress(w.seq_id, w.attempt, [7, 8], None, "length")])  # session "s" lives on "h"
pull("a", 8, 0.3, model=M)
pull("b", 8, 0.3, model=M)
sp = SamplingSpec(max_tokens=2)
core.submit([SequenceRequest([1, 2, 3], sp, 0, j, session="s") for j in range(3)]       # group 0, homed on "h"
            + [SequenceRequest([4, 5, 6], sp, 1, j) for j in range(4)], 0.4, batch_id="turn2")  # group 1
first = pull("a", 8, 0.5).start  # one turn of group 0 kept for "h" (one free slot), then the head
core.remove_replica("h", 0.6)
second = pull("a", 8, 0.7, [SeqProgress(first[0].seq_id, 1, [7, 8], None, "length")]).start
print(json.dumps([[x.seq_id for x in first], [x.seq_id for x in second]]))
'''


def _placement(hash_seed: int):
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed))
    out = subprocess.run([sys.executable, "-c", SCENARIO], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pull_placement_does_not_depend_on_the_hash_seed():
    placements = {seed: _placement(seed) for seed in range(8)}
    distinct = {json.dumps(p) for p in placements.values()}
    assert len(distinct) == 1, f"placement differs with PYTHONHASHSEED: {placements}"
