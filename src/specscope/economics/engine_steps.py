"""A serving engine's own verify cost by batch size, from its step records (the vLLM plugin's JSONL,
`plugins/steps.py`, read by `specscope ingest`).

Per step the plugin records its phase times, the requests in it (B) and the draft tokens each request verified, so
each step is one point of the surface T(B, n): B sequences each verifying n = 1 + drafts tokens in one target
forward. The forward is the step's `verify` phase when it verified drafts, else `decode` (the plugin maps vLLM's
forward and logits scopes onto these, as specscope's own verify includes the logits). Grouped by (B, n), the median
forward is T(B, n), stored in the layout `verify_curve.surface_results` writes, so `VerifySurface` reads it like a
measured surface. Each point also keeps its step count and the medians of the step's drafting (`draft_ms`) and of
the rest of the step (`rest_ms`: sampling, bookkeeping, host time no scope covers): per step, for all B requests,
because the engine drafts and samples the whole batch at once.

The steps carry no context length: a point holds the engine's own mix of contexts (stored as context 0).

`EngineCosts` joins a speculative run's surface with its baseline's plain steps: per batch size, the cost of a plain
step and of a speculative cycle, which the tuner and break-even read instead of scaling the run's means (which, from
a server under load, mix every batch size it ran).
"""

from __future__ import annotations

import math
import re
import statistics

from specscope.economics.verify_curve import VerifySurface, fit_piecewise, summarize, surface_results
from specscope.errors import SpecscopeError

SOURCE = "engine steps"
MIN_STEPS = 5           # steps per (B, n) point: fewer give a median that one slow step can move
TOLERANCE_MS = 1e-3     # phases are rounded to 5 decimals: their sum may pass the step's total by that much
SHOWN = 6               # dropped points named in a warning


def _point_of(row: dict):
    """((B, n), (forward, draft, rest) ms) of one step record, or why it is no point of the surface."""
    kind = row.get("kind")
    if kind not in ("verify", "decode"):
        return "not a decode or verify step"
    drafted, B = row.get("drafted") or [], row.get("reqs")
    if not drafted or len(drafted) != B:
        return "its per-request draft counts do not match its requests"
    if len(set(drafted)) != 1:
        return "its requests verified different numbers of tokens"
    n = 1 + drafted[0]
    if (n > 1) != (kind == "verify"):
        return "its kind disagrees with its draft counts"
    ms = row.get("ms") or {}
    fwd, draft, total = ms.get(kind), ms.get("draft", 0.0), row.get("total_ms")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (fwd, draft, total)) or fwd <= 0:
        return "no target forward time"
    rest = total - fwd - draft
    if rest < -TOLERANCE_MS:
        return "its phases add up to more than the step"
    return (B, n), (float(fwd), float(draft), max(0.0, rest))


def surface_from_steps(rows, min_steps: int = MIN_STEPS) -> tuple[dict | None, list[str]]:
    """(results["surface"] or None, warnings) from step records as `ingest.plugin_steps` parses them."""
    groups: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    skipped: dict[str, int] = {}
    for r in rows:
        got = _point_of(r)
        if isinstance(got, str):
            skipped[got] = skipped.get(got, 0) + 1
            continue
        groups.setdefault(got[0], []).append(got[1])
    warnings = []
    if skipped:
        warnings.append(f"{sum(skipped.values())} step(s) left out of the verify surface: "
                        + ", ".join(f"{why} ({k})" for why, k in sorted(skipped.items(), key=lambda x: -x[1])))
    points, dropped = [], []
    for (B, n), ts in sorted(groups.items()):
        if len(ts) < min_steps:
            dropped.append(f"batch {B} × {n} token(s) ({len(ts)} step(s))")
            continue
        # medians (what T is); the means beside them are what wall-clock throughput is made of (tune --stat mean)
        points.append({"batch": B, "context": 0, "tokens": n, **summarize([t[0] for t in ts]),
                       "mean_ms": statistics.fmean(t[0] for t in ts), "steps": len(ts),
                       "draft_ms": statistics.median(t[1] for t in ts),
                       "draft_mean_ms": statistics.fmean(t[1] for t in ts),
                       "rest_ms": statistics.median(t[2] for t in ts),
                       "rest_mean_ms": statistics.fmean(t[2] for t in ts)})
    if dropped:
        more = f", and {len(dropped) - SHOWN} more" if len(dropped) > SHOWN else ""
        warnings.append(f"{len(dropped)} (batch, tokens) point(s) with fewer than {min_steps} steps left out of the "
                        f"verify surface: {', '.join(dropped[:SHOWN])}{more}")
    if not points:
        if groups:
            warnings.append(f"no verify surface: no (batch, tokens) point has {min_steps} steps")
        return None, warnings
    return surface_results(_surface(points, min_steps)), warnings


