"""Bounds for numeric flags, checked by click before any work starts.

click.FloatRange lets `nan` through (every comparison with NaN is false) and `inf` wherever no maximum is set, so a
float flag that must be a real number uses FiniteRange; integer flags that size work (threads) get a ceiling.
"""

from __future__ import annotations

import math

import click

MAX_THREADS = 1024      # torch.set_num_threads(10**9) dies inside libgomp allocating per-thread state


class FiniteRange(click.FloatRange):
    """A float in [min, max] that is a real number: 'nan' is refused always, 'inf' unless allow_inf (e.g.
    --request-rate inf = send everything at once)."""

    def __init__(self, min=None, max=None, min_open=False, max_open=False, allow_inf=False):
        super().__init__(min, max, min_open, max_open)
        self.allow_inf = allow_inf

    def convert(self, value, param, ctx):
        v = click.types.FloatParamType.convert(self, value, param, ctx)
        if math.isnan(v) or (math.isinf(v) and not (self.allow_inf and v > 0)):
            self.fail(f"{value!r} is not a finite number" + (" (inf is allowed)" if self.allow_inf else ""), param,
                      ctx)
        return super().convert(v, param, ctx)


THREADS = click.IntRange(1, MAX_THREADS)
