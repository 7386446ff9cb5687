"""The tuner: predict the best (steps, topk, draft_tokens) from one profiled run, without a sweep.

From the run it takes acceptance by (depth, sibling rank) — or, for a chain run, per-position acceptance — and the
per-cycle phase costs; a verify curve scales the verify (and draft-expansion) cost to other widths. Every candidate
configuration gets a predicted τ (the tree the drafter would build, `cost.expected_tree`) and a predicted speedup
τ·T_decode / (T_draft(steps, topk) + T_verify(n) + T_other). `validate` runs the top ones for real.

A hybrid run (DRAFTER+ngram) also picks the n-gram budget: copied tokens cost nothing to draft but widen the
verify; what they add over the drafter alone comes from the run's own cycles (`HybridModel`).

At B concurrent sequences (engine/batch.py) a verify surface T(B, n) scales the plain step and the verify forward
to that batch size and the batch's drafting (one drafter forward per level for every sequence), bookkeeping running
per sequence; `by_concurrency` picks the best shape per level and `crossover` the concurrency past which plain
decoding is faster. A serving engine's plugin run brings its own costs by batch size instead
(`engine_steps.EngineCosts`: the forward, drafting and the rest of its recorded steps).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from specscope.economics.breakeven import decode_ms_of
from specscope.economics.cost import CycleCost, expected_tree, tree_tau
from specscope.economics.verify_curve import DEFAULT_BATCHES
from specscope.errors import SpecscopeError
from specscope.registry.metrics import RunMetrics


# ------------------------------------------------------------------------------------------------ acceptance

@dataclass
class AcceptanceModel:
    """rates[d-1][r-1] = P(rank-r child at depth d accepted | parent accepted). Depths past the measured ones
    reuse the deepest row; a rank a deep row lacks (never offered there) reuses the nearest shallower row's;
    ranks never measured at depth 1 are unknown (configurations needing them are skipped)."""

    rates: list[list[float]]
    offered: list[list[int]] | None = None
    source: str = ""
    chain: list[float] | None = None     # rank-1 acceptance along the all-rank-1 path (what a chain sees)
    # trees: measured / modelled (τ - 1) of the profiled tree. The model keeps the nodes most likely to be
    # accepted; the drafter ranks by its own confidence and keeps somewhat worse ones.
    tree_scale: float = 1.0

    @property
    def depth(self) -> int:
        return len(self.rates)

    @property
    def max_topk(self) -> int:
        return len(self.rates[0]) if self.rates else 0

    def chain_rate(self, d: int, r: int) -> float:
        """For chains: a rank-1 child whose ancestors are all rank 1; pooled rates when that was not recorded."""
        if r != 1 or not self.chain:
            return self.rate(d, r)
        return self.chain[min(d, len(self.chain)) - 1]

    def rate(self, d: int, r: int) -> float:
        row = self.row(d)
        return row[r - 1] if r - 1 < len(row) else 0.0

    def row(self, d: int) -> list[float]:
        """Every rank's rate at depth d: the measured ones, then the ranks this depth never offered borrowed from
        the nearest shallower row. Siblings are exclusive, so when the borrowed ranks would push the row's sum
        above 1 they are scaled down to what the measured ranks leave (a well-fed drafter: deep rank 1 near 0.9
        while a shallow rank 3 was 0.1)."""
        rows = self.rates[:min(d, self.depth)]
        if not rows:
            return []
        own = list(rows[-1])
        borrowed = []
        for r in range(len(own), max(len(x) for x in rows)):
            borrowed.append(next(x[r] for x in reversed(rows) if r < len(x)))
        room = max(0.0, 1.0 - sum(own))
        if sum(borrowed) > room:
            borrowed = [b * room / sum(borrowed) for b in borrowed]
        return own + borrowed

    @classmethod
    def from_counts(cls, accepted, offered, source="rank counts", top_accepted=None,
                    top_offered=None) -> "AcceptanceModel":
        if not offered or not offered[0] or not offered[0][0]:
            raise SpecscopeError("the run has no offered draft tokens to estimate acceptance from")
        rates, offered_kept = [], []
        for d, (acc_row, off_row) in enumerate(zip(accepted, offered)):
            # ranks never offered at this depth are unknown; they end the row (ranks are offered as a prefix)
            k = next((r for r, o in enumerate(off_row) if o == 0), len(off_row))
            if k == 0:
                break
            row = [acc_row[r] / off_row[r] for r in range(k)]
            s = sum(row)
            if s > 1.0:   # siblings are exclusive; a sum above 1 is sampling noise of different denominators
                row = [x / s for x in row]
            rates.append(row)
            offered_kept.append(list(off_row[:k]))
        chain = None
        if top_accepted and top_offered:
            chain = [a / o for a, o in zip(top_accepted, top_offered) if o > 0] or None
        return cls(rates, offered_kept, source, chain)

    @classmethod
    def from_conditional(cls, cond, source="per-position acceptance (chain)") -> "AcceptanceModel":
        rates, last = [], None
        for c in cond:
            c = last if c is None else float(c)
            if c is None:
                break
            rates.append([min(1.0, max(0.0, c))])
            last = c
        if not rates:
            raise SpecscopeError("the run has no per-position acceptance")
        return cls(rates, None, source)

    @classmethod
    def from_run(cls, run: dict) -> "AcceptanceModel":
        m, cfg = RunMetrics.of(run), run.get("config") or {}
        rid = run.get("id", "?")
        rank = m.acceptance_by_depth_rank
        topk = cfg.get("topk") or (cfg.get("drafting") or {}).get("topk")
        if rank:
            acc = cls.from_counts(rank["accepted"], rank["offered"], f"run {rid}: acceptance by depth and rank",
                                  rank.get("top_path_accepted"), rank.get("top_path_offered"))
            tau = m.accept_length
            if m.hybrid_cycles:       # calibrate to the drafter's own τ, not the copy's gains
                tau = HybridModel.from_run(run).drafted_tau
            if topk and topk > 1 and cfg.get("steps") and cfg.get("draft_tokens") and tau:
                model = tree_tau(*expected_tree(acc.rate, cfg["steps"], topk, cfg["draft_tokens"]))
                if model > 1.0:
                    acc.tree_scale = min(1.5, max(0.5, (tau - 1.0) / (model - 1.0)))
            return acc
        if topk not in (None, 1):
            raise SpecscopeError(f"run {rid} is a tree run (topk {topk}) without acceptance by sibling rank, which "
                                 f"tree predictions need; profile it with `specscope tune --profile ...` or pass a "
                                 f"chain run (topk 1)")
        cond = m.per_position_acceptance_conditional
        if cond:
            return cls.from_conditional(cond, f"run {rid}: per-position acceptance")
        acc, dr = m.accepted_per_pos, m.drafts_per_pos
        if acc and dr:
            uncond = [a / d if d else 0.0 for a, d in zip(acc, dr)]
            cond = [u / p if p else None for u, p in zip(uncond, [1.0] + uncond[:-1])]
            return cls.from_conditional(cond, f"run {rid}: accepted per position")
        raise SpecscopeError(f"run {rid} has no per-position acceptance; it is not a profiled speculative run")


@dataclass
class HybridModel:
    """A hybrid run's cycles (`SourceCounts.cycles`), each (mode, a_d, a_c, c_len, c_new, count): "tree" cycles
    verified the drafter's tree with the copy grafted on, "copy" cycles the copy alone; a_d / a_c accepted nodes
    drafted / copied, c_len the copy's nodes, c_new the ones it added. Copies are prefixes of one chain, so a
    shorter n-gram budget L is exact on these cycles: the copy accepts min(a_c, L) and adds the nodes of its first L
    past those it shares. Longer budgets than the run's are not predicted. What the copy adds is measured against
    the run's drafter shape and carried to other shapes (an approximation: a better tree leaves the copy less)."""

    cycles: list[tuple]
    ngram_tokens: int          # the run's n-gram budget
    copy_budget: int           # the run's copy-cycle chain: draft_tokens - 1 + ngram_tokens

    @classmethod
    def from_run(cls, run: dict) -> "HybridModel":
        cfg = run.get("config") or {}
        rows = []
        for key, n in (RunMetrics.of(run).hybrid_cycles or {}).items():
            mode, *nums = key.split(",")
            rows.append((mode, *map(int, nums), int(n)))
        if not rows:
            raise SpecscopeError(f"run {run.get('id', '?')} has no hybrid cycles")
        L = int(cfg.get("ngram_tokens") or 0)
        return cls(rows, L, int(cfg.get("draft_tokens") or 1) - 1 + L)

    def _mean(self, mode: str, f) -> float:
        rows = [r for r in self.cycles if r[0] == mode]
        n = sum(r[-1] for r in rows)
        return sum(f(*r[1:5]) * r[-1] for r in rows) / n if n else 0.0

    @property
    def copy_share(self) -> float:
        """The share of cycles the drafter sat out (a long copy in hand); it does not depend on the shape."""
        return sum(r[-1] for r in self.cycles if r[0] == "copy") / sum(r[-1] for r in self.cycles)

    @property
    def drafted_tau(self) -> float:
        """τ the drafter's own tree reached in tree cycles."""
        return 1.0 + self._mean("tree", lambda a_d, a_c, n, new: a_d)

    def tree_gain(self, L: int) -> float:
        """Extra accepted tokens per tree cycle from a copy of L tokens over the drafter alone."""
        return self._mean("tree", lambda a_d, a_c, n, new: max(a_d, min(a_c, L)) - a_d)

    def tree_nodes(self, L: int) -> float:
        """Verify rows a copy of L tokens adds to a tree cycle (past the nodes it shares with the tree)."""
        return self._mean("tree", lambda a_d, a_c, n, new: max(0, min(n, L) - (n - new)))

    def copy_tau(self, budget: int) -> float:
        return 1.0 + self._mean("copy", lambda a_d, a_c, n, new: min(a_c, budget))

    def copy_rows(self, budget: int) -> float:
        return 1.0 + self._mean("copy", lambda a_d, a_c, n, new: min(n, budget))


