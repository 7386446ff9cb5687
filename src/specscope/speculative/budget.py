"""Cost-aware draft budgets: how many copied tokens a cycle verifies, and whether the model drafter runs at all,
chosen each cycle from this host's measured prices and the acceptance seen so far.

A cycle is worth (tokens it yields) / (what it costs), both in plain decode steps: a verify over n rows costs
T(n)/T(1) of a decode step (flat on a GPU until the knee, steep on a 2-core CPU where 12 rows of FMAs take as long
as streaming the weights), drafting costs its measured time. A copy of L tokens yields 1 + sum over d <= L of
P(the first d copied tokens are all accepted); those probabilities are counted per depth, per match-length class,
as cycles go (`CopyStats`). The choice changes only which tokens are verified, never which are accepted, so it is
lossless whatever the estimates are; a bad estimate costs speed only. The prices are measured by
economics/prices.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specscope.speculative.tree import COPIED, DRAFTED

MATCH_CLASSES = 4      # a copy's class: min(matched suffix length, 4); 0 = no copy
MAX_DEPTH = 32


@dataclass
class Prices:
    """This host's verify cost by rows, in plain decode steps (rows -> T(rows)/T(1)), and the decode step in ms
    (to price a drafting pass timed in ms)."""

    verify_ratio: dict[int, float]
    decode_ms: float
    # why these prices are this run's only (measured while other processes took the CPUs): never cached, and a
    # live policy learns from its own steps instead of starting from them
    loaded: str | None = None

    def verify(self, rows: float) -> float:
        """T(rows)/T(1): linear between measured row counts, the last segment's slope past them (one measured
        count, on a model whose context holds no more: each further row priced as a whole step)."""
        pts = sorted(self.verify_ratio.items())
        if rows <= pts[0][0]:
            return pts[0][1]
        if len(pts) == 1:
            return pts[0][1] * rows / pts[0][0]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if rows <= n1:
                return t0 + (t1 - t0) * (rows - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (rows - n1) / (n1 - n0)

    def to_dict(self) -> dict:
        return {"verify_ratio": {str(k): v for k, v in self.verify_ratio.items()}, "decode_ms": self.decode_ms}

    @classmethod
    def from_dict(cls, d) -> "Prices":
        """Raises ValueError, naming what is wrong, for anything but a curve from 1 row with positive costs."""
        if not isinstance(d, dict) or not isinstance(d.get("verify_ratio"), dict):
            raise ValueError("not a price curve: verify_ratio must be an object of rows -> cost")
        try:
            ratio = {int(k): float(v) for k, v in d["verify_ratio"].items()}
            decode_ms = float(d["decode_ms"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a price curve: {e}") from None
        if 1 not in ratio or min(ratio) < 1:
            raise ValueError("not a price curve: it must start at 1 row")
        if not all(v > 0 and math.isfinite(v) for v in [*ratio.values(), decode_ms]):
            raise ValueError("not a price curve: costs must be positive and finite")
        return cls(ratio, decode_ms)


class LivePrices:
    """Prices kept current by the run's own cycles. On a shared machine the curve moves within seconds (here
    T(16)/T(1) read 2.7 and 1.8 in two measurements a second apart, decode 14 and 21 ms: when memory is slow, the extra rows'
    FMAs hide under it), so a curve measured once prices some runs wrongly. Each cycle's verify (plus its
    bookkeeping) is a sample of T(rows); T(n) ~ a + b n is fitted by least squares over recent samples (each weight
    decays by `decay` a cycle), with the measured curve as a few prior samples so that it rules until the run has
    its own. Same interface as Prices."""

    def __init__(self, base: Prices, decay: float = 0.98, prior_weight: float = 0.5):
        self.base, self.decay = base, decay
        self.prior = sorted(base.verify_ratio.items())
        self.prior_weight = prior_weight / len(self.prior)
        # decayed sums over the run's samples: w, w n, w n^2, w y, w n y, and w T_measured(n)/T_measured(1)
        self.s = [0.0] * 6
        self._fit = self._solve()

    def observe(self, rows: int, ms: float):
        d = self.decay
        self.s = [d * x for x in self.s]
        for i, v in enumerate((1.0, rows, rows * rows, ms, rows * ms, self.base.verify(rows))):
            self.s[i] += v
        self._fit = self._solve()

    def _solve(self) -> tuple[float, float]:
        w0 = self.prior_weight
        s0, s1, s2, sy, sny, sr = self.s
        # the measured curve's shape at the run's own scale (a machine 50x faster than the one measured keeps the
        # shape until its samples say otherwise)
        scale = sy / sr if sr > 0 and sy > 0 else self.base.decode_ms
        for n, r in self.prior:
            y = r * scale
            s0, s1, s2, sy, sny = s0 + w0, s1 + w0 * n, s2 + w0 * n * n, sy + w0 * y, sny + w0 * n * y
        det = s0 * s2 - s1 * s1
        b = max(0.0, (s0 * sny - s1 * sy) / det) if det > 1e-12 else 0.0
        a = (sy - b * s1) / s0
        if a + b <= 0:           # nonsense samples: the measured curve
            return self.base.decode_ms, 0.0
        return a, b

    @property
    def decode_ms(self) -> float:
        a, b = self._fit
        return a + b

    def verify(self, rows: float) -> float:
        a, b = self._fit
        return max(1.0, (a + b * rows) / (a + b))


class FixedPrices(Prices):
    """The given prices as they are, whatever the run's cycles take (observe() ignores them): for tests and for
    comparing a fixed curve with live ones."""

    def __init__(self, base: Prices):
        super().__init__(dict(base.verify_ratio), base.decode_ms)

    def observe(self, rows: int, ms: float):
        pass


class CopyStats:
    """P(copied token d is accepted | tokens 1..d-1 were), per match class, counted over cycles. Each depth's
    estimate is shrunk towards the one above it (a depth seldom reached borrows its parent's rate)."""

    def __init__(self, prior: float = 0.5, strength: float = 2.0):
        self.prior, self.strength = prior, strength
        self.hits = [[0] * MAX_DEPTH for _ in range(MATCH_CLASSES + 1)]
        self.trials = [[0] * MAX_DEPTH for _ in range(MATCH_CLASSES + 1)]

    @staticmethod
    def match_class(match: int, length: int) -> int:
        return 0 if length == 0 else max(1, min(match, MATCH_CLASSES))

    def rates(self, cls: int, n: int) -> list[float]:
        out, above = [], self.prior
        h, t = self.hits[cls], self.trials[cls]
        for d in range(min(n, MAX_DEPTH)):
            above = (h[d] + self.strength * above) / (t[d] + self.strength)
            out.append(above)
        return out + [out[-1]] * (n - len(out)) if out else []

    def update(self, cls: int, offered: int, accepted: int):
        """`offered` copied tokens were verified in a chain from the root, the first `accepted` of them taken."""
        for d in range(min(offered, accepted + 1, MAX_DEPTH)):
            self.trials[cls][d] += 1
            self.hits[cls][d] += d < accepted


def copy_value(rates: list[float], prices: Prices, L: int) -> float:
    """Expected tokens per decode step of a cycle verifying the first L copied tokens."""
    e, p = 0.0, 1.0
    for a in rates[:L]:
        p *= a
        e += p
    return (1.0 + e) / prices.verify(1 + L)


def best_copy(rates: list[float], prices: Prices, max_len: int) -> tuple[int, float]:
    """The copy length (0 = a plain step) with the most expected tokens per decode step, and that value."""
    best = (0, copy_value(rates, prices, 0))
    for L in range(1, max_len + 1):
        v = copy_value(rates, prices, L)
        if v > best[1]:
            best = (L, v)
    return best


class TreeStats:
    """Whether the model drafter drafts, per match class: the realized rates (tokens per ms, drafting + verify +
    acceptance, wall clock) of the cycles it drafted and of those it sat out (the copy's cost-optimal prefix, or a
    plain step), compared as measured in this run -- a price curve measured once drifts with the machine, the rates
    do not. Until both are known the drafter drafts where it has not yet, and sits out where the copy has not been
    tried; then the faster one runs and the other is tried again after `probe` cycles (more as the gap widens)."""

    def __init__(self, ema: float = 0.05, probe: int = 8):
        self.ema, self.probe = ema, probe
        k = MATCH_CLASSES + 1
        self.rate = {True: [None] * k, False: [None] * k}    # drafted / sat out: [tokens, ms] running means
        self.count = {True: [0] * k, False: [0] * k}         # cycles of each choice, all told
        self.window = {True: [0] * k, False: [0] * k}        # the running mean's samples (1/window weighs the next)
        self.idle = [0] * k                                   # cycles since the other choice was last tried
        self.draft_steps: float | None = None     # drafting a tree, in decode steps (running mean)
        self.drafts = 0

    def value(self, cls: int, drafted: bool = True) -> float | None:
        """Tokens per ms of the cycles that drafted (or sat out) in this class, or None before the first."""
        r = self.rate[drafted][cls]
        return None if r is None else r[0] / r[1]

    def wants(self, cls: int) -> bool:
        """Whether the drafter drafts this cycle."""
        t, c = self.value(cls, True), self.value(cls, False)
        if t is None or c is None:
            return t is None         # what has not been tried yet: drafting first, then sitting out
        # the slower choice, once, so that its rate stays current: every `probe` cycles while the two are close
        # (a probe then costs little, and the order may flip), up to 9x as seldom as the gap widens
        gap = 1.0 - min(t, c) / max(t, c)
        self.idle[cls] += 1
        if self.idle[cls] > self.probe * (1.0 + 8.0 * gap):
            self.idle[cls] = 0
            return not t > c
        return t > c

    def new_request(self, window: int = 4):
        """A request may be another task (a summary after a math problem), where the slower choice may now be the
        faster: each class tries it again on its first cycle, and the running means restart from a short window
        (the next cycles weigh 1/(window+1), 1/(window+2), ...) instead of taking ~1/ema cycles to follow. Measured:
        EAGLE-3 alone, priced, kept sitting out through a bench's QA prompts after its summaries (1.05x, τ 1.02,
        where verifying its fixed 3x2x6 tree every cycle made 1.20x)."""
        k = len(self.idle)
        self.idle = [10 ** 9] * k
        for drafted in (True, False):
            self.window[drafted] = [min(c, window) for c in self.window[drafted]]

    def add(self, cls: int, drafted: bool, tokens: int, ms: float):
        # the plain mean of the first 1/ema cycles, then a running mean over about as many: a cycle's tokens vary
        # from 1 to the tree's depth, and a short window reads noise as a change
        self.count[drafted][cls] += 1
        self.window[drafted][cls] += 1
        a = max(self.ema, 1.0 / self.window[drafted][cls])
        r = self.rate[drafted][cls]
        self.rate[drafted][cls] = [tokens, ms] if r is None else [(1 - a) * r[0] + a * tokens, (1 - a) * r[1] + a * ms]

    def drafted(self, seconds: float, prices: Prices) -> float:
        steps = seconds * 1e3 / prices.decode_ms
        self.drafts += 1
        a = max(self.ema, 1.0 / self.drafts)
        self.draft_steps = steps if self.draft_steps is None else (1 - a) * self.draft_steps + a * steps
        return self.draft_steps


class Calibration:
    """How the drafter's probabilities translate into acceptance, per depth: P(node accepted) ~ c_d * exp(its
    cumulative log-prob), c_d = accepted / claimed over the nodes verified so far (shrunk towards c_(d-1))."""

    def __init__(self, strength: float = 2.0):
        self.strength = strength
        self.claimed = [0.0] * MAX_DEPTH
        self.accepted = [0.0] * MAX_DEPTH

    def factors(self, depth: int) -> list[float]:
        out, above = [], 1.0
        for d in range(min(depth, MAX_DEPTH)):
            above = (self.accepted[d] + self.strength * above) / (self.claimed[d] + self.strength)
            out.append(above)
        return out

    def update(self, depth: int, claimed: float, accepted: bool):
        d = min(depth, MAX_DEPTH) - 1
        self.claimed[d] += claimed
        self.accepted[d] += accepted


class BudgetRule:
    """The priced rule in one place: its learned counts and its three choices (the copy's length, whether the model
    drafter drafts, which drafted and copied nodes are verified). HybridDrafter applies it to live cycles;
    bench/hybrid_ceiling.py replays it on recorded ones."""

    def __init__(self):
        self.copy_stats, self.tree_stats, self.calib = CopyStats(), TreeStats(), Calibration()

    def plan(self, match: int, copy_len: int, prices: Prices) -> tuple[int, list[float], int, bool]:
        """(the copy's match class, its per-depth acceptance, the length worth verifying alone, whether to draft)."""
        cls = CopyStats.match_class(match, copy_len)
        rates = self.copy_stats.rates(cls, copy_len)
        L, _ = best_copy(rates, prices, copy_len)
        return cls, rates, L, self.tree_stats.wants(cls)

    def keep(self, tree, rates: list[float], prices: Prices, cost: float, limit: int) -> list[int]:
        """The nodes of a drafted tree (with the copy grafted on) worth their rows, at most `limit`."""
        probs = node_probs(tree, rates, self.calib)
        return best_nodes(probs, tree.parents.tolist(), tree.depth.tolist(), prices, cost, limit)[0]

    def learn(self, cls: int, drafted: bool, offered: int, copied_taken: int, tokens: int, ms: float,
              nodes=()) -> None:
        """After a verify: `offered` copied tokens were verified and `copied_taken` accepted, the cycle yielded
        `tokens` in `ms`; `nodes`: (depth, cumulative log-prob, accepted) of each verified drafted node."""
        self.copy_stats.update(cls, offered, copied_taken)
        self.tree_stats.add(cls, drafted, tokens, ms)
        for d, score, hit in nodes:
            self.calib.update(d, math.exp(score), hit)


def node_probs(tree, copy_rates: list[float], calib: Calibration) -> list[float]:
    """P(node accepted) for every node of a hybrid tree: the drafter's calibrated probability, the copy's
    depth-wise acceptance, the larger where both proposed it; never above the parent's."""
    depth, parents, src = tree.depth.tolist(), tree.parents.tolist(), tree.node_sources()
    scores = tree.scores
    c = calib.factors(max(depth, default=0))
    copy_p = [1.0]
    for a in copy_rates:
        copy_p.append(copy_p[-1] * a)
    out = []
    for i, (d, par, s) in enumerate(zip(depth, parents, src)):
        x = 0.0
        if s & DRAFTED:
            x = 1.0 if scores is None else min(1.0, c[d - 1] * math.exp(scores[i]))
        if s & COPIED and d < len(copy_p):
            x = max(x, copy_p[d])
        out.append(min(x, out[par]) if par >= 0 else x)
    return out


def best_nodes(probs: list[float], parents: list[int], depth: list[int], prices: Prices,
               fixed_cost: float, limit: int | None = None) -> tuple[list[int], float]:
    """At most `limit` nodes (closed under parents) with the most expected tokens per decode step, (1 + sum of
    their P) / (fixed_cost + T(1 + count)/T(1)), and that value. Expected accepted tokens of a tree = the sum over
    its nodes of P(node accepted); taking nodes by falling P keeps every prefix a tree."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], depth[i], i))
    kept, kset, e = [], set(), 0.0
    best = ([], 1.0 / (fixed_cost + prices.verify(1)))
    for i in order:
        if limit is not None and len(kept) >= limit:
            break
        if parents[i] != -1 and parents[i] not in kset:
            continue
        kept.append(i)
        kset.add(i)
        e += probs[i]
        v = (1.0 + e) / (fixed_cost + prices.verify(1 + len(kept)))
        if v > best[1]:
            best = (list(kept), v)
    return best

