"""The rows `specscope compare` shows: which metrics a set of runs is compared on (tok/s, ms/token, τ, acceptance
per draft position, ms/cycle, each phase, plain decoding's ms/token), and each run's value and per-cycle samples
of them, from which compare draws its intervals."""

from __future__ import annotations

from specscope.profile.cycle import PHASE_LABELS, TOP_PHASES
from specscope.registry import metrics
from specscope.registry.metrics import RunMetrics
from specscope.registry.metrics import number as _num

# Below its noise floor a base is ~0: a change from it is said "from ~0", never a percentage of it (0.009 ->
# 14.02 ms is not +157377 %). A phase's floor is a share of the run's cycle (0.2 %: the cycle's own noise hides it);
# other metrics' floors are absolute, per unit.
PHASE_FLOOR_SHARE = 0.002
FLOORS = {"ms": 1e-3, "tok/s": 1e-3, "tokens": 0.0, "share": 0.01}


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


def _m(rec) -> RunMetrics:
    return RunMetrics.of(rec)


# ---- the measured numbers every table, chart and sentence reads (one source each) --------------------------
def phase_total_ms(rec: dict) -> float | None:
    """The top-level phases' mean ms per cycle (a served run's: per engine step), added up; None without phases."""
    vals = [_num(v.get("mean_ms")) for k, v in (_m(rec).phases or {}).items() if "." not in k and isinstance(v, dict)]
    vals = [v for v in vals if v is not None]
    return sum(vals) if vals else None


def tokens_per_cycle(rec: dict) -> float:
    """Tokens a sequence gains per cycle: τ, and on a server whose policy drafted only in a share of its steps,
    1 + (τ − 1) × that share (a plain step yields one token)."""
    m = _m(rec)
    tau = _num(m.accept_length)
    tau = tau if tau is not None and tau >= 1 else 1.0
    share = _num(m.drafted_step_share)
    return 1 + (tau - 1) * share if share is not None and 0 <= share <= 1 else tau


def decode_ms_per_token(rec: dict) -> float | None:
    """ms per generated token while decoding (prefill left out): the run's own figure, else its phases' total
    over the tokens a cycle yields (a served run's engine steps). The runs table's ms/token and decode tok/s,
    compare's ms/token row and the report's per-token bars all read this."""
    v = _num(_m(rec).decode_ms_per_token)
    if v is not None and v > 0:
        return v
    total = phase_total_ms(rec)
    return total / tokens_per_cycle(rec) if total else None


def cycle_mean_ms(rec: dict) -> float | None:
    """Mean ms per cycle: the profiler's, else the phases' total (a served run: per engine step)."""
    cm = _m(rec).cycle_ms
    v = _num(cm.get("mean_ms")) if isinstance(cm, dict) else None
    return v if v is not None else phase_total_ms(rec)


def end_to_end_tok_per_s(rec: dict) -> float | None:
    """Tokens per second with prefill and everything around decoding: e2e_tok_per_s where a producer stored it;
    else the stored tok/s unless it is the decode-only figure (a profile's, equal to decode_tok_per_s). A served
    or ingested run's is the server's output throughput over all requests."""
    m = _m(rec)
    v = _num(m.e2e_tok_per_s)
    if v is not None:
        return v
    t, d = _num(m.tok_per_s), _num(m.decode_tok_per_s)
    if t is None or (d is not None and abs(t - d) <= 1e-9 * max(abs(t), 1.0)):
        return None
    return t


def cycles_measured(rec: dict) -> int | None:
    """How many cycles (verify forwards per sequence) τ and the phase means rest on: the per-cycle samples, the
    profile's count, else a served run's verify count from the server's counters."""
    acc = (rec.get("samples") or {}).get("accept_lengths")
    if acc:
        return len(acc)
    m = _m(rec)
    n = _num(m.cycles)
    if n is None:
        levels = m.extra.get("levels") or [{}]
        sm = (levels[0] if isinstance(levels[0], dict) else {}).get("server_metrics") or {}
        n = _num(sm.get("num_drafts"))
    return int(n) if n is not None else None


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
    """Rows to show: (key, label, higher_is_better, value(rec), samples(rec) -> (num, den) | None, unit,
    floor(rec): the value below which the run's figure is ~0)."""
    defs = _failure_defs(runs) + _speed_defs(runs)
    defs += [
        dict(key="ms_per_token", label="ms/token", higher=False, value=decode_ms_per_token,
             samples=_ms_tok_samples, unit="ms"),
    ]
    defs += _acceptance_defs(runs)
    defs.append(dict(key="cycle_ms", label="ms/cycle", higher=False, value=cycle_mean_ms, samples=_cycle_samples,
                     unit="ms"))
    defs += _phase_defs(runs)
    defs += _baseline_defs(runs)
    defs += _declared_defs(runs)
    for d in defs:
        d.setdefault("floor", lambda rec, u=d["unit"]: FLOORS[u])
    return defs


