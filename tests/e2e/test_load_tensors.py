"""load_tensors on a real vLLM-CPU engine (no Ray): named tensors from this process's memory
replace the running engine's weights in place, exactly, and bad tensors are refused by name.

One engine for the module (a start costs 40-190 s on the 2-core box), driven from an event loop
in a thread of its own (vLLM's AsyncLLM stays on the loop it started on). It starts on model B,
so the outputs of "an engine started on B" are the first ones it gives."""
import asyncio
import contextlib
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from rollout_cluster.config.models import EngineConfig
from rollout_cluster.engines.base import WeightsLoadBroken
from rollout_cluster.model_maker import make_model
from rollout_cluster.protocol import SamplingSpec, Work

pytestmark = pytest.mark.e2e

# Longer than a KV block (128 tokens on vLLM-CPU): the prefix cache holds them between loads, so
# outputs that match after a load show the cache of the old weights was dropped.
PROMPTS = [[5, 6, 7, 8, 9, 10] * 30, [11, 12, 13] * 50, [3, 1, 4, 1, 5, 9, 2, 6]]
GREEDY = SamplingSpec(n=1, max_tokens=16, temperature=0.0, ignore_eos=True)


class Loop:
    """An event loop in a thread: run(coro) from the test's thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextlib.contextmanager
def started(cfg: EngineConfig, model: str):
    """A vLLM-CPU engine on `model`, driven from a Loop (eng.loop), shut down on exit."""
    from rollout_cluster.engines.vllm_engine import VllmEngine

    loop = Loop()
    eng = VllmEngine(cfg, model, on_cpu=True)
    loop.run(eng.start())
    eng.loop = loop
    try:
        yield eng
    finally:
        loop.run(eng.shutdown())
        loop.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_model(str(root / "a"), seed=0), make_model(str(root / "b"), seed=1)


@pytest.fixture(scope="module")
def engine(models):
    _, b = models
    cfg = EngineConfig(model=str(b), dtype="float32", max_model_len=512, max_num_seqs=8,
                       max_num_batched_tokens=1024, cpu_kv_cache_gib=1)
    with started(cfg, str(b)) as eng:
        eng.started_on_b = greedy(eng)  # what an engine started on B gives
        yield eng


def greedy(eng) -> list:
    async def go():
        tag = time.monotonic_ns()
        for i, p in enumerate(PROMPTS):
            eng.submit(Work(seq_id=f"{tag}-{i}", attempt=0, prompt_token_ids=list(p), sampling=GREEDY))
        got, done = {}, 0
        while done < len(PROMPTS):
            await asyncio.sleep(0.02)
            for p in eng.drain():
                got.setdefault(p.seq_id, []).extend(p.token_ids)
                done += p.finish_reason is not None
                assert p.finish_reason in (None, "length"), p
        return [got[f"{tag}-{i}"] for i in range(len(PROMPTS))]

    return eng.loop.run(go())


def tensors(path) -> list:
    return sorted(load_file(str(path / "model.safetensors")).items())


def buckets_of(items, n) -> list:
    """n buckets in name order: cuts fall inside layers (q_proj and k_proj apart)."""
    size = -(-len(items) // n)
    return [items[i:i + size] for i in range(0, len(items), size)]


def load(eng, buckets):
    return eng.loop.run(eng.load_tensors(buckets))


def test_tensors_from_memory_replace_the_weights_exactly(engine, models):
    a, b = models
    on_b = engine.started_on_b
    engine.loop.run(engine.load_weights(str(a)))  # the checkpoint reload: an engine running A
    on_a = greedy(engine)
    assert on_a != on_b

    assert load(engine, buckets_of(tensors(b), 3)) == len(tensors(b))
    assert greedy(engine) == on_b  # exact (float32), prefix cache of A's weights dropped
    # numpy arrays (as Ray's object store hands them out), in a generator of 5 buckets
    load(engine, (bucket for bucket in buckets_of([(n, t.numpy()) for n, t in tensors(a)], 5)))
    assert greedy(engine) == on_a
    load(engine, [tensors(b)])  # one bucket
    assert greedy(engine) == on_b


def test_the_load_runs_direct_and_vllms_own_reload_works_before_and_after_it(engine, models):
    """Regression: a DirectLoad after vLLM's layerwise reload called the wrappers that reload left
    on the layers' metadata, which load nothing; the outputs then stayed those of the old weights."""
    a, b = models
    engine.loop.run(engine.load_weights(str(a)))  # vLLM's layerwise reload first
    on_a = greedy(engine)
    load(engine, buckets_of(tensors(b), 4))
    assert engine.loop.run(engine.engine.collective_rpc("rc_tensors_mode")) == ["direct"]
    assert greedy(engine) == engine.started_on_b
    engine.loop.run(engine.load_weights(str(a)))  # and after the direct load
    assert greedy(engine) == on_a
    load(engine, buckets_of(tensors(b), 2))
    assert greedy(engine) == engine.started_on_b