def _surface(points: list[dict], min_steps: int) -> dict:
    fits = {}
    for B in sorted({p["batch"] for p in points}):
        pts = [p for p in points if p["batch"] == B]
        fits[str(B)] = {"0": fit_piecewise([p["tokens"] for p in pts], [p["median_ms"] for p in pts]).to_dict()}
    return {"context": None, "region": None, "batches": sorted({p["batch"] for p in points}),
            "tokens": sorted({p["tokens"] for p in points}), "points": points, "fits": fits, "source": SOURCE,
            "min_steps": min_steps}


# an ingested plugin run's own steps; a sweep's pooled steps of one engine over its launches (sweep/surface.py)
KINDS = ("ingest", "engine_surface")


def engine_surface(run: dict | None) -> dict | None:
    """The surface a run made from its engine's own steps (an ingested plugin run, a sweep's engine surface), or
    None."""
    if not run or run.get("kind") not in KINDS:
        return None
    s = (run.get("results") or {}).get("surface")
    return s if isinstance(s, dict) and s.get("source") == SOURCE and s.get("points") else None


def _interp(table: dict[int, float], B: float) -> float:
    """Linear in B between the measured batch sizes, as VerifySurface reads T between them."""
    if B in table:
        return table[B]
    lo = max(b for b in table if b <= B)
    hi = min(b for b in table if b >= B)
    return table[lo] + (table[hi] - table[lo]) * (B - lo) / (hi - lo)


def _pooled(points: list[dict], key: str) -> float:
    """A per-step figure pooled over a batch size's points, weighted by their steps."""
    n = sum(p["steps"] for p in points)
    return sum(p[key] * p["steps"] for p in points) / n


