"""The sweep document in words: one formatter per cell and per axis, shared by the terminal table and the HTML
page, so the two always say the same (tests/test_sweep.py checks both against --json)."""

from __future__ import annotations

from specscope.sweep.spec import shown

LEGEND = ("each cell: verify ms/cycle (its share of the cycle), draft ms/cycle, τ (tokens per cycle), output tok/s; "
          "± the standard deviation over the repeats; break-even τ against plain decoding and whether the cell's τ "
          "reaches it")


def _pm(stat: dict | None, fmt: str) -> str:
    if stat is None:
        return "-"
    sd = f" ±{stat['sd']:{fmt}}" if stat.get("sd") is not None else ""
    return f"{stat['mean']:{fmt}}{sd}"


def cell_lines(cell: dict) -> list[str]:
    if cell["status"] == "missing":
        return ["not run yet"]
    if cell["status"] == "failed":
        return ["failed", _clip(cell.get("reason") or "", 44)]
    lines = []
    if cell.get("verify_ms"):
        share = cell.get("verify_share")
        lines.append(f"verify {_pm(cell['verify_ms'], '.1f')} ms" + (f" ({share['mean'] * 100:.0f}%)" if share else ""))
    lines += component_words(cell.get("components") or {})
    if cell.get("draft_ms"):
        lines.append(f"draft {_pm(cell['draft_ms'], '.1f')} ms")
    if cell.get("decode_ms"):
        lines.append(f"decode {_pm(cell['decode_ms'], '.1f')} ms/token")
    if cell.get("tau"):
        lines.append(f"τ {_pm(cell['tau'], '.2f')}")
    lines.append(f"{_pm(cell.get('tok_per_s'), '.1f')} tok/s")
    lines += samples_lines(cell.get("samples"))
    be = cell.get("breakeven")
    if be:
        lines.append(breakeven_words(be))
    if cell["failed"] or cell["missing"]:
        lines.append(f"{cell['n']} of {cell['n'] + cell['failed'] + cell['missing']} repeats"
                     + (f", {cell['failed']} failed" if cell["failed"] else ""))
    return lines


def component_words(comps: dict) -> list[str]:
    """The verify's (or decode's) two largest components in the profiled steps: "  GEMMs 50% · host gap 21%"."""
    from specscope.profile.components import COMPONENTS

    for phase in ("verify", "decode"):
        c = comps.get(phase)
        if c:
            total = sum(c["ms"].values()) or 1.0
            top = sorted(c["ms"].items(), key=lambda kv: -kv[1])[:2]
            return ["  " + " · ".join(f"{COMPONENTS.get(k, k)} {v / total * 100:.0f}%" for k, v in top)]
    return []


def samples_lines(n: dict | None) -> list[str]:
    """What a cell's numbers rest on; failed requests on their own line, the cell's numbers then not judged."""
    if not n:
        return []
    out = [f"n: {n['runs']} run(s), {n['cycles']} cycles, {n['requests']} requests"]
    if n["failed_requests"]:
        out.append(f"FAILED: {n['failed_requests']} of {n['requests']} requests (not judged)")
    return out


def breakeven_words(be: dict) -> str:
    if "error" in be:
        return "break-even: n/a"
    if be["break_even_tau"] > be["max_tau"]:
        return f"break-even τ {be['break_even_tau']:.2f} > max {be['max_tau']:.0f}: never pays"
    pays = "unknown" if be["pays"] is None else "pays" if be["pays"] else "does not pay"
    return f"break-even τ {be['break_even_tau']:.2f}: {pays}"


def _clip(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 1] + "…"


def title(doc: dict) -> str:
    sw, p = doc["sweep"], doc["progress"]
    return f"sweep {sw['name']}: {p['done']} of {p['slots']} runs ({sw['repeats']} repeat(s) a cell)"


def column_heads(doc: dict) -> list[str]:
    m = doc["matrix"]
    axes = m["cols"]["axes"]
    if not axes:
        return [""]
    return [", ".join(f"{n}={shown(v)}" for n, v in zip(axes, combo)) for combo in m["cols"]["values"]]


