"""What a load of named tensors must fit, checked before the engine is touched: the served
checkpoint's tensor names and shapes (from its safetensors headers), and a check that refuses,
naming the tensor, what does not fit them. No vllm here: the replica runs these.

`served_weights` is the one answer to "what may a trainer send" for a model with or without
checkpoint files (load_format dummy): the checkpoint's headers; else the model that config.json
describes, built by transformers on the meta device (names and shapes, no memory, no remote
code); else, where transformers cannot build it, a cap on an update's bytes estimated from the
config's sizes."""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass

log = logging.getLogger(__name__)


def checkpoint_spec(path: str) -> dict | None:
    """{name: shape} of every tensor in the safetensors checkpoint at `path`, from the file
    headers (no tensor is read); None where there is none (load_format dummy, .bin files)."""
    if not os.path.isdir(path):
        return None
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):  # only the files it names, as vLLM loads them (Mistral's repos ship a consolidated copy beside)
        try:
            with open(index) as fh:
                named = set(json.load(fh).get("weight_map", {}).values())
            files = [f for f in files if f in named]
        except (OSError, ValueError, AttributeError) as e:  # (vLLM's own load reports a broken index)
            log.warning("checkpoint %s: its model.safetensors.index.json is unreadable (%s): every file counted", path, e)
    if not files:
        return None
    spec = {}
    for f in files:
        with open(os.path.join(path, f), "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        spec.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return spec


@dataclass(frozen=True)
class ServedWeights:
    spec: dict | None  # {name: shape} a trainer may send, or None (then only max_bytes bounds it)
    max_bytes: int | None  # what one update may hold, where no spec bounds it; None: unbounded
    source: str  # where it came from: "checkpoint", "config", "config estimate" or "none"


def served_weights(path: str) -> ServedWeights:
    """What a trainer may send to the model at `path` (a directory, or a name in the local
    Hugging Face cache): exact names and shapes where the checkpoint or the config gives them."""
    spec = checkpoint_spec(path)
    if spec is not None:
        return ServedWeights(spec, None, "checkpoint")
    config = _config(path)
    if config is None:
        return ServedWeights(None, None, "none")
    try:
        return ServedWeights(config_spec(config), None, "config")
    except Exception as e:  # an architecture this transformers lacks, or one that needs remote code
        cap = estimated_bytes(config)
        log.warning("weights of %s: no checkpoint, and transformers cannot build its config (%s): an update "
                    "is capped at %s bytes", path, e, cap)
        return ServedWeights(None, cap, "config estimate" if cap else "none")


def load_spec(path: str) -> dict | None:
    """{name: shape} a load of named tensors into the model at `path` must fit: the checkpoint's
    headers (read each time: a directory may be rewritten), else its config's model (built once
    per path: a meta model of a large config takes a moment); None where neither gives one."""
    spec = checkpoint_spec(path)
    return spec if spec is not None else _config_spec_of(path)


@functools.lru_cache(maxsize=8)
def _config_spec_of(path: str) -> dict | None:
    return served_weights(path).spec


def _config(path: str):
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # no config.json here (the engine's own check names it)
        log.warning("weights of %s: no config to bound a trainer's tensors by (%s)", path, e)
        return None


def config_spec(config) -> dict:
    """{name: shape} of the parameters of the model `config` describes, as a trainer's
    named_parameters() yields them (a tied lm_head once, as the checkpoint holds it)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def estimated_bytes(config) -> int | None:
    """Twice a decoder's parameters in float32, from the config's sizes (embeddings and head,
    attention and MLP per layer, every expert): a bound, not a count. None where a size is missing."""
    c = getattr(config, "text_config", None) or config
    sizes = [getattr(c, k, None) for k in ("vocab_size", "hidden_size", "num_hidden_layers")]
    if not all(isinstance(v, int) and v > 0 for v in sizes):
        return None
    vocab, hidden, layers = sizes
    inter = max(getattr(c, k, 0) or 0 for k in ("intermediate_size", "moe_intermediate_size")) or 4 * hidden
    experts = max(getattr(c, k, 0) or 0 for k in ("num_experts", "num_local_experts", "n_routed_experts")) + 1
    params = 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inter * experts + 4 * hidden)
    return 2 * 4 * math.ceil(params)


class BucketCheck:
    """Refuses, naming the tensor, what the served model cannot take: a name its checkpoint lacks,
    a shape other than the checkpoint's, a name twice, a tensor that is not floating point, and
    (at finish) a checkpoint tensor left out. Without a spec (no safetensors checkpoint) only the
    names and dtypes are checked here: vLLM's loader checks the rest, during the load."""

    def __init__(self, spec: dict | None):
        self.spec = spec  # {name: shape} of the served checkpoint, or None
        self.seen: set = set()  # names checked so far
        self.buckets = 0  # buckets checked so far

    def bucket(self, bucket) -> None:
        b, self.buckets = self.buckets, self.buckets + 1
        if not isinstance(bucket, (list, tuple)):
            raise TypeError(f"bucket {b}: {type(bucket).__name__}: a bucket is a list of (name, tensor) pairs")
        spec = self.spec
        for item in bucket:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"bucket {b}: {str(item)[:80]!r}: each item must be a (name, tensor) pair")
            name, t = item
            t = as_tensor(name, t)
            if name in self.seen:
                raise ValueError(f"tensor {name!r}: given twice")
            self.seen.add(name)
            if not t.is_floating_point():
                raise ValueError(f"tensor {name!r}: dtype {t.dtype} is not floating point")
            if spec is None:
                continue
            if name not in spec:
                raise ValueError(f"tensor {name!r}: the served model has no such weight "
                                 f"(its checkpoint has {len(spec)} tensors, e.g. {next(iter(spec))!r})"
                                 + _tied_hint(name, spec))
            if tuple(t.shape) != spec[name]:
                raise ValueError(f"tensor {name!r}: shape {tuple(t.shape)}, the served model's is {spec[name]}")

    def finish(self) -> int:
        """The number of tensors checked; refuses a load that leaves a checkpoint tensor out."""
        if self.spec is not None:
            missing = sorted(set(self.spec) - self.seen)
            if missing:
                raise ValueError(f"{len(missing)} of the served model's {len(self.spec)} tensors are missing, "
                                 f"e.g. {missing[:3]}: a load replaces every weight (a partial one would mix "
                                 "two models)")
        if not self.seen:
            raise ValueError("buckets: no tensor given")
        return len(self.seen)


