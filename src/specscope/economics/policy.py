"""Which draft shape (or none) a batched step uses at a given batch size: `serve --spec-policy`."""

from __future__ import annotations

from typing import Callable

from specscope.errors import SpecscopeError

POLICIES = ("always", "off")


def spec_policy(value: str, cfg) -> Callable[[int], object]:
    """`--spec-policy` -> policy(batch_size) -> SpecConfig or None (a plain step). 'always': the drafter's
    shape at every batch size; 'off': never speculate (the drafter still loads, for comparison runs)."""
    if value == "always":
        return lambda n: cfg
    if value == "off":
        return lambda n: None
    raise SpecscopeError(f"--spec-policy {value!r} is not one of {', '.join(POLICIES)}")
