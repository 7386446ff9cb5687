"""The rows `specscope compare` shows: which metrics a set of runs is compared on (tok/s, ms/token, τ, acceptance
per draft position, ms/cycle, each phase, plain decoding's ms/token), and each run's value and per-cycle samples
of them, from which compare draws its intervals."""

from __future__ import annotations

from specscope.profile.cycle import PHASE_LABELS, TOP_PHASES


# ---- per-run numbers ----------------------------------------------------------------------------------------
def _cycles(rec: dict):
    """(per-phase ms dict, total ms per cycle, tokens per cycle) from a record's samples; None parts if absent."""
    s = rec.get("samples") or {}
    cm = s.get("cycle_ms") or {}
    total = s.get("cycle_total_ms")
    if total is None and cm:
        cols = [v for k, v in cm.items() if "." not in k]
        total = [sum(x) for x in zip(*cols)] if cols else None
    acc = s.get("accept_lengths")
    if acc is not None and total is not None and len(acc) != len(total):
        acc = None
    return cm, total, acc


def _per_prompt(rec: dict) -> list[float] | None:
    pp = (rec.get("samples") or {}).get("per_prompt") or []
    vals = [p.get("tok_per_s") for p in pp if isinstance(p, dict)]
    return vals if vals and all(isinstance(v, (int, float)) for v in vals) else None


def same_prompts(a: dict, b: dict) -> bool:
    ha, hb = (a.get("config") or {}).get("prompt_set_hash"), (b.get("config") or {}).get("prompt_set_hash")
    return bool(ha) and ha == hb and len(_per_prompt(a) or []) == len(_per_prompt(b) or [])


def _ones(x):
    return [1.0] * len(x)


def _res(rec, *path):
    """A stored result by its path, e.g. _res(rec, "phases", "verify", "mean_ms"); None where it is missing."""
    v = rec.get("results") or {}
    for p in path:
        v = v.get(p) if isinstance(v, dict) else None
    return v


# ---- rows ---------------------------------------------------------------------------------------------------
# samples(rec) -> (num, den) | None: a row's value is sum(num) / sum(den), its interval a ratio of the two
def _tok_s_samples(rec):
    _, total, acc = _cycles(rec)
    return ([a * 1000.0 for a in acc], total) if total and acc else None


def _prompt_tok_s_samples(rec):
    pp = _per_prompt(rec)
    return (pp, _ones(pp)) if pp else None


def _ms_tok_samples(rec):
    _, total, acc = _cycles(rec)
    return (total, acc) if total and acc else None


def _tau_samples(rec):
    _, _, acc = _cycles(rec)
    return (acc, _ones(acc)) if acc else None


def _cycle_samples(rec):
    _, total, _ = _cycles(rec)
    return (total, _ones(total)) if total else None


def metric_defs(runs: list[dict]) -> list[dict]:
    """Rows to show: (key, label, higher_is_better, value(rec), samples(rec) -> (num, den) | None)."""
    defs = _speed_defs(runs)
    defs += [
        dict(key="ms_per_token", label="ms/token", higher=False, value=lambda r: _res(r, "decode_ms_per_token"),
             samples=_ms_tok_samples),
    ]
    defs += _acceptance_defs(runs)
    defs.append(dict(key="cycle_ms", label="ms/cycle", higher=False, value=lambda r: _res(r, "cycle_ms", "mean_ms"),
                     samples=_cycle_samples))
    defs += _phase_defs(runs)
    defs += _baseline_defs(runs)
    return defs


def _speed_defs(runs: list[dict]) -> list[dict]:
    if all(_per_prompt(r) for r in runs):
        # benchmarks: tok/s as Spec-Bench defines it (mean over prompts, prefill included), paired by prompt
        # when both runs used the same prompt set; the cycles' decode-only tok/s gets its own row
        defs = [dict(key="tok_per_s", label="tok/s (per prompt)", higher=True, value=lambda r: _res(r, "tok_per_s"),
                     samples=_prompt_tok_s_samples, paired=True)]
        if any(_tok_s_samples(r) for r in runs):
            defs.append(dict(key="decode_tok_per_s", label="decode tok/s", higher=True,
                             value=lambda r: _res(r, "decode_tok_per_s"), samples=_tok_s_samples))
        return defs
    return [dict(key="tok_per_s", label="tok/s", higher=True, value=lambda r: _res(r, "tok_per_s"),
                 samples=_tok_s_samples)]


def _acceptance_defs(runs: list[dict]) -> list[dict]:
    """τ, where some run drafted, and the acceptance at each draft position (the first 8)."""
    defs = []
    taus = [_res(r, "accept_length") for r in runs]
    if any(t not in (None, 1, 1.0) for t in taus):
        defs.append(dict(key="accept_length", label="τ (accept length)", higher=True,
                         value=lambda r: _res(r, "accept_length"), samples=_tau_samples))
    # unconditional acceptance per draft position (vLLM's definition): position i accepted ⇔ τ - 1 > i
    depth = max((len(_res(r, "per_position_acceptance") or []) for r in runs), default=0)
    for i in range(min(depth, 8)):
        def pos_samp(rec, i=i):
            s = rec.get("samples") or {}
            acc, nd = s.get("accept_lengths"), s.get("num_draft")
            if not acc or not nd or len(acc) != len(nd):
                return None
            ind = [1.0 if a - 1 > i else 0.0 for a, n in zip(acc, nd) if n > 0]
            return (ind, _ones(ind)) if ind else None

        def pos_val(rec, i=i):
            v = _res(rec, "per_position_acceptance") or []
            return v[i] if i < len(v) else None

        defs.append(dict(key=f"acceptance.{i}", label=f"acceptance @{i + 1}", higher=True, value=pos_val,
                         samples=pos_samp))
    return defs


def _phase_defs(runs: list[dict]) -> list[dict]:
    """One ms/cycle row per phase any run has, top-level phases in the profiler's order, sub-phases after theirs."""
    phases = []
    for r in runs:
        for p in (_res(r, "phases") or {}):
            if p not in phases:
                phases.append(p)
    phases.sort(key=lambda p: (TOP_PHASES.index(p.split(".")[0]) if p.split(".")[0] in TOP_PHASES else 99, p))
    defs = []
    for p in phases:
        label = PHASE_LABELS.get(p, p) + " ms/cyc"

        def samp(rec, p=p):
            cm, _, _ = _cycles(rec)
            col = cm.get(p)
            return (col, _ones(col)) if col else None

        defs.append(dict(key=f"phase.{p}", label=label, higher=False,
                         value=lambda r, p=p: _res(r, "phases", p, "mean_ms"), samples=samp))
    return defs


def _baseline_defs(runs: list[dict]) -> list[dict]:
    """Plain decoding's ms/token, where a run carries a baseline measurement."""
    def base_value(r):   # {"baseline": {...}} or the flat key some producers use
        v = _res(r, "baseline", "decode_ms_per_token")
        return v if v is not None else _res(r, "baseline_decode_ms_per_token")

    if not any(base_value(r) is not None for r in runs):
        return []

    def base_samp(rec):
        col = (rec.get("samples") or {}).get("baseline_step_ms")
        return (col, _ones(col)) if col else None

    return [dict(key="baseline.decode", label="Baseline decode ms/token", higher=False, value=base_value,
                 samples=base_samp)]