def row_heads(doc: dict) -> list[str]:
    m = doc["matrix"]
    return [f"{m['rows']['axis']}={shown(v)}" for v in m["rows"]["values"]]


def _pct(x) -> str:
    return "?" if x is None else f"{x * 100:+.1f}%"


def slice_words(axis: str, s: dict) -> str:
    at = ", ".join(f"{n}={shown(v)}" for n, v in s["at"].items())
    runs = s.get("runs") or [0, 0]
    head = (f"{axis} {shown(s['from'])} → {shown(s['to'])}" + (f" at {at}" if at else "")
            + f" ({runs[0]} vs {runs[1]} run(s))")
    if s["verdict"] == "not judged" and not s.get("rows"):
        return f"{head}: not judged ({s.get('why', 'no samples')})"
    from specscope.sweep.axes import NOT_CALLED, called

    if s["verdict"] == NOT_CALLED:
        measured = [r for r in s["rows"] if r["verdict"] == NOT_CALLED]
        return (f"{head}: measured, not called (no launch-to-launch noise to judge it against): "
                + ", ".join(f"{r['label']} {_pct(r['change'])}" for r in measured))
    moved = [r for r in s["rows"] if called(r)]
    small = [r for r in s["rows"] if r["verdict"] in ("better", "worse") and not called(r)]
    tail = ("; also moved, too small a part of the cycle to name: "
            + ", ".join(f"{r['label']} {_pct(r['change'])}" for r in small)) if small else ""
    if not moved:
        judged = sum(r["verdict"] == "no significant change" or r.get("small") for r in s["rows"])
        return (f"{head}: no significant change ({judged} metrics judged){tail}" if judged else
                f"{head}: not judged (no per-cycle or per-prompt samples)")
    parts = [f"{r['label']} {_pct(r['change'])} ({r['verdict']})" for r in moved]
    cause = s.get("cause")
    if cause:
        parts[-1] += f"; likely cause {cause}" + (" (the axis)" if s.get("cause_is_axis") else " (not the axis)")
    if s.get("components"):     # what the moved phase spent it on, in the profiled steps
        parts[-1] += f"; {s['components']['words']}"
    return f"{head}: " + ", ".join(parts) + tail


def axis_headline(a: dict) -> str:
    if a["verdict"] == "not called":
        return f"{a['axis']}: not called (changes measured, without repeats to judge them against)"
    if a["verdict"] != "changed":
        return f"{a['axis']}: {a['verdict']}"
    parts = [f"{m['label']} {'/'.join(sorted(set(m['verdicts'])))} in {m['slices']}/{m['of']} "
             f"({', '.join(_pct(c) for c in m['changes'])})" for m in a["moved"]]
    return f"{a['axis']}: changed — " + "; ".join(parts)


def launch_words(doc: dict) -> str:
    n = doc["launch_noise"]
    label = "ms/cycle" if n["metric"] == "cycle_ms" else "tok/s"
    return (f"launch to launch: repeats of one cell differ by up to {n['max_change'] * 100:.0f}% in {label} "
            f"(compare calls {n['called']} of {n['pairs']} such pairs different); a change between cells no "
            f"larger than its metric's launch-to-launch spread is not called with {doc['sweep']['repeats']} repeats")


def resolves_words(doc: dict) -> str | None:
    """'resolves changes ≥ 6% in verify, ≥ 4% in tok/s': the bands a change must leave, as a reader asks it."""
    got = (doc.get("launch_noise") or {}).get("resolves") or []
    if not got:
        return None
    return ("with these repeats the sweep resolves changes " +
            ", ".join(f"≥ {max(r['change'] * 100, 1):.0f}% in {r['label']}" for r in got))


def host_words(doc: dict) -> str:
    h = doc["host"]
    return (f"the host's own speed (a fixed {h['mib']} MiB read on the compute cores before and "
            f"after each launch) ranged {h['min_gbps']:.1f}-{h['max_gbps']:.1f} GB/s over the sweep "
            f"({h['change'] * 100:.0f}% apart; a launch that ran slow beside a slow reading ran slow for the host's "
            f"reasons)")