# ------------------------------------------------------------------------------------------------ costs

@dataclass
class CostModel:
    """Per-cycle costs measured in one run at (k0 frontier width, n0 verified tokens), scaled to other widths.

    Expansion steps and verify are transformer forwards over k (n) query tokens, so both scale with the verify
    curve's shape T(n)/T(n0); without a curve they are taken as flat (bandwidth-bound)."""

    decode_ms: float
    step0_ms: float            # draft.step0: the drafter's catch-up over the accepted tokens + the first top-k
    expand_ms: float           # one further draft step at frontier width k0
    select_ms: float           # draft time outside the steps (tree selection), per candidate node
    verify_ms: float           # verify at n0 tokens
    other_ms: float            # accept + commit + bookkeeping
    k0: int
    n0: float
    context: float
    curve: object = None       # VerifyCurve or None
    notes: list = field(default_factory=list)
    surface: object = None     # VerifySurface or None: T(B, n) for batch sizes above 1
    # EngineCosts or None: a serving engine's own step costs by batch size (its plugin run), read where they cover
    # a batch size instead of scaling this run's means, which a server under load measured over every batch size
    engine: object = None
    draft_ref_ms: float | None = None    # the run's own draft time, what draft_ms(its shape) is built from

    def _engine(self, batch: float):
        return self.engine if self.engine is not None and self.engine.covers(batch) else None

    def covers(self, batch: int) -> bool:
        """Whether predictions at `batch` can be priced: the engine's steps, where given, cover it; else batch 1
        always, larger ones from the verify surface."""
        if self.engine is not None:
            return self.engine.covers(batch)
        return batch == 1 or (self.surface is not None and self.surface.covers(batch))

    def _scale(self, n: float, n_ref: float) -> float:
        return self.curve.ratio(n, n_ref, self.context) if self.curve is not None else 1.0

    def _surface(self, batch: int):
        if self.surface is None:
            raise SpecscopeError(f"predictions at batch {batch} need a verify surface: measure one with "
                                 f"`specscope verify-curve --batch 1,2,4,8,16` and pass it as --verify-curve")
        return self.surface

    def decode(self, batch: int = 1) -> float:
        """One plain step over `batch` sequences: the measured batch-1 time × T(B, 1)/T(1, 1)."""
        if self._engine(batch):
            return self.engine.decode(batch)
        if batch == 1:
            return self.decode_ms
        S = self._surface(batch)
        return self.decode_ms * S(batch, 1, self.context) / S(1, 1, self.context)

    def drafted_only(self, share: float) -> "CostModel":
        """This model with the drafter's per-cycle costs averaged over the `share` of cycles it ran in (a hybrid
        skips it on long copies; the copy itself costs nothing to draft)."""
        k = 1.0 / max(share, 1e-9)
        return replace(self, step0_ms=self.step0_ms * k, expand_ms=self.expand_ms * k, select_ms=self.select_ms * k)

    def draft_ms(self, steps: int, topk: int, batch: int = 1) -> float:
        """One cycle's drafting. At batch B the engine runs every sequence's drafter forwards as one (catch-up on
        ~1-2 rows a sequence, then topk rows a sequence per level), which grow with rows as the target's forward
        does (the surface's T(B, k)/T(1, k)); choosing each tree's nodes runs per sequence."""
        if batch == 1:
            return (self.step0_ms + (steps - 1) * self.expand_ms * self._scale(topk, self.k0)
                    + self.select_ms * candidates(steps, topk))
        S, c = self._surface(batch), self.context
        grow = lambda k: S(batch, k, c) / S(1, k, c)   # noqa: E731
        return (self.step0_ms * grow(2) + (steps - 1) * self.expand_ms * self._scale(topk, self.k0) * grow(topk)
                + batch * self.select_ms * candidates(steps, topk))

    def draft_at(self, steps: int, topk: int, batch: int = 1) -> float:
        """The batch's drafting per cycle at `batch`: draft_ms, or from the engine's steps its drafting at that
        batch size: for a chain, where the steps measured several widths, at this one (`EngineCosts.drafting`);
        else their drafting (per sequence x B) scaled by this shape's draft_ms over the run's own."""
        if not self._engine(batch):
            return self.draft_ms(steps, topk, batch)
        if topk == 1 and self.engine.by_width is not None:
            return self.engine.drafting(batch, steps + 1)
        d = self.draft_ms(steps, topk)
        per_seq = self.engine.draft_per_seq(batch)
        return batch * (per_seq * d / self.draft_ref_ms if self.draft_ref_ms else per_seq)

    def other_at(self, batch: int = 1) -> float:
        return self.engine.other_per_seq(batch) if self._engine(batch) else self.other_ms

    def verify(self, n: float, batch: int = 1) -> float:
        """One verify forward over `batch` sequences of n tokens each. With a verify surface: this run's decode step
        × T(B, n)/T(1, 1), so verify and plain decoding are priced from one measurement (the surface's, taken
        interleaved) -- anchored at the run's verify time at its own wide shape instead, the two drifted apart
        (bench/results/spec_concurrency.json: a 5-token verify priced below a plain step, a 3-token one at 1.3 of
        it). Without one: the run's verify time × the batch-1 curve's T(n)/T(n0)."""
        if self._engine(batch):
            return self.engine.verify(n, batch)
        if self.surface is not None and self.surface.covers(batch):
            S = self.surface
            return self.decode_ms * S(batch, n, self.context) / S(1, 1, self.context)
        if batch == 1:
            return self.verify_ms * self._scale(n, self.n0)
        S = self._surface(batch)
        return self.verify_ms * S(batch, n, self.context) / S(1, self.n0, self.context)

    @classmethod
    def from_runs(cls, run: dict, baseline: dict | None, curve=None, decode_ms: float | None = None,
                  stat: str = "mean", surface=None, engine=None) -> "CostModel":
        """stat "mean" (default) reads each phase's mean per cycle: what wall-clock throughput is made of, stalls
        included (on a shared machine they hit the run and its alternated baseline alike). "median" reads the
        per-cycle medians instead, which ignores stalls altogether; the two agree on a quiet machine."""
        if stat not in ("mean", "median"):
            raise SpecscopeError(f"stat must be mean or median, got {stat!r}")
        m, cfg = RunMetrics.of(run), run.get("config") or {}
        rid = run.get("id", "?")
        verify = m.phase_ms("verify", stat)
        draft = m.phase_ms("draft", stat)
        if verify is None or draft is None:
            raise SpecscopeError(f"run {rid} has no per-phase timings (draft, verify); tune needs a profiled "
                                 f"speculative run (e.g. `specscope tune --profile ...`)")
        steps = int(cfg.get("steps") or 1)
        topk = int(cfg.get("topk") or 1)
        step0 = m.phase_ms("draft.step0", stat)
        later = [m.phase_ms(f"draft.step{i}", stat) for i in range(1, steps)]
        later = [x for x in later if x is not None]
        notes = []
        if step0 is None:
            # no sub-phases: split the draft time evenly over the steps
            step0, later = draft / steps, [draft / steps] * (steps - 1)
            notes.append("draft sub-phases missing: draft time split evenly over the steps")
        expand = statistics.mean(later) if later else step0
        select = max(0.0, draft - step0 - sum(later)) / candidates(steps, topk)
        other = sum(v for v in (m.phase_ms(k, stat) for k in ("accept", "commit", "other")) if v is not None)
        if decode_ms is None and baseline is not None:
            base = RunMetrics.of(baseline)
            med = base.phase_ms("decode", stat) if stat == "median" else None
            # the baseline's own loop bookkeeping is part of its per-token cost, as "other" is of a cycle's
            decode_ms = (med + (base.phase_ms("other", stat) or 0.0)) if med else decode_ms_of(base)
        if decode_ms is None:
            raise SpecscopeError(f"no plain-decoding time for run {rid}: pass --baseline-run ID or --decode-ms")
        n0 = m.verify_tokens_mean or (steps + 1 if topk == 1 else cfg.get("draft_tokens") or steps + 1)
        context = m.mean_context or cfg.get("mean_context") or 256
        if cfg.get("draft_budget") == "priced":
            notes.append(f"run {rid} was priced (--draft-budget priced: each cycle verified its own subset of the "
                         f"shape, and the drafter sat some out); these predictions are for fixed shapes "
                         f"(--draft-budget fixed), which priced cycles then choose within")
        if curve is None and not (engine is not None and engine.covers(1)):
            notes.append("no verify curve: verify and draft-step costs taken as flat in the number of tokens")
        if engine is not None:
            notes.extend(engine.notes())
        return cls(decode_ms, step0, expand, select, verify, other, topk, float(n0), float(context), curve, notes,
                   surface, engine, draft)