def check_ahead(manifest, spec: dict | None) -> None:
    """A push's manifest (transfer/buckets.Manifest), before the engine takes its first bucket:
    every tensor it announces checked as the bucket itself will be, and none left out."""
    check = BucketCheck(spec)
    for bucket in manifest.meta_buckets():
        check.bucket(bucket)
    check.finish()


def _tied_hint(name: str, spec: dict) -> str:
    """Why a model with tied embeddings has no `lm_head.weight`: state_dict() yields the tied
    tensor under both names, its checkpoint (and named_parameters()) once."""
    if not name.endswith("lm_head.weight"):
        return ""
    embed = next((n for n in spec if n.endswith("embed_tokens.weight")), None)
    if embed is None:
        return ""
    return (f"; the served model ties it to {embed!r} (tie_word_embeddings): send model.named_parameters(), "
            "which yields a tied weight once, or leave this name out")


def as_tensor(name: str, t):
    import torch

    if isinstance(t, torch.Tensor):
        return t
    try:
        with warnings.catch_warnings():  # a read-only array (Ray's object store hands those out zero-copy)
            warnings.simplefilter("ignore", UserWarning)
            return torch.as_tensor(t)
    except Exception as e:
        raise TypeError(f"tensor {name!r}: {type(t).__name__} is not a tensor or an array") from e