def surface_lines(s: dict) -> list[str]:
    """A joined engine surface (sweep.surface): its run, batch sizes × tokens and the commands that read it, or what
    it waits for; the warnings of its making (points left out), said once here."""
    at = f" at {s['key']}" if s["at"] else ""
    if s.get("run_id"):
        lines = [f"engine surface{at}: run {s['run_id']}, batch {', '.join(map(str, s['batches']))} × tokens "
                 f"{', '.join(map(str, s['tokens']))} ({s['steps']} steps pooled from {len(s['runs'])} runs)"]
        lines += experts_lines(s.get("experts") or [])
        lines += [f"  read by: {c}" for c in s["commands"]]
    elif "run_id" in s:
        lines = [f"engine surface{at}: none made from its {len(s['runs'])} runs"]
    else:
        lines = [f"engine surface{at}: waiting for {s['runs_left']} run(s) of its cells"]
    return lines + [f"  note: {w}" for w in s.get("warnings") or []]


def experts_lines(rows: list[dict]) -> list[str]:
    """A MoE surface's experts touched per step size: "  experts touched per layer (of 32): verify, 2 tokens 7.1
    (experts 1.14 ms of forward 9.12 ms) · ..."."""
    if not rows:
        return []

    def ms(r):
        parts = ([f"experts {r['experts_ms']:.2f} ms"] if r.get("experts_ms") is not None else []) + \
            ([f"forward {r['forward_ms']:.2f} ms"] if r.get("forward_ms") is not None else [])
        return f" ({' of '.join(parts)})" if parts else ""

    words = [f"{r['kind']}, {r['tokens']} token{'s' if r['tokens'] != 1 else ''} {r['distinct_per_layer']:.1f}"
             + ms(r) for r in rows]
    return [f"  experts touched per layer (of {rows[0]['of']}): " + " · ".join(words)]


def baseline_words(b: dict) -> str:
    if b["status"] in ("missing", "failed"):
        return f"{b['key']}: {b['status']}"
    return f"{b['key']}: decode {_pm(b.get('decode_ms'), '.1f')} ms/token, {_pm(b.get('tok_per_s'), '.1f')} tok/s"


def axes_header(doc: dict) -> str:
    """The rule the verdicts below follow, stated only with the noise it needs: without a launch-to-launch
    figure (one repeat a cell) nothing is called, and the header says so."""
    if doc.get("launch_noise"):
        return ("what compare says about each axis (called when compare calls it on the pooled repeats and no "
                "repeat pair points the other way, beyond the launch-to-launch noise below)")
    return ("what compare measured along each axis: no cell was launched twice, so there is no launch-to-launch "
            "noise to judge a change against; changes are shown as measured and not called (--repeats 2 or more "
            "calls them)")


def text_lines(doc: dict) -> list[str]:
    """What follows the table: each axis's verdict and slices, the baselines, failures, what is left."""
    out = [LEGEND, "", axes_header(doc) + ":"]
    for a in doc["axes"]:
        out.append("  " + axis_headline(a))
        out += ["    " + slice_words(a["axis"], s) for s in a["slices"]]
    if doc.get("launch_noise"):
        out += ["", launch_words(doc)] + [w for w in (resolves_words(doc),) if w]
    out += [f"placement: {w}" for w in doc.get("placement") or []]
    out += [host_words(doc)] if doc.get("host") else []
    why = sorted({be["error"] for line in doc["matrix"]["cells"] for c in line
                  if (be := c.get("breakeven")) and "error" in be})
    out += [f"break-even n/a: {w}" for w in why]
    for sf in doc.get("engine_surfaces") or []:
        out += [""] + surface_lines(sf)
    if doc["baselines"]:
        out += ["", "baselines (plain decoding, for the break-even):"] + ["  " + baseline_words(b)
                                                                         for b in doc["baselines"]]
    for f in doc["failures"]:
        out += ["", f"failed: {f['slot']}: {f['reason']}"] + ["  | " + ln for ln in (f.get("log_tail") or
                                                                                 "").splitlines()[-8:]]
    p = doc["progress"]
    if p["missing"]:
        out += ["", f"{p['missing']} run(s) missing: run `specscope sweep -w {doc['sweep']['workdir']}` to continue"]
    return out