def candidates(steps: int, topk: int) -> int:
    """Candidate nodes a dynamic-tree drafter scores: topk at level 1, topk² at each further level."""
    return topk + (steps - 1) * topk * topk


# ------------------------------------------------------------------------------------------------ prediction

def _priced(row: dict, tau: float, d: float, v: float, o: float, decode: float, batch: int) -> dict:
    """A prediction's costs at `batch` sequences: v and decode are one forward over all of them, d and o per
    sequence (cost.CycleCost)."""
    c = CycleCost(decode, d, v, o, batch)
    return {**row, "batch": batch, "tau": tau, "draft_ms": d, "verify_ms": v, "other_ms": o, "cycle_ms": c.cycle_ms,
            "tau_needed": c.break_even_tau, "speedup": c.speedup(tau), "decode_ms": decode,
            "plain_ms_per_token": c.plain_ms_per_token, "spec_ms_per_token": c.spec_ms_per_token(tau)}


def predict(acc: AcceptanceModel, cost: CostModel, steps: int, topk: int, draft_tokens: int,
            ngram_tokens: int = 0, hybrid: HybridModel | None = None, batch: int = 1) -> dict:
    if hybrid is not None:
        return predict_hybrid(acc, cost, hybrid, steps, topk, draft_tokens, ngram_tokens, batch)
    if topk == 1:
        draft_tokens = steps + 1
    parents, p = expected_tree(acc.chain_rate if topk == 1 else acc.rate, steps, topk, draft_tokens)
    tau = tree_tau(parents, p)
    if topk > 1:
        tau = 1.0 + acc.tree_scale * (tau - 1.0)
    n = len(parents) + 1
    row = {"steps": steps, "topk": topk, "draft_tokens": draft_tokens, "shape": "chain" if topk == 1 else "tree",
           "verify_tokens": n, "tau_max": steps + 1.0, "extrapolated": steps > acc.depth}
    return _priced(row, tau, cost.draft_at(steps, topk, batch), cost.verify(n, batch), cost.other_at(batch),
                   cost.decode(batch), batch)


