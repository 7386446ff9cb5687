"""The report's charts: matplotlib (headless Agg) figures encoded as inline PNG data.

Each function takes run records (registry dicts) and returns PNG bytes, or None when no run has what the chart
needs. Widths are fixed in pixels (figsize × DPI) so that the page never scrolls sideways.
"""

from __future__ import annotations

import functools
import io
import math

from specscope.economics.verify_curve import PiecewiseFit, noise_words
from specscope.profile.cycle import PHASE_LABELS, TOP_PHASES
from specscope.registry.labels import drafted, drafter_name
from specscope.registry.metrics import RunMetrics
from specscope.registry.metrics import number as _num
from specscope.registry.rows import decode_ms_per_token, tokens_per_cycle

DPI = 100
WIDTH_IN = 9.6                      # 960 px: the page's content width
PHASE_COLORS = {"draft": "#4c78a8", "verify": "#e45756", "accept": "#72b7b2", "commit": "#54a24b",
                "decode": "#f58518", "other": "#b8b8b8"}


def _plt():
    import matplotlib      # slow to import: only once a chart is drawn (the report imports this module)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _chart(fn):
    """fn draws a figure (or returns None when no run has what it needs); the chart function returns the PNG.
    Run labels are user text (names, paths): a '$' in one must not switch matplotlib into mathtext, so drawing and
    saving happen with math parsing off. `.layout_problems(...)` draws the same figure and returns what
    `layout_problems` finds (tests hold every chart to it); `.figure(...)` returns it drawn."""
    import matplotlib

    def draw(*a, **kw):
        with matplotlib.rc_context({"text.parse_math": False}):
            fig = fn(*a, **kw)
            return None if fig is None else png(fig)

    def problems(*a, **kw):
        with matplotlib.rc_context({"text.parse_math": False}):
            fig = fn(*a, **kw)
            if fig is None:
                return None
            try:
                return layout_problems(fig)
            finally:
                _plt().close(fig)

    def figure(*a, **kw):       # the figure itself, laid out as the PNG is, for tests; the caller closes it
        with matplotlib.rc_context({"text.parse_math": False}):
            fig = fn(*a, **kw)
            if fig is not None:
                _finish(fig)
                fig.canvas.draw()
            return fig

    functools.update_wrapper(draw, fn)
    draw.layout_problems, draw.figure = problems, figure
    return draw


def _finish(fig) -> None:
    if fig.get_layout_engine() is None:       # figures laid out by "constrained" place themselves
        fig.tight_layout()


def png(fig) -> bytes:
    buf = io.BytesIO()
    _finish(fig)
    fig.savefig(buf, format="png", dpi=DPI)
    _plt().close(fig)
    return buf.getvalue()


def layout_problems(fig) -> list[str]:
    """What a reader would see as broken: drawn content (a label, a legend, tick labels) running past the canvas
    (cut off in the PNG), or an axis label or title under a legend."""
    _finish(fig)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    out = []
    tb, w, h = fig.get_tightbbox(r), fig.get_figwidth(), fig.get_figheight()     # inches
    tol = 1.5 / DPI
    if tb.x0 < -tol or tb.y0 < -tol or tb.x1 > w + tol or tb.y1 > h + tol:
        out.append(f"content runs past the canvas: it spans ({tb.x0:.2f}, {tb.y0:.2f})–({tb.x1:.2f}, {tb.y1:.2f}) "
                   f"in, the canvas is {w:.2f} × {h:.2f} in")
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    boxes = [lg.get_window_extent(r) for lg in legends]
    for ax in fig.axes:
        for t in (ax.xaxis.label, ax.yaxis.label, ax.title):
            if t.get_text() and t.get_visible() and any(t.get_window_extent(r).overlaps(b) for b in boxes):
                out.append(f"{t.get_text()!r} lies under a legend")
    return out


def label(rec: dict) -> str:
    """Short run label for legends and axes: kind, drafter and id prefix."""
    cfg = rec.get("config") or {}
    kind = rec.get("kind") or "run"
    draft = drafter_name(rec)
    if not draft and drafted(rec):       # τ is shown beside this label: never a drafting run without its drafter
        kind = f"{kind}, drafter not named"
    if draft:
        draft = str(draft).rstrip("/").split("/")[-1]
        shape = f" s{cfg['steps']}k{cfg['topk']}n{cfg['draft_tokens']}" if cfg.get("steps") and cfg.get("topk") \
            and cfg.get("draft_tokens") else ""
        kind = f"{draft}{shape}"
    rid = (rec.get("id") or "")[:8]
    return f"{kind} · {rid}" if rid else kind


