"""The report's chart of what each phase spent its time on (docs/why-verify.md): one stacked bar per run, phase and
step bucket of its profiled steps — attention, MoE experts, GEMMs, LM head, collectives, sampling, elementwise,
host gap — with the experts touched beside a MoE's bar."""

from __future__ import annotations

from specscope.profile.components import COMPONENTS, _bucket_order
from specscope.report.charts import WIDTH_IN, _chart, _plt, label

COLORS = {"attention": "#4c78a8", "experts": "#b279a2", "gemm": "#e45756", "lm_head": "#ff9da6",
          "collectives": "#f58518", "sampling": "#72b7b2", "elementwise": "#54a24b", "host_gap": "#bab0ac",
          "unclassified": "#9d755d"}
PHASES = ("verify", "decode", "draft")


def bars(runs: list[dict]) -> list[tuple[str, dict[str, float], str]]:
    """(bar label, component -> ms per profiled step, note) for every run's phase and bucket, in run order."""
    out = []
    for r in runs:
        comps = (r.get("results") or {}).get("components") or {}
        for key in sorted(comps, key=_bucket_order):
            b = comps[key]
            kind, _, tokens = key.partition("@")
            for ph in PHASES:
                parts = (b.get("components") or {}).get(ph)
                if not parts:
                    continue
                ex = b.get("experts") if ph == kind else None
                note = f"{ex['distinct_per_layer']:.1f}/{ex['of']} experts" if ex else ""
                out.append((f"{label(r)} · {ph} ({tokens} tok)", parts, note))
    return out


@_chart
def components_breakdown(runs: list[dict]):
    """Stacked bars: ms per profiled step by component, per run, phase and bucket; None without components."""
    rows = bars(runs)
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 1.6 + 0.4 * len(rows)), layout="constrained")
    ys = list(range(len(rows)))[::-1]
    left = [0.0] * len(rows)
    for comp, name in COMPONENTS.items():
        vals = [parts.get(comp, 0.0) for _, parts, _ in rows]
        if not any(vals):
            continue
        ax.barh(ys, vals, left=left, color=COLORS.get(comp, "#999999"), height=0.6, label=name)
        left = [a + b for a, b in zip(left, vals)]
    for y, total, (_, _, note) in zip(ys, left, rows):
        ax.text(total, y, f" {total:.2f}" + (f"  {note}" if note else ""), va="center", fontsize=8)
    ax.set_xlim(0, max(left) * 1.3 if max(left) > 0 else 1)
    ax.set_yticks(ys)
    ax.set_yticklabels([t for t, _, _ in rows], fontsize=8)
    ax.set_xlabel("ms per profiled step")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("what each phase spent its time on (profiled steps)", fontsize=10)
    # constrained layout with the legend "outside": it reserves the legend's room below the x label
    fig.legend(loc="outside lower center", ncol=5, fontsize=7.5, frameon=False)
    return fig