def predict_hybrid(acc: AcceptanceModel, cost: CostModel, hyb: HybridModel, steps: int, topk: int,
                   draft_tokens: int, ngram_tokens: int, batch: int = 1) -> dict:
    """A hybrid: tree cycles verify the drafter's tree plus the copy's new nodes (draft cost: the drafter's only),
    copy cycles a chain of the whole budget at no draft cost; τ and time are averaged over the two by their share.
    At batch B > 1 one forward holds tree and copy sequences alike, so it is priced at their mean rows."""
    base = predict(acc, cost, steps, topk, draft_tokens)
    f = hyb.copy_share
    L = ngram_tokens
    tau_tree = base["tau"] + hyb.tree_gain(L)
    n_tree = base["verify_tokens"] + hyb.tree_nodes(L)
    budget = base["draft_tokens"] - 1 + L
    tau_copy, n_copy = hyb.copy_tau(budget), hyb.copy_rows(budget)
    tau = (1 - f) * tau_tree + f * tau_copy
    rows = (1 - f) * n_tree + f * n_copy
    v = (1 - f) * cost.verify(n_tree) + f * cost.verify(n_copy) if batch == 1 else cost.verify(rows, batch)
    row = {**base, "ngram_tokens": L, "verify_tokens": rows, "tau_max": max(steps, budget) + 1.0, "copy_share": f}
    return _priced(row, tau, (1 - f) * cost.draft_at(steps, topk, batch), v, cost.other_at(batch),
                   cost.decode(batch), batch)