def top_phases(rec: dict) -> dict[str, float]:
    """{phase: mean ms per cycle} of a run's top-level phases, in display order."""
    ph = RunMetrics.of(rec).phases or {}
    out = {}
    for name in list(TOP_PHASES) + sorted(ph):
        v = ph.get(name)
        if "." in name or name in out or not isinstance(v, dict) or _num(v.get("mean_ms")) is None:
            continue
        out[name] = float(v["mean_ms"])
    return out


def _legend_below(ax, ncol: int = 1):
    """Legends go under the axes: inside they hide the data as soon as there are a few runs."""
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol, frameon=False)


@_chart
def cycle_breakdown(runs: list[dict]) -> bytes | None:
    """Stacked bars per run: ms per cycle by phase (left) and ms per generated token = cycle ÷ τ (right)."""
    rows = [(r, top_phases(r)) for r in runs]
    rows = [(r, p) for r, p in rows if p]
    if not rows:
        return None
    plt = _plt()
    h = 2.1 + 0.55 * len(rows)
    # constrained layout with the legend "outside": it reserves the legend's room, so the x labels are never cut
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(WIDTH_IN, h), sharey=True, layout="constrained")
    names = [label(r) for r, _ in rows]
    ys = list(range(len(rows)))[::-1]
    used = []
    for ax, per_token in ((a1, False), (a2, True)):
        left = [0.0] * len(rows)
        for ph in list(TOP_PHASES) + sorted({k for _, p in rows for k in p} - set(TOP_PHASES)):
            vals = []
            for r, p in rows:
                vals.append(p.get(ph, 0.0) * (_per_token_scale(r, p) if per_token else 1.0))
            if not any(vals):
                continue
            if ph not in used:
                used.append(ph)
            ax.barh(ys, vals, left=left, color=PHASE_COLORS.get(ph, "#9d755d"), height=0.6,
                    label=PHASE_LABELS.get(ph, ph) if per_token is False else None)
            left = [a + b for a, b in zip(left, vals)]
        for y, total in zip(ys, left):
            ax.text(total, y, f" {total:.2f}", va="center", fontsize=8)
        ax.set_xlim(0, max(left) * 1.18 if max(left) > 0 else 1)
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlabel("ms per token (measured, by phase)" if per_token else "ms per cycle")
    a1.set_yticks(ys)
    a1.set_yticklabels(names, fontsize=8)
    a1.set_title("time per cycle, by phase", fontsize=10)
    a2.set_title("time per token (lower is faster)", fontsize=10)
    fig.legend(loc="outside lower center", ncol=len(used), fontsize=8, frameon=False)
    return fig


def _per_token_scale(rec: dict, phases: dict) -> float:
    """ms per token / ms per cycle for the stacked bars: the run's decode ms/token (registry.rows, the number the
    run table and compare show) over its phase total, so chart and tables agree."""
    total = sum(phases.values())
    ms_tok = decode_ms_per_token(rec)
    if ms_tok and total > 0:
        return ms_tok / total
    return 1.0 / tokens_per_cycle(rec)


def _spec_runs(runs):
    return [r for r in runs if (m := RunMetrics.of(r)).accept_length_hist and m.drafted_tokens]


