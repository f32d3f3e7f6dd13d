"""Regression: update_weights on an engine started with load_format dummy (the GPU benches' and
the co-located experiment's engines) failed inside vLLM ("Model reloading with `dummy` format":
the dummy loader reads no file), and the replica was restarted as broken. The worker now reloads
as safetensors (TensorLoader.rc_reload_format). No Ray: a vLLM-CPU engine in this process."""
import pytest

from rollout_cluster.config.models import EngineConfig
from rollout_cluster.model_maker import make_model

from test_load_tensors import greedy, started

pytestmark = pytest.mark.e2e


def test_an_engine_started_on_dummy_weights_reloads_a_checkpoint_and_serves_it(tmp_path):
    a = make_model(str(tmp_path / "a"), seed=0)
    cfg = EngineConfig(model=str(a), load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=8,
                       max_num_batched_tokens=1024, cpu_kv_cache_gib=1)
    with started(cfg, str(a)) as eng:
        on_dummy = greedy(eng)
        eng.loop.run(eng.load_weights(str(a)))  # raised WeightsLoadBroken before the fix
        on_a = greedy(eng)
        assert on_a != on_dummy
        eng.loop.run(eng.load_weights(str(a)))  # a second reload keeps them
        assert greedy(eng) == on_a
