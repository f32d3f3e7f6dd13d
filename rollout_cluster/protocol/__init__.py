"""Messages between driver, router, policy and replicas.

Plain dataclasses only: they cross Ray's object store (pickled), the simulator's
event loop and the unit tests unchanged. Nothing here imports ray or vllm.

One module per family; import from the package (`from ..protocol import Report`):
  checks.py    limits (INT64, MAX_N), is_int / is_int64 / is_number / check_wait_s / check_replicas / check_weights_order, and the errors bad input raises
  requests.py  driver -> router: SamplingSpec, SequenceRequest
  results.py   router -> driver: Completion, Migration, Partial (and partials())
  reports.py   replica -> router: Report and what it carries (SeqProgress, ModelInfo, EngineStats,
               WeightsState, SleepState, Listing, WeightsDigest)
  orders.py    router -> replica: Orders, Work and the control orders (LoadWeights, NoteWeights,
               Sleep, Wake, ResetPrefixCache, DigestWeights)
"""
from .checks import (INT64, MAX_N, BatchLostError, InputError, LimitExceeded, RouterBusy, WeightsNotLearned,
                     WeightsVersionError, RUNNING_MODES, check_replicas, check_wait_s, check_weights_order, is_int,
                     is_int64, is_number)
from .orders import (ControlOrder, DigestWeights, LoadWeights, NoteWeights, Orders, ResetPrefixCache, Sleep, StopPush,
                     Wake, Work)
from .reports import EngineStats, Listing, ModelInfo, Report, SeqProgress, SleepState, WeightsDigest, WeightsState
from .requests import SamplingSpec, SequenceRequest
from .results import Completion, Migration, Partial, partials

__all__ = [
    "INT64", "MAX_N", "BatchLostError", "InputError", "LimitExceeded", "RouterBusy", "WeightsNotLearned",
    "WeightsVersionError",
    "RUNNING_MODES", "check_replicas", "check_wait_s", "check_weights_order", "is_int", "is_int64", "is_number",
    "SamplingSpec", "SequenceRequest",
    "Completion", "Migration", "Partial", "partials",
    "EngineStats", "Listing", "ModelInfo", "Report", "SeqProgress", "SleepState", "WeightsDigest", "WeightsState",
    "ControlOrder", "DigestWeights", "LoadWeights", "NoteWeights", "Orders", "ResetPrefixCache", "Sleep", "StopPush",
    "Wake", "Work",
]