@_chart
def tau_histogram(runs: list[dict]) -> bytes | None:
    """Share of cycles yielding τ = 1, 2, ... tokens, per speculative run, mean τ dashed."""
    spec = _spec_runs(runs)
    if not spec:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH_IN / 2, 3.6 + 0.2 * len(spec)))
    ms = [RunMetrics.of(r) for r in spec]
    keys = sorted({int(k) for m in ms for k in m.accept_length_hist})
    xs = list(range(min(keys), max(keys) + 1))
    w = 0.8 / len(spec)
    for i, (r, m) in enumerate(zip(spec, ms)):
        hist = {int(k): v for k, v in m.accept_length_hist.items()}
        n = sum(hist.values()) or 1
        off = (i - (len(spec) - 1) / 2) * w
        tau = _num(m.accept_length)
        ax.bar([x + off for x in xs], [100.0 * hist.get(x, 0) / n for x in xs], width=w, color=f"C{i}",
               label=f"{label(r)}: mean τ = {tau:.2f} (dashed)" if tau else label(r))
        if tau:
            # drawn over the bars (zorder), with a white casing so it shows where it crosses a bar of its colour
            import matplotlib.patheffects as pe

            ax.axvline(tau, color=f"C{i}", ls="--", lw=1.8, zorder=5,
                       path_effects=[pe.Stroke(linewidth=3.6, foreground="white"), pe.Normal()])
    ax.set_xticks(xs)
    ax.set_xlabel("τ: tokens produced per cycle (accepted + bonus)")
    ax.set_ylabel("% of cycles")
    ax.set_title("accept length τ", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    _legend_below(ax)
    return fig


@_chart
def per_position(runs: list[dict]) -> bytes | None:
    """Acceptance per draft position: unconditional (solid) and conditional on the previous one (dashed)."""
    spec = [r for r in runs if RunMetrics.of(r).per_position_acceptance]
    if not spec:
        return None
    depth = max(len(RunMetrics.of(r).per_position_acceptance) for r in spec)
    if depth == 1:
        return _single_position(spec)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH_IN / 2, 3.6 + 0.2 * (len(spec) + 2)))
    for i, r in enumerate(spec):
        m = RunMetrics.of(r)
        u = [_num(x) for x in m.per_position_acceptance]
        c = [_num(x) for x in m.per_position_acceptance_conditional or []]
        xs = list(range(1, len(u) + 1))
        ax.plot(xs, [100 * x if x is not None else math.nan for x in u], "o-", color=f"C{i}", label=label(r))
        if c:
            ax.plot(xs[:len(c)], [100 * x if x is not None else math.nan for x in c], "s--", color=f"C{i}",
                    alpha=0.7)
    ax.set_ylim(0, 105)
    ax.set_xlabel("draft position (1 = first drafted token)")
    ax.set_ylabel("acceptance, % of cycles")
    ax.set_title("per-position acceptance", fontsize=10)
    ax.set_xticks(range(1, depth + 1))
    ax.grid(alpha=0.3)
    ax.plot([], [], "k-", label="solid: accepted, of all cycles")
    ax.plot([], [], "k--", alpha=0.7, label="dashed: given the previous one accepted")
    _legend_below(ax)
    return fig