def _failed(rec):
    v = _m(rec).failed              # bench-serve's and the sweep's runs: requests that got no answer
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _failure_defs(runs: list[dict]) -> list[dict]:
    """Failed requests, where a run had any: its other numbers rest only on the requests that succeeded."""
    if not any(_failed(r) for r in runs):
        return []
    return [dict(key="failed_requests", label="failed requests", higher=False, value=_failed,
                 samples=lambda r: None, unit="requests", floor=lambda r: 0.0)]


def _speed_defs(runs: list[dict]) -> list[dict]:
    if all(_per_prompt(r) for r in runs):
        # benchmarks: tok/s as Spec-Bench defines it (mean over prompts, prefill included), paired by prompt
        # when both runs used the same prompt set; the cycles' decode-only tok/s gets its own row
        defs = [dict(key="tok_per_s", label="tok/s (per prompt)", higher=True, value=lambda r: _m(r).tok_per_s,
                     samples=_prompt_tok_s_samples, paired=True, unit="tok/s")]
        if any(_tok_s_samples(r) for r in runs):
            defs.append(dict(key="decode_tok_per_s", label="decode tok/s", higher=True,
                             value=lambda r: _m(r).decode_tok_per_s, samples=_tok_s_samples, unit="tok/s"))
        return defs
    return [dict(key="tok_per_s", label="tok/s", higher=True, value=lambda r: _m(r).tok_per_s,
                 samples=_tok_s_samples, unit="tok/s")]


def _acceptance_defs(runs: list[dict]) -> list[dict]:
    """τ, where some run drafted, and the acceptance at each draft position (the first 8)."""
    defs = []
    taus = [_m(r).accept_length for r in runs]
    if any(t not in (None, 1, 1.0) for t in taus):
        defs.append(dict(key="accept_length", label="τ (accept length)", higher=True,
                         value=lambda r: _m(r).accept_length, samples=_tau_samples, unit="tokens"))
    # unconditional acceptance per draft position (vLLM's definition): position i accepted ⇔ τ - 1 > i
    depth = max((len(_m(r).per_position_acceptance or []) for r in runs), default=0)
    for i in range(min(depth, 8)):
        def pos_samp(rec, i=i):
            s = rec.get("samples") or {}
            acc, nd = s.get("accept_lengths"), s.get("num_draft")
            if not acc or not nd or len(acc) != len(nd):
                return None
            ind = [1.0 if a - 1 > i else 0.0 for a, n in zip(acc, nd) if n > 0]
            return (ind, _ones(ind)) if ind else None

        def pos_val(rec, i=i):
            v = _m(rec).per_position_acceptance or []
            return v[i] if i < len(v) else None

        defs.append(dict(key=f"acceptance.{i}", label=f"acceptance @{i + 1}", higher=True, value=pos_val,
                         samples=pos_samp, unit="share"))
    return defs


def _phase_defs(runs: list[dict]) -> list[dict]:
    """One ms/cycle row per phase any run has, top-level phases in the profiler's order, sub-phases after theirs."""
    phases = []
    for r in runs:
        for p in (_m(r).phases or {}):
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
                         value=lambda r, p=p: _m(r).phase_ms(p), samples=samp, unit="ms",
                         floor=lambda r: max(FLOORS["ms"], PHASE_FLOOR_SHARE * (cycle_mean_ms(r) or 0.0))))
    return defs


def _baseline_defs(runs: list[dict]) -> list[dict]:
    """Plain decoding's ms/token, where a run carries a baseline measurement."""
    def base_value(r):   # {"baseline": {...}} or the flat figure some producers store
        m = _m(r)
        v = m.baseline.get("decode_ms_per_token") if isinstance(m.baseline, dict) else None
        return v if v is not None else m.baseline_decode_ms_per_token

    if not any(base_value(r) is not None for r in runs):
        return []

    def base_samp(rec):
        col = (rec.get("samples") or {}).get("baseline_step_ms")
        return (col, _ones(col)) if col else None

    return [dict(key="baseline.decode", label="Baseline decode ms/token", higher=False, value=base_value,
                 samples=base_samp, unit="ms")]


def _declared_defs(runs: list[dict]) -> list[dict]:
    """The metrics declared in `metrics.METRICS`, each where some run has it (point values: no samples)."""
    return [dict(key=m.key, label=m.label, higher=m.higher, value=lambda r, m=m: m.of(_m(r)),
                 samples=lambda r: None, unit=m.unit)
            for m in metrics.METRICS if any(m.of(_m(r)) is not None for r in runs)]