@pytest.mark.parametrize("bad, match", [
    ("unknown", r"tensor 'model\.layers\.0\.self_attn\.nope\.weight': the served model has no such weight"),
    ("shape", r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight': shape \(128, 255\), the served model's is \(128, 256\)"),
    ("missing", r"2 of the served model's 21 tensors are missing, e\.g\. \['lm_head\.weight', 'model\.norm\.weight'\]"),
    ("twice", r"tensor 'model\.embed_tokens\.weight': given twice"),
    ("integer", r"tensor 'model\.norm\.weight': dtype torch\.int64 is not floating point"),
])
def test_a_list_that_does_not_fit_is_refused_by_name_and_the_old_weights_stay(engine, models, bad, match):
    a, b = models
    load(engine, [tensors(b)])
    items = dict(tensors(a))
    if bad == "unknown":
        items["model.layers.0.self_attn.nope.weight"] = torch.zeros(4)
    elif bad == "shape":
        items["model.layers.1.mlp.down_proj.weight"] = torch.zeros(128, 255)
    elif bad == "missing":
        del items["lm_head.weight"], items["model.norm.weight"]
    elif bad == "integer":
        items["model.norm.weight"] = torch.ones(128, dtype=torch.int64)
    bucket = sorted(items.items())
    if bad == "twice":
        bucket.append(("model.embed_tokens.weight", items["model.embed_tokens.weight"]))
    with pytest.raises(ValueError, match=match):
        load(engine, buckets_of(bucket, 3))
    assert greedy(engine) == engine.started_on_b  # nothing of A went in


def test_a_refusal_after_the_first_bucket_went_in_breaks_the_weights_and_a_full_load_recovers(engine, models):
    a, b = models
    items = tensors(a)
    first, rest = items[:10], dict(items[10:])
    name = sorted(rest)[0]
    rest[name] = torch.zeros(3, 3)

    def arriving():  # buckets still coming: the bad one is seen only after the first was loaded
        yield first
        yield sorted(rest.items())

    with pytest.raises(WeightsLoadBroken, match=rf"a mix of old and new: ValueError: tensor '{name}': shape \(3, 3\)"):
        load(engine, arriving())
    assert len(greedy(engine)[0]) == 16  # out of the reload: the engine still runs, on mixed weights
    load(engine, buckets_of(tensors(b), 2))
    assert greedy(engine) == engine.started_on_b


def test_an_engine_that_lost_a_layers_tensors_says_so_without_a_checkpoint_spec(engine, models, monkeypatch):
    """Without names and shapes to check against (load_format dummy of an architecture that
    transformers cannot build), vLLM's worker reports the parameters that got nothing; the
    weights are then a mix."""
    from rollout_cluster.engines import weight_checks

    a, b = models
    monkeypatch.setattr(weight_checks, "load_spec", lambda path: None)
    items = [(n, t) for n, t in tensors(a) if not n.startswith("model.layers.1.mlp.")]
    with pytest.raises(WeightsLoadBroken, match=r"2 of the model's parameters got no tensor, e\.g\. "
                                                r"\['model\.layers\.1\.mlp\.down_proj\.weight'"):
        load(engine, [items])
    monkeypatch.undo()
    load(engine, [tensors(b)])
    assert greedy(engine) == engine.started_on_b
