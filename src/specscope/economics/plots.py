"""PNG plots of the economics (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path

from specscope.economics.verify_curve import PiecewiseFit
from specscope.errors import SpecscopeError
from specscope.fileio import atomic_output


def _plt():
    import matplotlib      # slow to import: only once a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


FORMATS = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def plot_format(path, flag: str = "--output") -> str:
    """The image format a plot path asks for by its suffix (PNG without one); checked before any work."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    if fmt not in FORMATS:
        raise SpecscopeError(f"{flag} {str(path)!r}: cannot write a .{fmt} image; end it in one of "
                             f"{', '.join('.' + f for f in FORMATS)}")
    return fmt


def _save(fig, path) -> str:
    """The figure to the regular file `path`, atomically; the format follows its suffix (PNG without one)."""
    path = Path(path)
    try:
        fig.tight_layout()
        with atomic_output(path, "plot", make_parents=True) as tmp:
            fig.savefig(tmp, dpi=110, format=plot_format(path))
    finally:
        _plt().close(fig)
    return str(path)


def plot_verify_curve(result: dict, path, title: str = "") -> str:
    """Median forward time (p10–p90 bars) vs query tokens, one line per context, with the piecewise fit."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    contexts = sorted({p["context"] for p in result["points"]})
    for i, L in enumerate(contexts):
        pts = [p for p in result["points"] if p["context"] == L]
        ns = [p["tokens"] for p in pts]
        med = [p["median_ms"] for p in pts]
        err = [[m - p["p10_ms"] for m, p in zip(med, pts)], [p["p90_ms"] - m for m, p in zip(med, pts)]]
        color = f"C{i}"
        ax.errorbar(ns, med, yerr=err, fmt="o", color=color, capsize=3, label=f"context {L}")
        fit = PiecewiseFit.from_dict(result["fits"][str(L)])
        lo, hi = min(ns), max(ns)
        xs = [lo + (hi - lo) * j / 200 for j in range(201)]
        ax.plot(xs, [fit(x) for x in xs], "-", color=color, alpha=0.7)
        if fit.slope_ms > 0 and lo < fit.knee < hi:
            ax.axvline(fit.knee, color=color, ls=":", alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("query tokens n (verified per forward)")
    ax.set_ylabel("target forward, ms (median, p10–p90)")
    ax.set_title(title or "verify cost: flat while bandwidth-bound, then rising (dotted: knee)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_tau_needed(rows: list[dict], path, title: str = "") -> str:
    """rows: {topk, draft_tokens, tau_needed, tau_predicted} — per top-k series, the break-even τ (dashed) beside
    the τ the drafter is predicted to achieve (solid); speculation pays where solid is above dashed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, k in enumerate(sorted({r.get("topk", 1) for r in rows})):
        rs = sorted((r for r in rows if r.get("topk", 1) == k), key=lambda r: r["draft_tokens"])
        xs = [r["draft_tokens"] for r in rs]
        name = "chain" if k == 1 else f"tree top-k {k}"
        ax.plot(xs, [r["tau_predicted"] for r in rs], "o-", color=f"C{i}", label=f"{name}: τ achievable")
        ax.plot(xs, [r["tau_needed"] for r in rs], "x--", color=f"C{i}", alpha=0.8, label=f"{name}: τ needed")
    ax.set_xlabel("draft tokens verified per cycle (incl. root)")
    ax.set_ylabel("tokens per cycle τ")
    ax.set_title(title or "speculation pays where achievable τ (solid) is above needed τ (dashed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return _save(fig, path)


def plot_pred_vs_measured(rows: list[dict], path, title: str = "") -> str:
    """rows: {label, predicted, measured} speedups."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    pred = [r["predicted"] for r in rows]
    meas = [r["measured"] for r in rows]
    lo = min(pred + meas + [1.0]) * 0.9
    hi = max(pred + meas + [1.0]) * 1.1
    ax.plot([lo, hi], [lo, hi], "-", color="gray", alpha=0.6, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="gray", alpha=0.12, label="±10%")
    ax.scatter(pred, meas, color="C0", zorder=3)
    for r in rows:
        ax.annotate(r["label"], (r["predicted"], r["measured"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted speedup")
    ax.set_ylabel("measured speedup")
    ax.set_title(title or "tuner: predicted vs measured speedup")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    return _save(fig, path)


def plot_verify_surface(surface: dict, path, title: str = "") -> str:
    """measure_surface's points: median forward time (p10–p90 bars) vs tokens per sequence, one line per batch
    size, with each batch's piecewise fit."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    L = str(surface["context"])
    for i, B in enumerate(sorted({p["batch"] for p in surface["points"]})):
        pts = sorted((p for p in surface["points"] if p["batch"] == B), key=lambda p: p["tokens"])
        ns = [p["tokens"] for p in pts]
        med = [p["median_ms"] for p in pts]
        err = [[m - p["p10_ms"] for m, p in zip(med, pts)], [p["p90_ms"] - m for m, p in zip(med, pts)]]
        color = f"C{i % 10}"
        ax.errorbar(ns, med, yerr=err, fmt="o", color=color, capsize=3, label=f"batch {B}")
        fit = PiecewiseFit.from_dict(surface["fits"][str(B)][L])
        lo, hi = min(ns), max(ns)
        xs = [lo + (hi - lo) * j / 200 for j in range(201)]
        ax.plot(xs, [fit(x) for x in xs], "-", color=color, alpha=0.7)
    ax.set_xscale("log", base=2)
    ns = sorted({p["tokens"] for p in surface["points"]})
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_yscale("log")
    ax.set_xlabel("tokens verified per sequence n")
    ax.set_ylabel("target forward over the batch, ms (median, p10–p90)")
    ax.set_title(title or f"verify cost by batch size at context {L}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_speedup_by_concurrency(series: list[dict], path, title: str = "") -> str:
    """series: {label, levels, speedups, style ("measured" solid, "predicted" dashed, "policy" dash-dotted),
    group (one color per group), crossover}: speedup over plain decoding vs concurrent sequences; a dotted line
    where each series' crossover lies."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = {}
    fmt = {"measured": "o-", "predicted": "x--", "policy": "s-."}
    for s in series:
        base = s.get("group", s["label"])
        color = colors.setdefault(base, f"C{len(colors) % 10}")
        style = s.get("style", "measured")
        ax.plot(s["levels"], s["speedups"], fmt.get(style, "o-"), color=color,
                alpha=0.8 if style == "predicted" else 1.0, label=s["label"])
        if s.get("crossover") is not None:
            ax.axvline(s["crossover"], color=color, ls=":", alpha=0.6)
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xscale("log", base=2)
    levels = sorted({b for s in series for b in s["levels"]})
    ax.set_xticks(levels, [str(b) for b in levels])     # 1, 2, 4 ... rather than 2^0, 2^1, 2^2
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("speedup over plain decoding (same batch size)")
    ax.set_title(title or "speculation by concurrency (dotted: crossover, past which plain decoding is faster)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
