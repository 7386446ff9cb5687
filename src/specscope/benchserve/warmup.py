"""Warm-up until the engine is warm, not for a fixed count: the first request sent again until two in a row take
the same time per output token (the same prompt, greedy: the same tokens and drafts, so only the engine's warmth
differs). A fixed count measures a first launch's lazy initialisation (allocator growth, JIT, page faults) in
some launches and not in others; `sweep` and `bench-serve --num-warmups` both warm up this way."""

from __future__ import annotations

from dataclasses import dataclass, field

from specscope.errors import SpecscopeError

STEADY = 0.03           # two warm-up requests in a row this close in time per output token: the engine is warm
MORE_WARMUP = 8         # at most this many warm-up requests past the asked count before measuring anyway


@dataclass
class WarmUp:
    """The warm-up of one launch: each request's time per output token, and whether it settled."""
    tpot_ms: list = field(default_factory=list)
    steady: bool = False

    def words(self) -> str:
        last = ", ".join(f"{t:.1f}" for t in self.tpot_ms[-3:])
        return (f"the engine did not settle in {len(self.tpot_ms)} warm-up requests (ms per output token, the last: "
                f"{last}); measured anyway")

    def to_dict(self) -> dict:
        return {"requests": len(self.tpot_ms), "tpot_ms": [round(t, 3) for t in self.tpot_ms],
                "steady": self.steady}


def tpot_ms(out: dict) -> list[float]:
    """Each successful request's time per output token (ms) in run_levels' output."""
    return [1000 * r["tpot_s"] for r in out["per_request"] if r.get("ok") and r.get("tpot_s")]


def settled(times: list[float]) -> bool:
    """The last two requests' times per output token within STEADY of each other."""
    if len(times) < 2:
        return False
    a, b = times[-2:]
    return abs(a - b) <= STEADY * min(a, b)


def warm_up(send, n: int) -> WarmUp | None:
    """`send(k)`: k copies of the first request sent one at a time, returning run_levels' output. At least `n`,
    then one at a time until settled, at most MORE_WARMUP more; None when n is 0 (no warm-up asked). The extra
    ones stop at the first that fails: an engine that dies or refuses is the measured workload's to report (with
    its log's root cause), not the warm-up's."""
    if not n:
        return None
    warm = WarmUp(tpot_ms(send(n)))
    for _ in range(MORE_WARMUP):
        if settled(warm.tpot_ms):
            break
        try:
            got = tpot_ms(send(1))
        except (SpecscopeError, OSError):       # the engine gone (connection refused): the workload says why
            break
        if not got:
            break
        warm.tpot_ms += got
    warm.steady = settled(warm.tpot_ms)
    return warm
