"""One schema for sampling parameters, shared by the CLI (`--temperature`), the server (`"temperature"`) and the
library (`SamplingParams`), so all three accept and refuse the same values with the same words.

Limits follow the OpenAI API where it has one (temperature in [0, 2]); a seed must fit the signed 64-bit integer
that OpenAI documents and torch.Generator.manual_seed accepts. No torch import: the CLI validates before loading.
"""

from __future__ import annotations

import math

from specscope.errors import SpecscopeError

TEMPERATURE_MAX = 2.0
SEED_MAX = 2**63 - 1
TOP_K_MAX = 2**31 - 1


class ParamError(SpecscopeError):
    """A sampling parameter out of its range; `field` is the schema name ("temperature", "seed", ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _name(field: str, style: str) -> str:
    return {"cli": "--" + field.replace("_", "-"), "api": f"'{field}'"}.get(style, field)


def check_field(field: str, value, style: str = "lib"):
    """Validate one sampling field; returns the value (an int for seed / top_k). `style` picks how the field is
    named in the message: "cli" (--top-p), "api" ('top_p') or "lib" (top_p)."""
    n = _name(field, style)
    if field == "seed" and value is None:
        return None
    is_num = isinstance(value, (int, float)) and not isinstance(value, bool)
    if field in ("seed", "top_k"):
        if not is_num or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
            raise ParamError(field, f"{n} must be an integer, got {_short(value)}")
        value = int(value)
        hi = SEED_MAX if field == "seed" else TOP_K_MAX
        if not 0 <= value <= hi:
            what = "0 (off)" if field == "top_k" else "0"
            raise ParamError(field, f"{n} must be an integer from {what} to {hi}, got {_short(value)}")
        return value
    try:
        finite = is_num and math.isfinite(value)  # an int past float's range overflows here
    except OverflowError:
        finite = False
    if not finite:
        raise ParamError(field, f"{n} must be a finite number, got {_short(value)}")
    value = float(value)
    if field == "temperature" and not 0.0 <= value <= TEMPERATURE_MAX:
        raise ParamError(field, f"{n} must be in [0, {TEMPERATURE_MAX:g}] (0 = greedy), got {value:g}")
    if field == "top_p" and not 0.0 < value <= 1.0:
        raise ParamError(field, f"{n} must be in (0, 1], got {value:g}")
    return value


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:20] + f"... ({len(s)} characters)"


def check_sampling(temperature, top_p, top_k, seed, style: str = "lib") -> tuple:
    """(temperature, top_p, top_k, seed) validated and normalised; raises ParamError naming the first bad one."""
    return (check_field("temperature", temperature, style), check_field("top_p", top_p, style),
            check_field("top_k", top_k, style), check_field("seed", seed, style))