class EngineCosts:
    """One engine's step costs by batch size B, at the batch sizes where it recorded both plain steps (n = 1) and
    speculative ones: the forward T(B, n), the rest of a plain step, and a speculative step's drafting and rest (per
    step, all B requests). Between measured batch sizes linear in B; outside them refused, as VerifySurface does.
    Where the steps measured several chain widths at every batch size (a sweep over num_speculative_tokens),
    drafting is read per width too (`by_width`: {B: {n: ms}})."""

    def __init__(self, forward: VerifySurface, plain_rest: dict, draft: dict, spec_rest: dict, run_id=None,
                 baseline_id=None, stat: str = "median", by_width: dict | None = None, config: dict | None = None,
                 kind: str = "ingest"):
        self.forward, self.plain_rest, self.draft, self.spec_rest = forward, plain_rest, draft, spec_rest
        self.run_id, self.baseline_id, self.stat = run_id, baseline_id, stat
        self.by_width, self.config, self.kind = by_width, dict(config or {}), kind
        self.sole = False     # given as --verify-curve: nothing else prices plain decoding or verify

    @classmethod
    def from_runs(cls, run: dict, baseline: dict | None = None,
                  stat: str = "mean") -> tuple["EngineCosts | None", str | None]:
        """(costs, None), or (None, why not) when the run has an engine surface that cannot price a plain step and
        a speculative cycle at any one batch size, or (None, None) when it has none (not a plugin run or an engine
        surface, or ingested before surfaces were kept). Plain steps come from the baseline when it is a plugin
        run with them (the engine without speculation), else from the run's own steps without drafts (an engine
        surface's baseline cells). stat "mean" reads each point's means (as `tune --stat mean` reads a run's
        phases: stalls are part of throughput), "median" its medians."""
        if stat not in ("mean", "median"):
            raise SpecscopeError(f"stat must be mean or median, got {stat!r}")
        spec = engine_surface(run)
        if spec is None:
            return None, None
        rid = run.get("id", "?")
        base = engine_surface(baseline)
        plain_from = base if base and any(p["tokens"] == 1 for p in base["points"]) else spec
        plain = {p["batch"]: p for p in plain_from["points"] if p["tokens"] == 1}
        specs = [p for p in spec["points"] if p["tokens"] > 1]
        if not specs:
            return None, (f"run {rid}'s engine steps verified no draft tokens at any batch size with "
                          f"{spec.get('min_steps', MIN_STEPS)} steps or more")
        if not plain:
            return None, (f"the engine steps of run {rid} hold no plain decoding steps: pass --baseline-run (the "
                          f"plugin's JSONL of the same engine without speculation, ingested) to price plain "
                          f"decoding by batch size")
        both = sorted(set(plain) & {p["batch"] for p in specs})
        if not both:
            return None, (f"the engine's plain steps (batch {_sizes(plain)}) and speculative steps (batch "
                          f"{_sizes({p['batch'] for p in specs})}) share no batch size")
        bid = baseline.get("id") if plain_from is base else None
        return cls._priced(run, spec, plain, [p for p in specs if p["batch"] in both], stat, bid), None

    @classmethod
    def _priced(cls, run: dict, spec: dict, plain: dict, specs: list[dict], stat: str, bid) -> "EngineCosts":
        """From the plain points by batch size and the speculative points at those batch sizes."""
        m = "_mean_ms" if stat == "mean" else "_ms"
        both = sorted({p["batch"] for p in specs})
        # the forward read as T (VerifySurface reads median_ms): the median, or the mean in its place
        points = [dict(p, median_ms=p["mean_ms"] if stat == "mean" else p["median_ms"])
                  for p in [plain[B] for B in both] + specs]
        surface = _surface(sorted(points, key=lambda p: (p["batch"], p["tokens"])), spec.get("min_steps", MIN_STEPS))
        by = {B: [p for p in specs if p["batch"] == B] for B in both}
        widths = {B: {p["tokens"]: p["draft" + m] for p in by[B]} for B in both}
        rid = run.get("id", "?")
        return cls(VerifySurface.from_results(surface, rid), {B: _pooled([plain[B]], "rest" + m) for B in both},
                   {B: _pooled(by[B], "draft" + m) for B in both}, {B: _pooled(by[B], "rest" + m) for B in both},
                   rid, bid, stat, widths if all(len(w) > 1 for w in widths.values()) else None,
                   run.get("config"), run.get("kind", "ingest"))

    @property
    def batches(self) -> list[int]:
        return self.forward.batches

    @property
    def tokens(self) -> list[int]:
        return sorted({n for c in self.forward.curves.values() for pts in c.points.values() for n in pts})

    @property
    def engine(self) -> str | None:
        return self.config.get("engine")

    @property
    def plain_id(self):
        """The run whose plain steps price plain decoding."""
        return self.baseline_id or self.run_id

    @property
    def label(self) -> str:
        if self.kind == "engine_surface":
            sweep = self.config.get("sweep")
            return f"the steps of engine surface run {self.run_id}" + (f" (sweep {sweep})" if sweep else "")
        of = f"run {self.run_id}" + (f", plain steps of run {self.baseline_id}" if self.baseline_id else "")
        return f"the engine's own steps ({of})"

    @property
    def pinned(self) -> str | None:
        """How the steps' runs pinned acceptance (vLLM's synthetic rejection sampling), or None."""
        c = self.config
        if c.get("rejection_sample_method") != "synthetic":
            return None
        how = [f"{k} {c[k]}" for k in ("synthetic_acceptance_length", "synthetic_acceptance_rates") if k in c]
        return ", ".join(["rejection_sample_method synthetic"] + how)

    def covers(self, batch: float) -> bool:
        return self.forward.covers(batch)

    def uncovered(self, batches, what: str = "batch") -> str:
        """Why these batch sizes are not priced, in one line."""
        sizes = "batch size 1 only" if self.batches == [1] else f"batch sizes {_sizes(self.batches)}"
        past = "past batch 1" if self.batches == [1] else "outside them"
        fix = (f"sweep the engine with --max-concurrency including {max(batches)}" if self.kind == "engine_surface"
               else f"record the engine serving that many requests at once (e.g. `specscope bench-serve "
                    f"--max-concurrency {max(batches)}`) and ingest its steps")
        return (f"{self.label} cover {sizes}: {what} {_sizes(batches)} cannot be predicted {past} (no "
                f"extrapolation); {fix}")

    def _check(self, batch: float):
        if not self.covers(batch):
            raise SpecscopeError(self.uncovered([batch]))

    def verify(self, n: float, batch: float) -> float:
        """One target forward over `batch` sequences of n tokens each."""
        self._check(batch)
        return self.forward(batch, n, 0)

    def decode(self, batch: float) -> float:
        """One plain step over `batch` sequences: its forward and the rest of the step."""
        self._check(batch)
        return self.forward(batch, 1, 0) + _interp(self.plain_rest, batch)

    def drafting(self, batch: float, n: float | None = None) -> float:
        """A speculative step's drafting at `batch` sequences (the engine drafts them together): at chain width n
        where the steps measured several widths at every batch size (linear in n between them, the nearest two's
        line past them, never below 0), else pooled over the widths measured."""
        self._check(batch)
        if n is None or self.by_width is None:
            return _interp(self.draft, batch)
        return _interp({B: _in_n(w, n) for B, w in self.by_width.items()}, batch)

    def draft_per_seq(self, batch: float) -> float:
        """A speculative step's drafting at `batch` sequences, per sequence (the engine drafts them together)."""
        return self.drafting(batch) / batch

    def other_per_seq(self, batch: float) -> float:
        """A speculative step's sampling and bookkeeping at `batch` sequences, per sequence."""
        self._check(batch)
        return _interp(self.spec_rest, batch) / batch

    def describe(self) -> str:
        return (f"costs by batch size from {self.label}: batch {_sizes(self.batches)}, n = "
                f"{', '.join(map(str, self.tokens))} token(s) per sequence ({self.stat}s of the steps); batch sizes "
                f"outside them are not predicted")

    def notes(self) -> list[str]:
        """describe(), and how acceptance was pinned where it was: never the drafter's."""
        pinned = [] if self.pinned is None else [
            f"run {self.run_id} measured these costs at pinned acceptance ({self.pinned}): the engine's test "
            f"setting, not any drafter's; its acceptance is not used"]
        return [self.describe()] + pinned

    def summary(self) -> dict:
        out = {"source": SOURCE, "run": self.run_id, "baseline_run": self.baseline_id, "batches": self.batches,
               "tokens": self.tokens, "stat": self.stat}
        if self.kind == "engine_surface":
            out.update(kind=self.kind, engine=self.engine, acceptance_pinned=self.pinned)
        return out


