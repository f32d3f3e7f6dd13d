"""vLLM's own layerwise reload (ROLLOUT_TENSOR_LOAD=layerwise: the path off vLLM-CPU, on GPUs)
keeps a layer's tensors, views of the replica's reusable /dev/shm slot, until the layer's last
tensor arrives; buckets cut inside layers must still load exactly (tests/test_slot_reuse.py has
the mechanism without vLLM)."""
import os

import pytest

from rollout_cluster.config.models import EngineConfig
from rollout_cluster.model_maker import make_model

from test_load_tensors import buckets_of, greedy, load, started, tensors

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def layerwise_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    a, b = make_model(str(root / "a"), seed=0), make_model(str(root / "b"), seed=1)
    cfg = EngineConfig(model=str(b), dtype="float32", max_model_len=512, max_num_seqs=8,
                       max_num_batched_tokens=1024, cpu_kv_cache_gib=1)
    old = os.environ.get("ROLLOUT_TENSOR_LOAD")
    os.environ["ROLLOUT_TENSOR_LOAD"] = "layerwise"  # read in vLLM's worker, which inherits it at start
    try:
        with started(cfg, str(b)) as eng:
            eng.started_on_b = greedy(eng)
            yield eng, a, b
    finally:
        if old is None:
            os.environ.pop("ROLLOUT_TENSOR_LOAD", None)
        else:
            os.environ["ROLLOUT_TENSOR_LOAD"] = old


def test_buckets_cut_inside_layers_load_exactly_through_vllms_layerwise_reload(layerwise_engine):
    eng, a, b = layerwise_engine
    eng.loop.run(eng.load_weights(str(a)))
    on_a = greedy(eng)
    assert on_a != eng.started_on_b
    for n in (7, 11):  # many small buckets: slots are reused while layers are cut across them
        load(eng, buckets_of(tensors(b), n))
        assert eng.loop.run(eng.engine.collective_rpc("rc_tensors_mode")) == ["layerwise"]
        assert greedy(eng) == eng.started_on_b, f"{n} buckets"
        load(eng, buckets_of(tensors(a), n))
        assert greedy(eng) == on_a, f"{n} buckets"
