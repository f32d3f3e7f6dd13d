"""StrictModel: the base of every config model (config/models.py's sections and each policy's
settings), so that one set of rules holds for every key of a config file:
- strict types: an int field refuses a bool and a string, a float field takes an int, a bool
  field takes only a bool; unknown keys are refused;
- finite floats only: YAML's `.inf` and `.nan` are no timeout, fraction or GPU count;
- integers within 64 bits, list elements included: the values reach Ray, vLLM and C arrays.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

INT64 = 2**63
INT_RULE = "must be an integer in [-2**63, 2**63)"


def _has_long_int(value) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return not -INT64 <= value < INT64
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_has_long_int(v) for v in value)
    if isinstance(value, dict):
        return any(_has_long_int(v) for v in value.values())
    return False


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _within_64_bits(cls, value):
        if _has_long_int(value):
            raise PydanticCustomError("int_too_long", INT_RULE)
        return value