def _in_n(widths: dict, n: float) -> float:
    """Drafting at chain width n from the widths measured (at least two): linear between the nearest two."""
    ns = sorted(widths)
    lo = max([x for x in ns[:-1] if x <= n] or ns[:1])
    hi = min(x for x in ns if x > lo)
    return max(0.0, widths[lo] + (widths[hi] - widths[lo]) * (n - lo) / (hi - lo))


# ------------------------------------------------------------------------------------------------ --verify-curve

def surface_costs(surf: dict, run: dict | None = None, stat: str = "mean") -> EngineCosts:
    """EngineCosts from a run given as --verify-curve that holds an engine surface (`engine_surface`): its own
    n = 1 points price plain decoding. Refused in one line when it has none, or when `run` (the run whose
    acceptance is read) is another engine's or another target's."""
    sid = surf.get("id", "?")
    spec = engine_surface(surf)
    if spec is None:
        raise SpecscopeError(f"--verify-curve {sid} holds no engine surface")
    if run is not None:
        check_same_target(surf, run)
    if not any(p["tokens"] == 1 for p in spec["points"]):
        fix = ("run its sweep again with --baseline-without speculative-config, whose baseline cells give them"
               if surf.get("kind") == "engine_surface" else
               "pass a surface that has them (a sweep's engine surface, with --baseline-without speculative-config)")
        raise SpecscopeError(f"--verify-curve {sid}: its engine steps hold no plain decoding steps (n = 1), which "
                             f"price plain decoding; {fix}")
    costs, why = EngineCosts.from_runs(surf, None, stat)
    if costs is None:
        raise SpecscopeError(f"--verify-curve {sid}: {why}")
    costs.sole = True
    return costs