DRAFT_TOKEN_GRID = (4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)


def candidate_configs(acc: AcceptanceModel, max_steps: int | None = None, max_topk: int | None = None,
                      max_draft_tokens: int = 64) -> list[tuple[int, int, int]]:
    max_steps = max_steps or acc.depth
    max_topk = min(max_topk or acc.max_topk, acc.max_topk)
    out = [(s, 1, s + 1) for s in range(1, max_steps + 1)]
    for k in range(2, max_topk + 1):
        for s in range(1, max_steps + 1):
            cap = candidates(s, k) + 1
            for n in DRAFT_TOKEN_GRID:
                if n <= min(cap, max_draft_tokens) and n > k:
                    out.append((s, k, n))
    return out


def hybrid_configs(configs, hyb: HybridModel) -> list[tuple[int, int, int, int]]:
    """Each drafter shape with every n-gram budget from 0 to the run's (longer ones are not measured)."""
    return [(*c, L) for c in configs for L in range(hyb.ngram_tokens + 1)]


def rank(acc: AcceptanceModel, cost: CostModel, configs, hybrid: HybridModel | None = None,
         batch: int = 1) -> list[dict]:
    rows = [predict(acc, cost, *c, hybrid=hybrid, batch=batch) for c in configs]
    rows.sort(key=lambda r: -r["speedup"])
    return rows


