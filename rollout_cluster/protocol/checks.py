"""Limits (INT64, MAX_N), the validation helpers every other protocol module checks values with
(is_int, is_int64, is_number), and the errors that refuse a batch: bad input (InputError,
WeightsVersionError), a limit passed (LimitExceeded, RouterBusy), a batch lost with its router;
and a weights order refused until a new router has heard its fleet (WeightsNotLearned).
"""
from __future__ import annotations

import math

from ..parsing import shown

# vLLM's engine core receives requests as MessagePack, whose integers are 64-bit, and seeds a
# torch.Generator, which takes 64 bits: a count or a seed must fit in a signed 64-bit integer.
INT64 = 2**63

MAX_N = 65536  # samples per prompt, at most (the config's limits.max_n lowers it)


class InputError(ValueError):
    """A request field has an invalid value. The message names the field and the value."""

    def __init__(self, field_name: str, value, why: str):
        super().__init__(f"{field_name}={shown(value)}: {why}")
        self.field = field_name

    def __reduce__(self):
        # Pickled across Ray (a router's refusal reaches the driver): pickle's default would call
        # the class with the message alone, and the driver would get a deserialization error.
        return _rebuilt_input_error, (type(self), self.args[0], self.field)


def _rebuilt_input_error(cls, message: str, field_name: str) -> InputError:
    error = cls.__new__(cls)
    ValueError.__init__(error, message)
    error.field = field_name
    return error


class WeightsVersionError(InputError):
    """A batch asked for weights (`weights_version`) other than those the fleet holds: it was not
    run, so that an RL step's samples all come from the policy the trainer meant."""


class WeightsNotLearned(RuntimeError):
    """A weights order (update_weights, push_weights) a new or restarted router cannot number yet:
    it has not heard every replica's weights, and a number it gave now could be one the fleet
    holds for other weights (router/weights_floor.py). Nothing changed: retry in a moment."""


class LimitExceeded(RuntimeError):
    """A batch past one of the config's `limits` (HTTP 413: split it); nothing of it was
    registered. `limit` names the setting."""

    def __init__(self, limit: str, message: str):
        super().__init__(message)
        self.limit = limit

    def __reduce__(self):
        return type(self), (self.limit, self.args[0])


class RouterBusy(LimitExceeded):
    """The router holds limits.max_live_sequences already (HTTP 429): retry when batches finish."""


class BatchLostError(KeyError):
    """A batch the router does not hold because the router that ran it is gone: it restarted,
    and a batch's state lives in the router's memory. The driver still holds the requests and
    submits the sequences it has not received again (RolloutClient.max_router_restarts)."""


def is_int(v) -> bool:
    """An int, and not a bool (JSON's true is no count)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_int64(v) -> bool:
    """An int (not a bool) within a signed 64-bit integer."""
    return is_int(v) and -INT64 <= v < INT64


def check_wait_s(field_name: str, v, allow_none: bool = True) -> None:
    """A wait in seconds: a finite number >= 0 (None: the default, where `allow_none`), or InputError
    naming the field. (NaN would never pass a deadline: a wait on it never ends.)"""
    if v is None and allow_none:
        return
    if not (is_number(v) and v >= 0):
        raise InputError(field_name, v, "must be a finite number of seconds >= 0" + (" (or None)" if allow_none else ""))


RUNNING_MODES = ("finish", "keep", "recompute", "abort")  # update_weights / push_weights(running=...)


def check_weights_order(version, running) -> None:
    """update_weights' and push_weights' `version` and `running`, refused before anything is
    waited for or sent."""
    if version is not None and not (is_int(version) and version >= 0):
        raise InputError("version", version, "must be None (the next version) or an integer >= 0")
    if not isinstance(running, str) or running not in RUNNING_MODES:
        raise InputError("running", running, f"must be one of {', '.join(RUNNING_MODES)}")


def check_replicas(replicas) -> None:
    """A fleet's size (RolloutClient.scale, the router's set_fleet_target): an integer >= 1."""
    if not is_int(replicas) or replicas < 1:
        raise InputError("replicas", replicas, "must be an integer >= 1")


def is_number(v) -> bool:
    """A finite int or float, and not a bool: JSON's NaN and Infinity, a literal beyond a double's
    range (1e999) and true are no values for a sampling parameter."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond a double
        return False
