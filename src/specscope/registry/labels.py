"""The words `compare` and the report put beside a number, each derived from the number it labels, in one place:
a change as a percentage, or "from ~0" where its base is below the metric's noise floor (`rows.FLOORS`); the
intervals note, only where some row has an interval; an amount with its unit; the drafter a run's τ came from."""

from __future__ import annotations

import math

FROM_ZERO = "from ~0"
BOTH_ZERO = "~0 in both"
UNITS = {"ms": "ms", "tok/s": "tok/s", "tokens": "tokens", "share": ""}


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


# ---- changes ------------------------------------------------------------------------------------------------
def change_label(ch: dict | None, sep: str = ", ") -> str:
    """A row's change against the reference: '+12.3% [+5, +20]' (the interval where there is one), 'from ~0'
    where the reference is below the metric's noise floor, '-' where there is none."""
    ch = ch or {}
    if ch.get("from_zero"):
        return BOTH_ZERO if ch.get("both_zero") else FROM_ZERO
    d = ch.get("change")
    if d is None:
        return "-"
    out = f"{d * 100:+.1f}%"
    if ch.get("lo") is not None and ch.get("hi") is not None:
        out += f" [{ch['lo'] * 100:+.0f}{sep}{ch['hi'] * 100:+.0f}]"
    return out


def amount(x: float | None, unit: str = "") -> str:
    """A value with about three significant digits and its unit: '14.0 ms', '0.412 ms', '2.20 tokens'."""
    if x is None:
        return "-"
    a = abs(x)
    s = f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 1 or a == 0 else f"{x:.3f}"
    u = UNITS.get(unit, unit)
    return f"{s} {u}" if u else s


def moved_words(row: dict, i: int) -> str:
    """One row's move in a sentence: 'ms/cycle +3.1%', or 'Draft ms/cyc from ~0 to 14.0 ms'."""
    ch = row["changes"][i] or {}
    if ch.get("from_zero"):
        return f"{row['label']} {FROM_ZERO} to {amount(_num(row['values'][i]), row.get('unit', ''))}"
    return f"{row['label']} {ch['change'] * 100:+.1f}%"


def ms_per_token(x: float) -> str:
    """A ms/token change with its unit and sign: '+894 ms/token', '+12.3 ms/token', '-0.412 ms/token'."""
    a = abs(x)
    s = f"{x:+.0f}" if a >= 100 else f"{x:+.1f}" if a >= 10 else f"{x:+.2f}" if a >= 1 else f"{x:+.3f}"
    return f"{s} ms/token"


def has_intervals(res: dict) -> bool:
    return any(c and c.get("lo") is not None for row in res["rows"] for c in row["changes"][1:])


def intervals_note(res: dict) -> str:
    """What the compare table's Δ column holds: the interval level only where some row has an interval;
    otherwise that the changes are shown as measured, not called."""
    floor = "a change from a base below the metric's noise floor reads 'from ~0'"
    if not has_intervals(res):
        return ("No intervals: no compared metric has per-cycle samples in both runs, so changes are shown as "
                f"measured and not called; {floor}.")
    return (f"Intervals at {res['confidence'] * 100:.2f}% (Bonferroni over rows), block bootstrap over cycles; "
            f"changes under {res['min_effect'] * 100:.0f}% are not called; {floor}. Rows without per-cycle "
            f"samples have no interval and are not called.")


# ---- what drafted -------------------------------------------------------------------------------------------
NAME_KEYS = ("draft", "speculative_method", "method", "drafter_kind")


def drafter_name(rec: dict) -> str | None:
    """What drafted, as the run's record names it: the drafter (--draft, an engine's speculative config's
    model), else the method an engine named; None where the record names none."""
    cfg = rec.get("config") or {}
    spec = cfg.get("speculative_config") if isinstance(cfg.get("speculative_config"), dict) else {}
    for v in (cfg.get("draft"), spec.get("model"), spec.get("method"), *(cfg.get(k) for k in NAME_KEYS[1:])):
        if v and isinstance(v, str):
            return v
    return None


def drafted(rec: dict) -> bool:
    """Did the run draft, by its results: drafted tokens, τ above 1, per-position acceptance, drafting steps."""
    res = rec.get("results") or {}
    tau = _num(res.get("accept_length"))
    return bool(res.get("drafted_tokens") or (tau is not None and tau > 1.0) or res.get("per_position_acceptance")
                or (_num(res.get("drafted_step_share")) or 0) > 0)


def unnamed_drafter(rec: dict) -> str:
    """How a run that drafted but names no drafter is labelled: where the name would have come from."""
    served = rec.get("kind") == "bench_serve" or (rec.get("config") or {}).get("url")
    return "speculative (drafter not named by the server)" if served else \
        "speculative (not named in the log)" if rec.get("kind") == "ingest" else "speculative (drafter not named)"
