"""The verify-cost curve: target forward time for n query tokens over a context of L cached tokens.

Speculation assumes verifying n tokens costs about what decoding one does. That holds while the forward is
bandwidth-bound (weights are read once whatever n is) and stops once n makes it compute-bound. We measure
T(n, L) and fit `T = flat` for n <= knee, `flat + slope·(n - knee)` beyond, per context length.

With several sequences decoded together (engine/batch.py) the curve becomes a surface T(B, n): one forward over B
sequences each verifying n tokens. Batching spends the same flat region plain decoding lives on, so the knee in
tokens per sequence moves left as B grows; `measure_surface` and `VerifySurface` give that axis.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from specscope.cpuload import Contention
from specscope.errors import SpecscopeError
from specscope.profile.cycle import quantile

# torch is imported inside the measuring code only: the report and `breakeven` read fits from here without it

DEFAULT_CONTEXTS = (256, 1024)
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_BATCHES = (1, 2, 4, 8, 16)
MAX_BATCH = 1024        # sequences in one measured forward: past any --max-num-seqs this engine is run with


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise SpecscopeError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if not vals:
        raise SpecscopeError(f"{what} is empty")
    bad = [v for v in vals if v < 1]
    if bad:
        raise SpecscopeError(f"{what} must all be >= 1, got {bad[0]}")
    return sorted(set(vals))


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Point:
    """One (context, n) forward, set up once: a cache with `context` committed slots, n query tokens."""

    def __init__(self, model, context: int, n: int, cache=None):
        import torch

        dev = model.device
        self.model, self.dev = model, dev
        # one cache per context serves every n: each forward writes slots context.. and commits nothing
        self.cache = cache if cache is not None else model.new_cache(context + n)
        self.cache.length = context     # cache contents do not change the arithmetic: no prefill needed
        self.ids = torch.randint(0, model.config.vocab_size, (1, n), device=dev)
        self.pos = torch.arange(context, context + n, device=dev)[None]
        # n > 1 uses an explicit mask, as tree verification does
        self.mask = (torch.arange(context + n, device=dev)[None, None, :] <= self.pos[:, :, None]) if n > 1 else None

    def time_ms(self) -> float:
        import torch

        with torch.inference_mode():
            _sync(self.dev)
            t0 = time.perf_counter()
            o = self.model(self.ids, self.pos, self.cache, slots=self.pos, mask=self.mask)
            o.logits.argmax(-1).tolist()  # decoding reads the argmax back, which also syncs
            _sync(self.dev)
            return (time.perf_counter() - t0) * 1e3


def summarize(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"median_ms": statistics.median(s), "p10_ms": quantile(s, 0.1), "p90_ms": quantile(s, 0.9),
            "min_ms": s[0], "max_ms": s[-1]}


@dataclass
class PiecewiseFit:
    """T(n) = flat_ms for n <= knee, flat_ms + slope_ms·(n - knee) beyond."""

    flat_ms: float
    slope_ms: float
    knee: float
    rel_rmse: float

    def __call__(self, n: float) -> float:
        return self.flat_ms + self.slope_ms * max(0.0, n - self.knee)

    def to_dict(self) -> dict:
        return {"flat_ms": self.flat_ms, "slope_ms_per_token": self.slope_ms, "knee_tokens": self.knee,
                "rel_rmse": self.rel_rmse}

    @classmethod
    def from_dict(cls, d: dict) -> "PiecewiseFit":
        return cls(d["flat_ms"], d["slope_ms_per_token"], d["knee_tokens"], d.get("rel_rmse", 0.0))


def fit_piecewise(ns: list[float], ts: list[float]) -> PiecewiseFit:
    """Least squares in relative error (times span orders of magnitude) over a grid of knees; for a fixed knee the
    model is linear in (flat, slope), solved in closed form, with slope >= 0."""
    if len(ns) != len(ts) or not ns:
        raise SpecscopeError("need at least one (tokens, ms) point to fit a verify curve")
    if any(t <= 0 for t in ts):
        raise SpecscopeError("verify times must be positive")
    n_max, n_min = max(ns), min(ns)
    w = [1.0 / t for t in ts]
    knees = sorted(set([n_min + (n_max - n_min) * i / 400 for i in range(401)] + list(ns)))
    best = None
    for k in knees:
        x = [max(0.0, n - k) for n in ns]
        # weighted normal equations for t ≈ a + b·x with weights w² (relative residuals)
        sw = sum(wi * wi for wi in w)
        sx = sum(wi * wi * xi for wi, xi in zip(w, x))
        sxx = sum(wi * wi * xi * xi for wi, xi in zip(w, x))
        st = sum(wi * wi * ti for wi, ti in zip(w, ts))
        sxt = sum(wi * wi * xi * ti for wi, xi, ti in zip(w, x, ts))
        det = sw * sxx - sx * sx
        if det > 1e-12 * max(1.0, sw * sxx):
            b = (sw * sxt - sx * st) / det
            a = (st - b * sx) / sw
        else:
            a, b = st / sw, 0.0
        if b < 0:
            a, b = st / sw, 0.0
        err = sum(((a + b * xi) - ti) ** 2 * wi * wi for xi, ti, wi in zip(x, ts, w))
        if best is None or err < best[0] - 1e-15:
            best = (err, a, b, k)
    err, a, b, k = best
    if b == 0.0:
        k = float(n_max)  # flat over the whole measured range
    return PiecewiseFit(a, b, float(k), math.sqrt(err / len(ns)))


def refuse_loaded(run: dict) -> None:
    """A stored curve measured while other processes took the CPUs prices that load, not the machine: refused."""
    load = Contention.from_dict(((run.get("results") or {}).get("contention")))
    if load is not None and load.loaded:
        raise SpecscopeError(f"verify curve {run.get('id', '?')} was measured while {load.words()}: it prices that "
                             f"load, not this machine; measure it again on a quieter machine (`specscope verify-curve`)")


class VerifyCurve:
    """T_verify(n, L) from a stored verify_curve run. At a measured context, n between measured widths reads the
    measured medians (linear in between: CPU kernels have quirks, e.g. one width slower than its neighbours, that
    the two-piece fit smooths away); outside them the fit. Between contexts, linear in L."""

    def __init__(self, fits: dict[int, PiecewiseFit], run_id: str | None = None,
                 points: dict[int, dict[int, float]] | None = None):
        if not fits:
            raise SpecscopeError("the verify curve has no fitted context lengths")
        self.fits = dict(sorted(fits.items()))
        self.points = {L: dict(sorted(p.items())) for L, p in (points or {}).items() if p}
        self.run_id = run_id

    @classmethod
    def from_run(cls, run: dict, loaded_ok: bool = False) -> "VerifyCurve":
        """The stored curve; refused when it was measured while other processes took the CPUs (`loaded_ok`: a
        caller that just measured it and says so itself)."""
        if run.get("kind") != "verify_curve":
            raise SpecscopeError(f"run {run.get('id', '?')} is a {run.get('kind')!r} run, not a verify curve; "
                                 f"make one with `specscope verify-curve`")
        if not loaded_ok:
            refuse_loaded(run)
        res = run.get("results") or {}
        points: dict[int, dict[int, float]] = {}
        for p in res.get("points") or []:
            points.setdefault(int(p["context"]), {})[int(p["tokens"])] = float(p["median_ms"])
        return cls({int(L): PiecewiseFit.from_dict(f) for L, f in (res.get("fits") or {}).items()}, run.get("id"),
                   points)

    def _at(self, L: int, n: float) -> float:
        pts = self.points.get(L)
        if pts:
            ns = list(pts)
            if ns[0] <= n <= ns[-1]:
                hi = next(x for x in ns if x >= n)
                lo = max(x for x in ns if x <= n)
                if hi == lo:
                    return pts[lo]
                return pts[lo] + (pts[hi] - pts[lo]) * (n - lo) / (hi - lo)
        return self.fits[L](n)

    def __call__(self, n: float, context: float) -> float:
        Ls = list(self.fits)
        if context <= Ls[0]:
            return self._at(Ls[0], n)
        if context >= Ls[-1]:
            if len(Ls) == 1:
                return self._at(Ls[0], n)
            # extrapolate linearly in L: attention cost grows with the context
            L0, L1 = Ls[-2], Ls[-1]
        else:
            L0 = max(L for L in Ls if L <= context)
            L1 = min(L for L in Ls if L > context)
        t0, t1 = self._at(L0, n), self._at(L1, n)
        return max(1e-6, t0 + (t1 - t0) * (context - L0) / (L1 - L0))

    def ratio(self, n: float, n_ref: float, context: float) -> float:
        """T(n)/T(n_ref): scales a time measured in place at n_ref to n."""
        return self(n, context) / self(n_ref, context)


MAX_REPEATS = 10_000    # forwards per point: far past a stable median, short of running until killed


def check_plan(contexts, tokens, warmup: int, repeats: int, limit: int) -> None:
    """A measurement the model can do in a bounded time: `limit` is its context (config.json's
    max_position_embeddings, known before the weights load)."""
    if not 0 <= warmup <= MAX_REPEATS:
        raise SpecscopeError(f"--warmup must be >= 0 and <= {MAX_REPEATS}, got {warmup}")
    if not 1 <= repeats <= MAX_REPEATS:
        raise SpecscopeError(f"--repeats must be >= 1 and <= {MAX_REPEATS}, got {repeats}")
    too_long = [L for L in contexts if L + max(tokens) > limit]
    if too_long:
        raise SpecscopeError(f"context {too_long[0]} + {max(tokens)} tokens exceeds the model's context of {limit}; "
                             f"lower --context or --tokens")


def measure_curve(model, contexts, tokens, warmup: int = 2, repeats: int = 5, progress=None, tick=None) -> dict:
    """Measure every (context, n) point and fit each context. Returns {"points", "fits", "samples"}.
    progress(row): each point once its context is measured; tick(): after every forward, warmup included (the
    points of a context finish together, round-robin, so only forwards can tell the time left)."""
    check_plan(contexts, tokens, warmup, repeats, model.config.max_position_embeddings)
    points, samples, fits = [], {}, {}
    for L in contexts:
        cache = model.new_cache(L + max(tokens))
        pts = {n: _Point(model, L, n, cache) for n in tokens}
        times = {n: [] for n in tokens}
        # round-robin over n: load that drifts during the measurement (shared machines) hits every n alike
        for i in range(warmup + repeats):
            for n in tokens:
                t = pts[n].time_ms()
                if i >= warmup:
                    times[n].append(t)
                if tick:
                    tick()
        meds = []
        for n in tokens:
            row = {"context": L, "tokens": n, **summarize(times[n])}
            points.append(row)
            samples[f"{L}:{n}"] = times[n]
            meds.append(row["median_ms"])
            if progress:
                progress(row)
        del pts, cache
        fits[str(L)] = fit_piecewise(list(tokens), meds).to_dict()
    return {"points": points, "fits": fits, "samples": samples}


NOISY_SPREAD = 0.5      # (p90 - p10) / median above this at a typical point: the shape is not readable


def noise_words(points: list[dict], fit: dict | None = None) -> str | None:
    """Why a curve's fit cannot be trusted (p10–p90 spreads comparable to the medians, or a poor fit), or None."""
    spreads = sorted((p["p90_ms"] - p["p10_ms"]) / p["median_ms"] for p in points
                     if p.get("median_ms") and p.get("p10_ms") is not None and p.get("p90_ms") is not None)
    typical = spreads[len(spreads) // 2] if spreads else 0.0
    rmse = (fit or {}).get("rel_rmse") or 0.0
    if typical <= NOISY_SPREAD and rmse <= 0.25:
        return None
    lo = min(p["p10_ms"] for p in points if p.get("p10_ms") is not None)
    hi = max(p["p90_ms"] for p in points if p.get("p90_ms") is not None)
    return (f"too noisy to fit: p10–p90 bars span {lo:.0f}–{hi:.0f} ms (typical spread {typical * 100:.0f}% of "
            f"the median, fit error {rmse * 100:.0f}%); measure again on a quiet machine or with more --repeats")


def knee_words(fit: dict, max_tokens: int, points: list[dict] | None = None) -> str:
    """Say what the knee means: how many tokens verify for about the price of one — or that the points (this
    context's measurements, when given) are too noisy to say anything."""
    noisy = noise_words(points, fit) if points else None
    if noisy:
        return noisy
    flat, slope, knee = fit["flat_ms"], fit["slope_ms_per_token"], fit["knee_tokens"]
    if slope == 0.0 or slope * (max_tokens - knee) < 0.05 * flat:
        return f"flat at {flat:.2f} ms up to {max_tokens} tokens (no knee in range: still bandwidth-bound)"
    if knee <= 1.0 + 1e-9:
        return (f"no flat region: rises from the first token, +{slope:.3f} ms per extra token "
                f"(compute-bound already at n = 1)")
    return (f"flat at {flat:.2f} ms up to a knee at n ≈ {knee:.1f} tokens, then +{slope:.3f} ms per extra token")


def cheap_words(points: list[dict], fit: dict | None = None, per: str = "", ref: str = "one decode step") -> str | None:
    """How many query tokens verify within 10 % of the narrowest forward (n = 1: one decode step), from one
    context's (or one batch size's) points: the widest n up to which every measured width stays within 10 %. None
    when that cannot be read: one width only, or points too noisy to fit (knee_words says so; a number read off
    noise would contradict it)."""
    pts = sorted(points, key=lambda p: p["tokens"])
    if len(pts) < 2 or noise_words(pts, fit):
        return None
    base = pts[0]
    ref = ref if base["tokens"] == 1 else f"the {base['tokens']}-token forward"
    cheap = base
    for p in pts[1:]:
        if p["median_ms"] > 1.1 * base["median_ms"]:
            break
        cheap = p
    if cheap is base:
        nxt = pts[1]
        return (f"no wider verify stays within 10% of {ref} ({base['median_ms']:.2f} ms): {nxt['tokens']} "
                f"tokens{per} already cost {nxt['median_ms'] / base['median_ms']:.2f}× as much")
    return f"up to {cheap['tokens']} tokens{per} verify within 10% of {ref} ({base['median_ms']:.2f} ms)"


# ------------------------------------------------------------------------------------------------ batch axis

def check_surface_plan(batches, context: int, tokens, limit: int, max_seq_len: int | None = None) -> None:
    """A surface the model can measure: at most MAX_BATCH sequences, each region within the model's context."""
    if max(batches) > MAX_BATCH:
        raise SpecscopeError(f"--batch values must be <= {MAX_BATCH}, got {max(batches)}")
    if context + max(tokens) > limit:
        raise SpecscopeError(f"batch context {context} + {max(tokens)} tokens exceeds the model's context of "
                             f"{limit}; lower --batch-context or --tokens")
    if max_seq_len is not None and max_seq_len < context:
        raise SpecscopeError(f"--max-seq-len {max_seq_len} is shorter than the batch context {context}; a "
                             f"sequence's region must hold its context")


def region_size(context: int, tokens, max_seq_len: int | None = None, limit: int | None = None) -> int:
    """KV slots per sequence, as BatchEngine sizes them: its committed tokens (--max-seq-len, capped at the
    model's context; default just the context) plus the widest verify + 1. The region's size, not its fill,
    sets how wide each row's mask is, so a surface for an engine with a large --max-seq-len should say so."""
    seq = max_seq_len if max_seq_len is not None else context
    if limit is not None:
        seq = min(seq, limit)
    return max(seq, context) + max(tokens) + 1


class _BatchPoint:
    """One forward over `batch` sequences, each verifying n tokens after `context` cached ones, built as the
    batched engine builds a step (engine.batch.batch_inputs): every sequence's rows masked to its own region."""

    def __init__(self, model, batch: int, context: int, n: int, cache, region: int):
        import torch

        from specscope.engine.batch import Rows, batch_inputs

        dev = model.device
        self.model, self.dev, self.cache = model, dev, cache
        pos = torch.arange(context, context + n, device=dev)
        # a chain's rows: each sees the region's committed slots and the drafts up to itself
        mask = torch.arange(context + n, device=dev)[None, :] <= pos[:, None]
        parts = [Rows(torch.randint(0, model.config.vocab_size, (n,), device=dev), pos, pos, mask, b * region)
                 for b in range(batch)]
        self.ids, self.pos, self.slots, self.mask = batch_inputs(parts, dev)

    def time_ms(self) -> float:
        import torch

        with torch.inference_mode():
            _sync(self.dev)
            t0 = time.perf_counter()
            o = self.model(self.ids, self.pos, self.cache, self.slots, self.mask)
            o.logits.argmax(-1).tolist()  # every verified row's token is read back, which also syncs
            _sync(self.dev)
            return (time.perf_counter() - t0) * 1e3


def measure_surface(model, batches, context: int, tokens, warmup: int = 2, repeats: int = 5,
                    max_seq_len: int | None = None, progress=None, tick=None) -> dict:
    """T(B, n) at one per-sequence context: for each batch size B one cache of B regions (target.new_cache(region
    * B)), every (B, n) timed once a round, round-robin (a batch-1 row timed apart from the others once came out
    1.5x slow: its T(1, 1) above T(2, 1)). Returns {"context", "region", "batches", "tokens", "points", "fits",
    "samples"}; fits are {B: {context: fit over n}}, so each batch size reads like a batch-1 curve."""
    limit = model.config.max_position_embeddings
    check_plan([context], tokens, warmup, repeats, limit)
    check_surface_plan(batches, context, tokens, limit, max_seq_len)
    region = region_size(context, tokens, max_seq_len, limit)
    points, samples, fits = [], {}, {}
    caches = {B: model.new_cache(region * B) for B in batches}
    pts = {(B, n): _BatchPoint(model, B, context, n, caches[B], region) for B in batches for n in tokens}
    times = {k: [] for k in pts}
    for i in range(warmup + repeats):
        for k, p in pts.items():   # every point once a round: drift on a shared machine hits all of them alike
            t = p.time_ms()
            if i >= warmup:
                times[k].append(t)
            if tick:
                tick()
    for B in batches:
        meds = []
        for n in tokens:
            row = {"batch": B, "context": context, "tokens": n, **summarize(times[(B, n)])}
            points.append(row)
            samples[f"{B}:{context}:{n}"] = times[(B, n)]
            meds.append(row["median_ms"])
            if progress:
                progress(row)
        fits[str(B)] = {str(context): fit_piecewise(list(tokens), meds).to_dict()}
    del pts, caches
    return {"context": context, "region": region, "batches": list(batches), "tokens": list(tokens),
            "points": points, "fits": fits, "samples": samples}


def surface_results(surface: dict) -> dict:
    """What a verify_curve run stores of a measured surface (results["surface"]): all but the raw samples."""
    return {k: v for k, v in surface.items() if k != "samples"}


class VerifySurface:
    """T(B, n, L): one target forward over B sequences each verifying n tokens at context L, in ms.

    Each measured batch size is a VerifyCurve; between two of them T is linear in B (total rows decide the work
    once compute-bound, and it is flat in B while bandwidth-bound). Batch sizes outside the measured ones are
    refused, not extrapolated. A verify_curve run without a batch axis (made before `--batch`, or without it) is
    a surface of batch 1 alone; when a run has both, the surface's own batch-1 row wins, so that every batch size
    comes from the same batched forward."""

    def __init__(self, curves: dict, run_id: str | None = None, context: float | None = None,
                 region: int | None = None):
        if not curves:
            raise SpecscopeError("the verify surface has no batch sizes")
        self.curves = dict(sorted((int(b), c) for b, c in curves.items()))
        self.run_id, self.context, self.region = run_id, context, region

    @classmethod
    def from_results(cls, surface: dict, run_id: str | None = None, batch1: VerifyCurve | None = None):
        """From measure_surface's output (or a run's results["surface"]), with `batch1` for batch 1 when the
        surface lacks it."""
        points: dict[int, dict[int, dict[int, float]]] = {}
        for p in surface.get("points") or []:
            points.setdefault(int(p["batch"]), {}).setdefault(int(p["context"]), {})[int(p["tokens"])] = \
                float(p["median_ms"])
        curves = {int(B): VerifyCurve({int(L): PiecewiseFit.from_dict(f) for L, f in fits.items()}, run_id,
                                      points.get(int(B)))
                  for B, fits in (surface.get("fits") or {}).items()}
        if 1 not in curves and batch1 is not None:
            curves[1] = batch1
        return cls(curves, run_id, surface.get("context"), surface.get("region"))

    @classmethod
    def from_run(cls, run: dict, loaded_ok: bool = False) -> "VerifySurface":
        """The stored surface (refused, as VerifyCurve.from_run, when measured under load unless `loaded_ok`)."""
        res = run.get("results") or {}
        surface = res.get("surface")
        if surface and run.get("kind") in ("ingest", "engine_surface"):
            return cls.from_results(surface, run.get("id"))     # an engine's own steps (economics/engine_steps.py)
        if not surface or run.get("kind") != "verify_curve":
            return cls({1: VerifyCurve.from_run(run, loaded_ok)}, run.get("id"))    # the old format: batch 1 alone
        if not loaded_ok:
            refuse_loaded(run)
        batch1 = VerifyCurve.from_run(run, loaded_ok=True) if res.get("fits") else None
        return cls.from_results(surface, run.get("id"), batch1)

    @property
    def batches(self) -> list[int]:
        return list(self.curves)

    @classmethod
    def curve_and_surface(cls, run: dict) -> tuple[VerifyCurve | None, "VerifySurface"]:
        """A stored run's batch-1 curve (None when it has none: an engine surface without batch-1 steps) and its
        surface."""
        surface = cls.from_run(run)
        if run.get("kind") == "verify_curve":
            return VerifyCurve.from_run(run), surface
        return surface.curves.get(1), surface

    def covers(self, batch: int) -> bool:
        return self.batches[0] <= batch <= self.batches[-1]

    def __call__(self, batch: float, n: float, context: float) -> float:
        bs = self.batches
        if batch in self.curves:
            return self.curves[batch](n, context)
        if not self.covers(batch):
            of = f" (run {self.run_id})" if self.run_id else ""
            hint = ("measure one with `specscope verify-curve --batch 1,2,4,8,16`" if bs == [1]
                    else "measure it with `specscope verify-curve --batch ...` including that size")
            raise SpecscopeError(f"the verify curve{of} covers batch sizes {', '.join(map(str, bs))}; batch "
                                 f"{batch:g} is outside it: {hint}")
        lo = max(b for b in bs if b <= batch)
        hi = min(b for b in bs if b >= batch)
        t0, t1 = self.curves[lo](n, context), self.curves[hi](n, context)
        return t0 + (t1 - t0) * (batch - lo) / (hi - lo)
