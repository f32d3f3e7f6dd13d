"""argparse types of the command line's numbers: a bad value is refused by argparse, naming the
flag and the value in one line (exit code 2), before a cluster, a model or an engine is made."""
from __future__ import annotations

import argparse
import math


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def seconds(text: str) -> float:
    """A wait (--timeout-s): a finite number of seconds > 0."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, not {text!r}")
    return value


def positive(text: str) -> float:
    """A finite number > 0 (a size, an interval)."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, not {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1] (--finish-fraction)."""
    value = _number(text)
    if not 0 < value <= 1:  # nan too
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], not {text!r}")
    return value


def at_least(low: int):
    """An integer >= `low` (a count: --rounds, --replicas, --turns)."""
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, not {text!r}")
        return value
    count.__name__ = f"integer >= {low}"
    return count


def int_list(text: str) -> list[int]:
    """Comma-separated distinct integers (--seeds 0,1,2: results are keyed by the value, so a value
    given twice would mix two runs under one key)."""
    try:
        values = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, not {text!r}") from None
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} lists {','.join(map(str, twice))} more than once")
    return values
