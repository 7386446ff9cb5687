"""What a run measured, typed: `RunMetrics`, stored as a record's `results` (the keys are its field names), and the
metrics `compare` shows beyond its built-in rows (`METRICS`).

    m = RunMetrics.measured(profiler, stats=[r.stats for r in results])    # the engine's, the demo's, a probe's
    rec = make_record("generate", config=..., metrics=m)                     # stored as m.to_results()
    m = RunMetrics.of(rec)                                                   # any stored run, old ones included
    m.acceptance_by_depth_rank, m.verify_tokens_mean, m.hybrid_cycles, ...

Adding a measured number is a field here (and in `measured` where SpecStats or the profiler gives it), and a
`Metric` in METRICS to show it in `compare`, its `--json` and the report's Compare table: this file and the
producer. Keys a producer stores that are no field (a run's wall time, an ingested log's levels) stay in `extra`
and are stored as they came, so a registry written before this type reads the same."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Callable

# What a profiled run states even where it has no figure (plain decoding's τ is None, not missing).
PROFILED = ("tok_per_s", "decode_tok_per_s", "accept_length", "decode_ms_per_token", "cycles", "tokens", "cycle_ms",
            "accept_length_hist", "drafted_tokens", "accepted_tokens")


@dataclass
class RunMetrics:
    # speed
    tok_per_s: float | None = None               # a producer's end-to-end figure, else the cycles' decode tok/s
    decode_tok_per_s: float | None = None        # the cycles only (prefill left out)
    e2e_tok_per_s: float | None = None           # with prefill and everything around decoding
    decode_ms_per_token: float | None = None
    speedup: float | None = None                 # over the paired plain run
    baseline_decode_ms_per_token: float | None = None
    baseline: dict | None = None                 # the paired plain run's {"decode_ms_per_token", "tok_per_s"}
    # cycles and their phases
    cycles: int | None = None
    tokens: int | None = None
    cycle_ms: dict | None = None                 # {"mean_ms", ...}
    phases: dict | None = None                   # {phase: {"mean_ms", ...}}; "draft.step0" a sub-phase of draft
    drafted_step_share: float | None = None      # a server's steps that drafted (its policy may skip some)
    failed: int | None = None                    # requests that got no answer (bench-serve, sweep)
    # acceptance
    accept_length: float | None = None           # τ: tokens per cycle (accepted drafts + the bonus token)
    accept_length_hist: dict | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    per_position_acceptance: list | None = None  # unconditional, per draft depth (vLLM's definition)
    per_position_acceptance_conditional: list | None = None
    accepted_per_pos: list | None = None         # counts behind per_position_acceptance, where a source gave them
    drafts_per_pos: list | None = None
    accepted_by_source: dict | None = None       # a hybrid's accepted tokens by drafter / copy
    accepted_by_source_per_position: dict | None = None
    # the drafter's counts (SpecStats), from which `specscope tune --run` predicts other shapes and budgets
    acceptance_by_depth_rank: dict | None = None
    verify_tokens_mean: float | None = None      # tokens verified per cycle, root included
    hybrid_cycles: dict | None = None
    mean_context: float | None = None            # tokens in context at a mean cycle
    profiler: dict | None = None                 # {"timer", "overhead"}: set for a profiled run
    extra: dict = field(default_factory=dict)    # a producer's own keys, stored as they came
    # fields stored even as None: a profiled run's figures, and what a producer or a stored record stated
    stated: set = field(default_factory=set, repr=False, compare=False)

    # ---- building ----------------------------------------------------------------------------------------------
    @classmethod
    def from_profile(cls, summary: dict) -> "RunMetrics":
        """The fields a `CycleProfiler.summary()` gives."""
        g = summary.get
        m = cls(tok_per_s=g("tok_per_s"), decode_tok_per_s=g("tok_per_s"),  # producers may set tok/s end to end
                accept_length=g("accept_length"), decode_ms_per_token=g("ms_per_token"), cycles=g("cycles"),
                tokens=g("tokens"), cycle_ms=g("cycle_ms"), phases=g("phases", {}),
                accept_length_hist=g("accept_length_hist"), drafted_tokens=g("drafted_tokens"),
                accepted_tokens=g("accepted_tokens"), per_position_acceptance=g("per_position_acceptance", []),
                per_position_acceptance_conditional=g("per_position_acceptance_conditional", []),
                profiler={"timer": g("timer"), "overhead": g("profiler_overhead")}, stated=set(PROFILED))
        if g("accepted_by_source"):
            m.accepted_by_source = g("accepted_by_source")
            m.accepted_by_source_per_position = g("accepted_by_source_per_position")
        return m

    @classmethod
    def measured(cls, profiler=None, stats=()) -> "RunMetrics":
        """The one constructor from what decoding measured: a CycleProfiler (None: none attached) and the SpecStats
        of the generations it profiled (none for plain decoding), merged over them (one per prompt, say)."""
        m = cls.from_profile(profiler.summary()) if profiler is not None else cls()
        stats = [s for s in stats if s is not None]
        if not stats:
            return m
        from specscope.speculative.acceptance import RankCounts, SourceCounts   # torch: the readers never need it

        m.acceptance_by_depth_rank = RankCounts.merge([s.acceptance_by_depth_rank for s in stats])
        n = sum(s.cycles for s in stats)
        m.verify_tokens_mean = (sum(s.verify_tokens_mean * s.cycles for s in stats if s.cycles) / n) if n else None
        if any(s.hybrid for s in stats):     # other n-gram budgets of a hybrid are predicted from these
            m.hybrid_cycles = SourceCounts.merge([s.hybrid_cycles for s in stats])
            if m.accepted_by_source is None:
                m.accepted_by_source = SourceCounts.merge([s.accepted_by_source for s in stats])
        return m

    def update(self, results: dict | None) -> "RunMetrics":
        """Stored keys over these fields (a producer's explicit figures win over the profile's); returns self."""
        names = _names()
        for k, v in (results or {}).items():
            if k in names:
                setattr(self, k, v)
                self.stated.add(k)
            else:
                self.extra[k] = v
        return self

    def copy(self) -> "RunMetrics":
        return replace(self, extra=dict(self.extra), stated=set(self.stated))

    # ---- stored JSON -------------------------------------------------------------------------------------------
    @classmethod
    def from_results(cls, results: dict | None) -> "RunMetrics":
        """A record's `results` as stored, by any version: known keys into fields, the rest into `extra`."""
        return cls().update(results if isinstance(results, dict) else {})

    @classmethod
    def of(cls, rec: dict) -> "RunMetrics":
        return cls.from_results((rec or {}).get("results"))

    def to_results(self) -> dict:
        """The stored `results`: every field that has a value or was stated (None included), then `extra`.
        `from_results(m.to_results())` gives m back, and a stored record's keys are stored again as they were."""
        out = {f: getattr(self, f) for f in _names() if getattr(self, f) is not None or f in self.stated}
        return {**out, **self.extra}

    # ---- derived -----------------------------------------------------------------------------------------------
    def phase_ms(self, name: str, stat: str = "mean") -> float | None:
        """A phase's ms per cycle: its mean, or `stat` ("median", "p90") where stored, else the mean; None where the
        run has no such phase."""
        ph = (self.phases or {}).get(name)
        return number(ph.get(f"{stat}_ms", ph.get("mean_ms"))) if isinstance(ph, dict) else None


def _names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(RunMetrics) if f.name not in ("extra", "stated"))


def number(v) -> float | None:
    """A stored value as a finite float; None for a missing, boolean, non-numeric or non-finite one."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


@dataclass(frozen=True)
class Metric:
    """A number `compare` shows for each run, after its built-in rows (speed, τ, acceptance, phases): its row in
    the table, in `--json` and in the report's Compare table. A run without it leaves its cell empty; the row is
    shown where any run has it."""
    key: str                                   # the row's id in compare's JSON
    label: str
    higher: bool                               # is a higher value better
    unit: str                                  # "ms", "tok/s", "tokens" or "share": its noise floor (rows.FLOORS)
    value: Callable[[RunMetrics], float | None] | None = None   # default: the stored number named `key`

    def of(self, m: RunMetrics) -> float | None:
        if self.value is not None:
            return number(self.value(m))
        return number(getattr(m, self.key) if self.key in _names() else m.extra.get(self.key))


METRICS: list[Metric] = [
    Metric("verify_tokens_mean", "verified tokens/cycle", higher=False, unit="tokens"),
]