# ------------------------------------------------------------------------------------------------ concurrency

DEFAULT_CONCURRENCY = DEFAULT_BATCHES


def by_concurrency(acc: AcceptanceModel, cost: CostModel, configs, levels=DEFAULT_CONCURRENCY,
                   hybrid: HybridModel | None = None) -> tuple[list[dict], list[int]]:
    """The best predicted configuration at each concurrency level the cost model can price -> (rows, levels left
    out because the verify surface, or the engine's steps, do not cover them)."""
    rows, skipped = [], []
    for B in levels:
        if not cost.covers(B):
            skipped.append(B)
            continue
        rows.append(rank(acc, cost, configs, hybrid, B)[0])
    return rows, skipped


def crossover(levels, speedups) -> float | None:
    """The concurrency past which plain decoding is faster: where the speedup first falls to 1 or below,
    interpolated in log2(B) between the last level where speculation paid and the first where it did not. None when
    it pays at every level; the first level when it pays at none."""
    pts = sorted(zip(levels, speedups))
    if not pts:
        return None
    if pts[0][1] <= 1.0:
        return float(pts[0][0])
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        if s1 <= 1.0:
            t = (s0 - 1.0) / (s0 - s1)
            return 2 ** (math.log2(b0) + t * (math.log2(b1) - math.log2(b0)))
    return None


def best_by_draft_tokens(rows: list[dict]) -> list[dict]:
    """For the 'τ needed vs draft tokens' plot: per top-k, the best predicted configuration at each verified width
    (chains: one per depth)."""
    best = {}
    for r in rows:
        key = (r["topk"], r["verify_tokens"])
        if key not in best or r["speedup"] > best[key]["speedup"]:
            best[key] = r
    return [{"topk": k, "draft_tokens": n, "steps": r["steps"], "tau_needed": r["tau_needed"],
             "tau_predicted": r["tau"], "tau_max": r["tau_max"], "speedup": r["speedup"]}
            for (k, n), r in sorted(best.items())]


def error_summary(rows: list[dict]) -> dict:
    """rows with predicted and measured speedups -> per-row relative error and the median."""
    errs = [abs(r["predicted"] - r["measured"]) / r["measured"] for r in rows if r["measured"] > 0]
    return {"median_rel_error": statistics.median(errs) if errs else math.nan,
            "max_rel_error": max(errs) if errs else math.nan, "n": len(errs)}
