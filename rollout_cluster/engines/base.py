"""EngineAdapter: the one interface a replica drives, whatever runs the model.

Contract:
- `start()` loads the model and returns its ModelInfo; nothing else is called before it.
- `submit(work)` starts one segment. Exactly one final SeqProgress (finish_reason set) comes
  back for every submitted (seq_id, attempt): natural end, "abort" after a give-up, or "error".
- `give_up(keys)` aborts running segments. Their final report carries finish_reason "abort";
  if a segment finished on its own first, its natural final report stands and the give-up is
  a no-op (the router reconciles by attempt).
- `drain()` returns every delta produced since the last drain, in order, and never twice.
- `ended` counts the final reports produced so far; it grows before drain() returns them.
- `dead` is set when the engine itself has died (vLLM's EngineCore process crashed: GPU fault,
  out of memory). Its segments then get no final report: they continue elsewhere from the tokens
  already reported, and the replica leaves and is restarted (serve/replica.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..protocol import EngineStats, ModelInfo, Work


class SleepRefused(RuntimeError):
    """The engine refused to sleep before touching its memory (it was started without sleep mode)."""


class WeightsLoadBroken(RuntimeError):
    """A weights load failed after the engine began replacing its weights: restart the engine."""


class EngineAdapter(ABC):
    capacity: int = 1  # sequences decoded at once (max_num_seqs)
    ended: int = 0  # segments whose final report was produced so far (the replica reports at once when it grows)
    dead = None  # the exception that showed the engine itself died (no segment can run any more)

    @abstractmethod
    async def start(self) -> ModelInfo: ...

    @abstractmethod
    def submit(self, work: Work) -> None: ...

    @abstractmethod
    async def give_up(self, keys: list) -> None: ...

    @abstractmethod
    def drain(self) -> list: ...

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def held(self) -> list:
        """Every (seq_id, attempt) submitted and not yet reported finished."""

    def report_whole(self, keys: list) -> None:
        """Make the final reports of these attempts carry their whole output (tokens and logprobs
        from the first, offset 0) instead of the last delta: a restarted router, which never got
        the earlier deltas, continues them. An attempt that ended already, its final sent as a delta
        the engine still keeps (whole_final), is reported again, whole. An engine that cannot keeps
        its deltas (the router then generates those sequences again)."""

    def whole_final(self, p):
        """The whole-output form of the final report `p` (offset 0, every token and logprob of the
        segment, its prompt), if this engine still has it; else `p`. A replica whose pull failed
        sends its undelivered finals this way: if the router restarted meanwhile, the new one
        never got the earlier deltas, and continues the sequence from the whole output
        (router_adoption.py); the old one drops what it already has."""
        return p

    def forget_finals(self, delivered: list) -> None:
        """These reports reached a router: the whole outputs kept for their finals can go."""

    def aborting(self) -> list:
        """The held attempts already given up whose final report is still to come (an engine
        whose give_up finishes at once has none)."""
        return []

    async def load_weights(self, path: str, keep_as=None) -> None:
        """Replace the model's weights in place with the checkpoint in `path` (same architecture),
        between batches: nothing may be running. Cached KV of the old weights is dropped.
        `keep_as` (a version): swap under the running sequences instead, as load_tensors does."""
        raise NotImplementedError(f"{type(self).__name__} cannot load weights")

    async def load_tensors(self, buckets, keep_as=None) -> int:
        """Replace the model's weights in place with named tensors from memory (no checkpoint),
        between batches: nothing may be running. `buckets`: a list, iterator or async iterator of
        buckets, each a list of (name, tensor) pairs in the checkpoint's format (the trainer's
        HF state_dict names and shapes; torch tensors or numpy arrays, any floating dtype, on any
        device). Every weight of the model must come, once, in some bucket; a layer's tensors may
        be split over buckets. Returns the number of tensors loaded. Cached KV is dropped.
        Failure modes: a list whose tensors do not fit the served checkpoint (unknown name, wrong
        shape, missing or repeated tensor) raises ValueError naming the tensor before anything
        is touched, and the old weights stay. A failure after the first bucket went in raises
        WeightsLoadBroken: the weights are a mix of old and new, restart the engine.
        `keep_as` (the new version; update_weights running="keep"): the running sequences go on;
        the new weights go in between two engine steps, and each running attempt's later reports
        carry SeqProgress.swaps = [(tokens made before the swap, keep_as)]."""
        raise NotImplementedError(f"{type(self).__name__} cannot load tensors")

    def handed(self) -> dict[str, int]:
        """How the last load_tensors handed its buckets to vLLM's worker: weight_loader.WAYS ->
        buckets ({}: not counted: a checkpoint the engine read itself, or an engine with no worker)."""
        return {}

    async def reset_prefix_cache(self) -> bool:
        """Drop the cached KV blocks no running sequence holds. Returns whether the engine says it
        did (vLLM refuses while requests hold blocks). Outputs never change, only prefill work."""
        return True

    async def weights_digest(self, detail: bool = False) -> dict:
        """{"digest": over every weight the engine holds, bit for bit (weight_digest.py), and with
        `detail` "params": {name: {"digest", "dtype", "shape"}}}. Equal digests: equal weights."""
        raise NotImplementedError(f"{type(self).__name__} cannot digest its weights")

    async def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rollouts (vLLM sleep mode: 1 keeps the weights in host
        memory, 2 drops them). Nothing runs (the router sleeps engines between batches only)."""
        self._asleep = level

    async def wake(self) -> None:
        """Undo sleep(). After level 2 the caller reloads the weights (load_weights)."""
        self._asleep = 0

    async def sleeping(self) -> bool:
        """Whether the engine itself says it sleeps."""
        return bool(getattr(self, "_asleep", 0))

    async def shutdown(self) -> None:
        """Stop the engine and its processes."""