def _single_position(spec: list[dict]):
    """One draft position (steps 1): a line through one point says nothing; one bar per run does."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH_IN / 2, 1.6 + 0.45 * len(spec)))
    vals = [100 * (_num(RunMetrics.of(r).per_position_acceptance[0]) or 0.0) for r in spec]
    ys = list(range(len(spec)))[::-1]
    ax.barh(ys, vals, color=[f"C{i}" for i in range(len(spec))], height=0.6)
    for y, v in zip(ys, vals):
        ax.text(v, y, f" {v:.1f}%", va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels([label(r) for r in spec], fontsize=8)
    ax.set_xlim(0, 115)
    ax.set_xlabel("first draft position accepted, % of cycles")
    ax.set_title("acceptance (one draft position per cycle)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return fig


@_chart
def verify_curve(curve: dict) -> bytes | None:
    """A verify_curve run: median forward time vs query tokens per context, with the piecewise fit."""
    res = curve.get("results") or {}
    points, fits = res.get("points") or [], res.get("fits") or {}
    if not points or not fits:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 3.8 + 0.25 * len(fits)))
    knees = 0
    for i, L in enumerate(sorted({p["context"] for p in points})):
        pts = sorted((p for p in points if p["context"] == L), key=lambda p: p["tokens"])
        ns, med = [p["tokens"] for p in pts], [p["median_ms"] for p in pts]
        err = [[m - p.get("p10_ms", m) for m, p in zip(med, pts)], [p.get("p90_ms", m) - m for m, p in zip(med, pts)]]
        noisy = str(L) in fits and noise_words(pts, fits[str(L)])
        # a line through noise would read as a finding: a noisy context gets its points and no fit, no knee
        ax.errorbar(ns, med, yerr=err, fmt="o", color=f"C{i}", capsize=3,
                    label=f"context {L} tokens (measured" + ("; too noisy to fit: no fit drawn)" if noisy else ")"))
        if str(L) in fits and not noisy:
            fit = PiecewiseFit.from_dict(fits[str(L)])
            lo, hi = min(ns), max(ns)
            xs = [lo * (hi / lo) ** (j / 200) for j in range(201)]
            ax.plot(xs, [fit(x) for x in xs], "-", color=f"C{i}", alpha=0.7,
                    label=f"fit: flat {fit.flat_ms:.1f} ms to n≈{fit.knee:.0f}, then +{fit.slope_ms:.2f} ms/token")
            if fit.slope_ms > 0 and lo < fit.knee < hi:
                knees += 1
                ax.axvline(fit.knee, color=f"C{i}", ls=":", alpha=0.6)
    ax.set_xscale("log", base=2)
    ticks = sorted({p["tokens"] for p in points})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("query tokens n verified in one forward (log scale)")
    ax.set_ylabel("target forward, ms (median, p10–p90)")
    ax.set_title(f"verify cost T(n) · run {(curve.get('id') or '')[:8]}" + (" (dotted: knee)" if knees else ""),
                 fontsize=10)
    ax.grid(alpha=0.3)
    _legend_below(ax)
    return fig


@_chart
def breakeven(items: list[dict]) -> bytes | None:
    """Speedup vs τ for each analysed speculative run: S(τ) = τ · T_decode / T_cycle, with the break-even τ
    (S = 1), the most a cycle can yield (steps + 1) and the measured point. items: {"run", "analysis"} where
    analysis is `breakeven()`'s result plus decode_ms, steps and the measured tau/speedup."""
    items = [it for it in items if it.get("analysis") and "error" not in it["analysis"]]
    if not items:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 3.8 + 0.4 * len(items)))
    x_hi, ends = _breakeven_range(items)
    top = 1.0
    for i, it in enumerate(items):
        a = it["analysis"]
        mx = a["max_accept_length"]
        cyc, dec = a["cycle_ms"], a["decode_ms"]
        end = min(mx, x_hi)         # drawn only as far as the axis goes: nothing is clipped mid-line
        xs = [1 + (end - 1) * j / 100 for j in range(101)]
        ys = [x * dec / cyc for x in xs]
        top = max(top, max(ys))
        c = f"C{i}"
        need = a["break_even_accept_length"]
        where = f"break-even τ = {need:.2f} (dotted)" if need <= mx else f"break-even τ = {need:.2f} > max {mx:.0f}"
        ax.plot(xs, ys, "-", color=c, label=f"{label(it['run'])}: τ·T_decode/T_cycle with {dec:.1f} ms/token, "
                                           f"{cyc:.1f} ms/cycle; {where}")
        if need <= min(mx, x_hi):
            ax.axvline(need, color=c, ls=":", alpha=0.8)
        tau = _num(a.get("measured_accept_length"))
        sp = _num(a.get("speedup"))
        if tau is not None and sp is not None:
            top = max(top, sp)
            ax.plot([tau], [sp], "*", color=c, ms=14, mec="black", label=f"measured: τ = {tau:.2f}, {sp:.2f}×")
    ax.axhline(1.0, color="gray", lw=1)
    ax.text(x_hi, 1.0, "plain decoding (1×)", fontsize=8, color="gray", va="bottom", ha="right")
    ax.set_xlim(1.0, x_hi)
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel("τ: tokens per cycle (accepted drafts + bonus); " + ends)
    ax.set_ylabel("speedup over plain decoding (×)")
    ax.set_title("break-even: speculation pays above 1×", fontsize=10)
    ax.grid(alpha=0.3)
    _legend_below(ax, ncol=1)
    return fig


def _breakeven_range(items: list[dict]) -> tuple[float, str]:
    """The τ axis's right end and what the caption says of where the lines end. The axis runs a little past the
    measured τ and the break-even τ, not to steps + 1: a deep tree's steps + 1 (14, say) would stretch the line to
    20× and squeeze the measured point into a corner."""
    mxs = [it["analysis"]["max_accept_length"] for it in items]
    focus = [_num(it["analysis"].get("measured_accept_length")) for it in items]
    focus += [it["analysis"]["break_even_accept_length"] for it in items
              if it["analysis"]["break_even_accept_length"] <= it["analysis"]["max_accept_length"]]
    focus = [x for x in focus if x is not None]
    x_hi = min(max(mxs), max(2.0, 1.6 * max(focus))) if focus else max(mxs)
    if x_hi >= max(mxs):
        return x_hi, "a line ends at its steps + 1, the most a cycle yields"
    return x_hi, f"axis cut at {x_hi:.1f}: the lines run on to steps + 1 = {'/'.join(f'{m:.0f}' for m in sorted(set(mxs)))}"