def surface_as_run(run: dict) -> str:
    """Why an engine surface is no run to read acceptance from."""
    return (f"run {run.get('id', '?')} is an engine surface (costs measured at pinned acceptance, not a drafter's "
            f"run): pass it as --verify-curve, and a drafter's run as --run for its acceptance")


def check_same_target(surf: dict, run: dict) -> None:
    """Refuse pricing `run`'s acceptance with the costs of another engine or another target: the engines must
    match where the run names one (a specscope run names none: its drafter's acceptance carries over); the targets
    by content hash where both have one, else by name (the name, its last path part, a known model's hub id)."""
    s, r = surf.get("config") or {}, run.get("config") or {}
    sid, rid = surf.get("id", "?"), run.get("id", "?")
    if r.get("engine") and s.get("engine") and r["engine"] != s["engine"]:
        raise SpecscopeError(f"--verify-curve {sid} holds {s['engine']}'s costs and run {rid} was measured in "
                             f"{r['engine']}: pass a surface of {r['engine']} serving the same target")
    hs, hr = s.get("model_hash"), r.get("model_hash")
    ns, nr = _names(s), _names(r)
    other = hs != hr if hs and hr else bool(ns and nr and not ns & nr)
    if other:
        raise SpecscopeError(f"--verify-curve {sid} was measured on target {_shown(s)} and run {rid} on "
                             f"{_shown(r)}: pass a surface measured on the run's target")


def _names(cfg: dict) -> set[str]:
    from specscope.models.hub import KNOWN_MODELS

    out = set()
    for key in ("model", "model_name", "served_model"):
        v = cfg.get(key)
        if not isinstance(v, str) or not v.strip():
            continue
        v = v.strip().rstrip("/").lower()
        out |= {v, v.rsplit("/", 1)[-1]}
        hub = re.search(r"models--([^/]+?)--([^/]+)", v)       # a Hugging Face cache directory
        if hub:
            out |= {f"{hub[1]}/{hub[2]}", hub[2]}
        known = KNOWN_MODELS.get(v)
        if known is not None and known.hf_repo:
            out |= {known.hf_repo.lower(), known.hf_repo.lower().rsplit("/", 1)[-1]}
    return out


def _shown(cfg: dict) -> str:
    return next((str(cfg[k]) for k in ("model_name", "served_model", "model") if cfg.get(k)), "?")


def _sizes(bs) -> str:
    return ", ".join(map(str, sorted(bs)))
