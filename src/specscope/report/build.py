"""One self-contained HTML file for one or more stored runs: summary, charts (inline PNG), compare table,
per-prompt table and the environment fingerprint.

    from specscope.report import load_runs, write_report
    runs, linked = load_runs(reg, ["last~1", "last"])
    write_report(runs, "report.html", linked=linked)

`linked` holds runs the given ones point at (a speculative run's `config.baseline_run` and
`config.verify_curve_run`): they feed the break-even and verify-curve charts without joining the compare table.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import re
from pathlib import Path

from specscope import __version__
from specscope.economics.breakeven import BreakevenInputs, breakeven, describe, inputs_from_runs
from specscope.economics.verify_curve import knee_words
from specscope.errors import SpecscopeError
from specscope.fileio import write_atomic
from specscope.profile.cycle import PHASE_LABELS
from specscope.registry.compare import compare_runs, one_sided, speed_change, speed_words
from specscope.registry import labels
from specscope.registry import rows as rows_of
from specscope.registry.fingerprint import VOLATILE, flatten, load_warning
from specscope.registry.metrics import RunMetrics
from specscope.report import charts
from specscope.report.components_chart import components_breakdown

LINK_KEYS = ("baseline_run", "verify_curve_run")


def load_runs(reg, refs) -> tuple[list[dict], dict[str, dict]]:
    """The runs named by `refs` (ids, prefixes, last, last~N) and the runs they link to, from a Registry."""
    if not refs:
        raise SpecscopeError("report needs at least one run (an id, a prefix, last or last~N)")
    ids = []
    for ref in refs:
        rid = reg.resolve(ref)
        if rid not in ids:
            ids.append(rid)
    runs = [reg.get_run(i) for i in ids]
    linked = {}
    for r in runs:
        for key in LINK_KEYS:
            lid = (r.get("config") or {}).get(key)
            if lid and lid not in ids and lid not in linked:
                try:
                    linked[lid] = reg.get_run(lid)
                except SpecscopeError:
                    pass        # a deleted baseline only loses its chart, not the report
    return runs, linked


def write_report(runs: list[dict], path, linked: dict | None = None, title: str | None = None) -> Path:
    """Write the report to the regular file `path` (atomically, parents created); returns the path."""
    return write_atomic(path, build_report(runs, linked, title), "report", make_parents=True)


def build_report(runs: list[dict], linked: dict | None = None, title: str | None = None) -> str:
    if not runs:
        raise SpecscopeError("report needs at least one run")
    linked = dict(linked or {})
    by_id = {r.get("id"): r for r in list(linked.values()) + runs if r.get("id")}
    perf = [r for r in runs if r.get("kind") != "verify_curve"]
    curves = [r for r in runs if r.get("kind") == "verify_curve"]
    for r in perf:
        cid = (r.get("config") or {}).get("verify_curve_run")
        if cid in by_id and by_id[cid] not in curves:
            curves.append(by_id[cid])
    title = title or ("specscope report: " + ", ".join(charts.label(r) for r in runs[:4])
                      + (" …" if len(runs) > 4 else ""))
    body = [f"<h1>{esc(title)}</h1>",
            f"<p class=meta>{len(runs)} run(s) · written {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}"
            f" · specscope {esc(specscope_version())}</p>"]
    body += _load_section(runs + [r for r in linked.values() if r not in runs])
    cmp = _compare(perf) if len(perf) >= 2 else None      # one comparison feeds the headline and the table
    body += _summary(runs, perf, by_id, cmp)
    body += _ingest_section(runs)
    body += _profile_section(perf)
    body += _breakeven_section(perf, by_id, cmp)
    for c in curves:
        body += _curve_section(c)
    if cmp is not None:
        body += _compare_section(cmp)
    body += _per_prompt_section(perf)
    body += _env_section(runs)
    return PAGE.format(title=esc(title), css=CSS, body="\n".join(body))


# ---------------------------------------------------------------------------------------------- sections

def _summary(runs, perf, by_id, cmp):
    rows = []
    for r in runs:
        cfg, m = r.get("config") or {}, RunMetrics.of(r)
        # ingested logs may name only some of the knobs
        shape = ", ".join(f"{k} {cfg[key]}" for k, key in (("steps", "steps"), ("topk", "topk"),
                                                            ("draft tokens", "draft_tokens")) if cfg.get(key))
        ms_tok = rows_of.decode_ms_per_token(r)
        rows.append([_code(r.get("id") or "-"), f"<span class=k>{esc(r.get('kind') or '-')}</span>", esc(r.get("name") or ""),
                     _path(_short(cfg.get("model") or cfg.get("model_name"))),
                     _drafter_cell(r) + (f"<br><small>{esc(shape)}</small>" if shape else ""),
                     _f(1e3 / ms_tok if ms_tok else None), _f(ms_tok), _tau_cell(r),
                     _f(rows_of.end_to_end_tok_per_s(r)), _f(m.speedup, "×"),
                     esc((r.get("created_at") or "")[:19].replace("T", " "))])
    heads = [h for r in runs if (h := _headline(r, perf, by_id, cmp))]
    return heads + ["<h2>Runs</h2>",
            html_table(["run", "kind", "name", "model", "drafter", "decode tok/s", "ms/token", "τ",
                        "tok/s end to end", "speedup", "created"], rows, num_cols={5, 6, 7, 8, 9}, raw=True),
            "<p class=note>decode tok/s = 1000 / ms/token: decoding only, per sequence (prefill left out; from the "
            "profiled cycles, or a server's engine steps over the tokens a step yields). tok/s end to end: with "
            "prefill and everything around decoding; for a served or ingested run, the server's output throughput "
            "over all requests. τ = tokens per cycle (accepted drafts + the bonus token), over the cycles counted "
            "under it; plain decoding has τ = 1.</p>"]


def _tau_cell(r: dict) -> str:
    """τ and the number of cycles it rests on."""
    tau, n = RunMetrics.of(r).accept_length, rows_of.cycles_measured(r)
    if not isinstance(tau, (int, float)):
        return "-"
    return _f(tau) + (f"<br><small>{n} cycles</small>" if n else "")


def _headline(r: dict, perf: list[dict], by_id: dict, cmp: dict | None) -> str | None:
    """A speculative run's speed against plain decoding in one line, judged by the rule the Compare table uses
    (registry.compare on the same pair), so the page never calls faster what its table calls noise."""
    m = RunMetrics.of(r)
    tau = m.accept_length
    if r.get("kind") == "verify_curve" or _is_plain(r) or not isinstance(tau, (int, float)):
        return None
    sc = _speed_against_plain(r, perf, by_id, cmp)
    n, ms_tok = rows_of.cycles_measured(r), rows_of.decode_ms_per_token(r)
    tail = (f", τ = {tau:.2f} tokens per cycle" + (f" over {n} cycles" if n else "")
            + (f", {_f(1e3 / ms_tok)} decode tok/s" if ms_tok else ""))
    if sc is not None:
        cls = {"better": "good", "worse": "bad"}.get(sc["verdict"], "dim")
        return (f"<p class=headline><b>{esc(charts.label(r))}</b>: <span class={cls}>{sc['ratio']:.2f}×</span> "
                f"{esc(speed_words(sc, ratio=False))}{esc(tail)}</p>")
    sp = m.speedup
    if not isinstance(sp, (int, float)):
        return None
    return (f"<p class=headline><b>{esc(charts.label(r))}</b>: <span class=dim>{sp:.2f}×</span> the speed of plain "
            f"decoding as the run recorded it (no plain run in this report to judge its noise){esc(tail)}</p>")


def _baseline_of(run: dict, by_id: dict, plain: list[dict]) -> dict | None:
    """The plain run a speculative run is measured against: its linked baseline, else a plain run of the same
    model among those given."""
    base = by_id.get((run.get("config") or {}).get("baseline_run"))
    if base is None:
        model = (run.get("config") or {}).get("model")
        base = next((p for p in plain if (p.get("config") or {}).get("model") == model and p is not run), None)
    return base


def _speed_against_plain(run, perf, by_id, cmp) -> dict | None:
    base = _baseline_of(run, by_id, [p for p in perf if _is_plain(p)])
    if base is None:
        return None
    ids = [x["id"] for x in (cmp or {}).get("runs", [])]
    if ids and ids[0] == base.get("id") and run.get("id") in ids[1:]:
        return speed_change(cmp, ids.index(run["id"]))        # the very row the Compare table shows
    try:
        return speed_change(compare_runs([base, run]), 1)
    except SpecscopeError:
        return None


def _drafter_cell(r) -> str:
    """What drafted: the drafter (or the method an engine named), else, where the run drafted, that its record
    does not name it; "none" only for a run that did not draft."""
    name = labels.drafter_name(r)
    if name:
        return _path(_short(name))
    if labels.drafted(r):
        return f"<span class=dim>{esc(labels.unnamed_drafter(r))}</span>"
    return "none" if r.get("kind") != "ingest" else "<span class=dim>not in the log</span>"


def _load_section(runs):
    warned = [(r, w) for r in runs if (w := load_warning(r.get("env")))]
    if not warned:
        return []
    return ["<div class=warn><b>Were these runs comparable?</b><ul>"
            + "".join(f"<li>run <code>{esc((r.get('id') or '?')[:8])}</code> ({esc(charts.label(r))}) was {esc(w)}.</li>"
                      for r, w in warned) + "</ul></div>"]


def _ingest_section(runs):
    """Ingested logs: how much of the file was understood, what was skipped and why."""
    rows, notes = [], []
    for r in runs:
        info = (r.get("results") or {}).get("ingest")
        if not isinstance(info, dict):
            continue
        rec = ", ".join(f"{k} {v}" for k, v in (info.get("recognised") or {}).items() if v) or "-"
        rows.append([_code((r.get("id") or "?")[:8]), esc(info.get("format") or "-"), esc(info.get("lines")), esc(rec),
                     f"<span class={'bad' if info.get('malformed') else 'dim'}>{esc(info.get('malformed', 0))}</span>",
                     esc(info.get("other", 0))])
        for ex in (info.get("malformed_examples") or [])[:3]:
            notes.append(f"<li><code>{esc((r.get('id') or '?')[:8])}</code> malformed line {esc(ex.get('line'))}: "
                         f"{esc(ex.get('reason'))}</li>")
        for w in info.get("warnings") or []:
            notes.append(f"<li><code>{esc((r.get('id') or '?')[:8])}</code> {esc(w)}</li>")
    if not rows:
        return []
    return (["<h2>Ingested logs</h2>",
             html_table(["run", "format", "lines", "recognised", "malformed", "other"], rows, num_cols={2, 4, 5}, raw=True)]
            + (["<ul class=notes>" + "".join(notes) + "</ul>"] if notes else []))


def _profile_section(perf):
    out = ["<h2>Where the time goes</h2>"]
    img = charts.cycle_breakdown(perf)
    tau, pos = charts.tau_histogram(perf), charts.per_position(perf)
    acceptance = []
    if tau or pos:      # ingested logs often carry acceptance without phase timings
        acceptance = ["<h2>Acceptance</h2><div class=pair>"
                      + (_img(tau, "histogram of τ, tokens per cycle") if tau else "")
                      + (_img(pos, "per-position acceptance rate") if pos else "") + "</div>"]
    if img is None:
        return out + ["<p class=note>No per-phase timings in these runs (e.g. ingested logs carry none).</p>"] \
            + acceptance
    out.append(_img(img, "cycle time breakdown: stacked ms per cycle and per token, by phase"))
    comps = components_breakdown(perf)
    if comps is not None:       # plugin windows / vLLM traces: what each phase spent its time on (why-verify.md)
        out.append(_img(comps, "components of each phase: stacked ms per profiled step"))
    rows = []
    for r in perf:
        for name, ph in (RunMetrics.of(r).phases or {}).items():
            if isinstance(ph, dict):
                rows.append([_code(charts.label(r)), esc(("  ↳ " if "." in name else "") + _phase_label(name)),
                             _f(ph.get("mean_ms")), _f(ph.get("median_ms")), _f(ph.get("p90_ms")),
                             _f(100 * ph["share"], "%") if isinstance(ph.get("share"), (int, float)) else "-"])
    out.append("<details><summary>phase table (ms per cycle)</summary>"
               + html_table(["run", "phase", "mean", "median", "p90", "share"], rows, num_cols={2, 3, 4, 5}, raw=True)
               + "</details>")
    return out + acceptance


def _is_plain(r: dict) -> bool:
    m = RunMetrics.of(r)
    return not m.drafted_tokens and "decode" in (m.phases or {})


def breakeven_analysis(run: dict, by_id: dict, plain: list[dict] = ()) -> dict | None:
    """`specscope breakeven --run` for one stored speculative run, against its linked baseline, else a plain run
    of the same model among `plain` (e.g. `specscope report BASE SPEC` of two generate runs)."""
    if not RunMetrics.of(run).drafted_tokens and run.get("kind") not in ("speculative",):
        return None
    base = _baseline_of(run, by_id, plain)
    try:
        inp = inputs_from_runs(run, base, BreakevenInputs())
        res = breakeven(inp)
    except SpecscopeError as e:
        # the library names `specscope breakeven`'s flags; the report has none of them
        msg = re.sub(r" \(pass [^)]*\)", "", str(e))
        return {"error": msg + ". For the report: pass a plain-decoding run of the same model along with it "
                               "(specscope report BASELINE_RUN RUN), or see `specscope breakeven --run ID --help`"}
    return {**res, "decode_ms": inp.decode_ms, "steps": inp.steps,
            "measured_accept_length": inp.measured_accept_length, "lines": describe(res, inp)}


def _breakeven_section(perf, by_id, cmp=None):
    plain = [r for r in perf if _is_plain(r)]
    items = [{"run": r, "analysis": breakeven_analysis(r, by_id, plain)} for r in perf]
    items = [it for it in items if it["analysis"] is not None]
    if not items:
        return []
    out = ["<h2>Break-even</h2>"]
    img = charts.breakeven(items)
    if img:
        out.append(_img(img, "speedup vs τ with the break-even point"))
    for it in items:
        a = it["analysis"]
        lines = a.get("lines") or [f"not computed: {a.get('error')}"]
        lines = _judged_lines(lines, _speed_against_plain(it["run"], perf, by_id, cmp))
        out.append(f"<p><b>{esc(charts.label(it['run']))}</b></p><ul>"
                   + "".join(f"<li>{esc(x)}</li>" for x in lines) + "</ul>")
    return out


def _judged_lines(lines: list[str], sc: dict | None) -> list[str]:
    """The break-even's "achieved speedup: 1.23x (...): faster than plain decoding" says faster or slower by the
    point value alone; where the compare rule finds the difference within noise, the line says that instead, so
    no section of the page contradicts the headline."""
    if sc is None or sc["verdict"] in ("better", "worse"):
        return lines
    tail = re.compile(r": (faster|slower) than plain decoding$")
    return [tail.sub(f": {sc['verdict']} by the noise-aware comparison (see the headline)", x)
            if x.startswith("achieved speedup:") else x for x in lines]


def _curve_section(curve):
    img = charts.verify_curve(curve)
    if img is None:
        return []
    res = curve.get("results") or {}
    toks = [p["tokens"] for p in res.get("points") or []]
    pts = res.get("points") or []
    words = [f"context {L}: {knee_words(f, max(toks), [p for p in pts if str(p['context']) == str(L)])}"
             for L, f in (res.get("fits") or {}).items()] if toks else []
    return ["<h2>Verify cost</h2>", _img(img, "verify cost curve with piecewise fit"),
            "<ul>" + "".join(f"<li>{esc(w)}</li>" for w in words) + "</ul>",
            "<p class=note>Speculation assumes verifying n tokens costs about one decode step; that holds up to "
            "the knee, where the forward stops being bandwidth-bound.</p>"]


def _compare(perf) -> dict:
    try:
        return compare_runs(perf)
    except SpecscopeError as e:
        return {"error": str(e)}


def _compare_section(res):
    if "error" in res:
        return ["<h2>Compare</h2>", f"<p class=note>{esc(res['error'])}</p>"]
    ids = [(r.get("id") or f"#{i}")[:8] for i, r in enumerate(res["runs"])]
    head = ["metric", f"{ids[0]} (reference)"] + ids[1:]
    kept, only = one_sided(res["rows"])
    rows = []
    for row in kept:
        cells = [esc(row["label"]), _f(row["values"][0])]
        for i in range(1, len(ids)):
            delta = labels.change_label(row["changes"][i])
            delta = "" if delta == "-" else delta
            verdict = row["verdicts"][i] or ""
            cls = {"better": "good", "worse": "bad"}.get(verdict, "dim")
            cells.append(f"{_f(row['values'][i])}<br><small>{esc(delta)} <span class={cls}>{esc(verdict)}</span>"
                         f"</small>")
        rows.append(cells)
    out = ["<h2>Compare</h2>",  # (runs timed under load are flagged at the top of the page)
           f"<p class=note>The first run is the reference. {esc(labels.intervals_note(res))}</p>",
           html_table(head, rows, num_cols=set(range(1, len(head))), raw=True)]
    if only:        # metrics one run has and the other cannot have (acceptance of a plain run): said once
        out.append("<ul class=notes>" + "".join(f"<li>only in <code>{esc(rid[:8])}</code>, nothing to compare "
                                                f"with: {esc(', '.join(labels))}</li>" for rid, labels in only.items())
                   + "</ul>")
    for att in res["attribution"]:
        out.append(f"<p><b>{esc((att.get('run') or '')[:8])} vs {esc((att.get('against') or '')[:8])}:</b> "
                   f"{esc(att.get('summary') or '')}</p>")
        causes = (att.get("likely_causes") or [])[:5]
        if causes:
            out.append("<ul>" + "".join(f"<li>{esc(c['key'])}: {esc(_v(c['a']))} → {esc(_v(c['b']))} "
                                        f"<small>({esc(c['why'])})</small></li>" for c in causes) + "</ul>")
    diff = res["config_diff"]
    if diff:
        out.append("<details><summary>configuration differences</summary>"
                   + html_table(["key"] + ids, [[k] + [_v(x) for x in v] for k, v in diff.items()]) + "</details>")
    return out


def _per_prompt_section(perf):
    out = []
    for r in perf:
        pp = [p for p in (r.get("samples") or {}).get("per_prompt") or [] if isinstance(p, dict)]
        if not pp:
            continue
        cols = [c for c in ("question_id", "category", "prompt_tokens", "tokens", "decode_tok_per_s", "tok_per_s",
                            "accept_length", "cycles", "stop_reason") if any(c in p for p in pp)]
        heads = {"question_id": "question", "prompt_tokens": "prompt tok", "tokens": "new tok",
                 "decode_tok_per_s": "decode tok/s", "tok_per_s": "tok/s (with prefill)", "accept_length": "τ",
                 "stop_reason": "stop"}
        rows = [[_v(p.get(c)) for c in cols] for p in pp[:50]]
        more = f" (first 50 of {len(pp)})" if len(pp) > 50 else ""
        out.append(f"<details><summary>per prompt: {esc(charts.label(r))}{more}</summary>"
                   + html_table([heads.get(c, c.replace("_", " ")) for c in cols], rows,
                            num_cols={i for i, c in enumerate(cols) if c not in ("category", "stop_reason")})
                   + "</details>")
    return (["<h2>Per prompt</h2>"] + out) if out else []


def _env_section(runs):
    flats = []
    for r in runs:
        f = {k: v for k, v in flatten(r.get("env") or {}).items()
             if v not in (None, "", [], {}) and not any(k == x or k.startswith(x + ".") for x in VOLATILE)}
        flats.append(f)
    if not any(flats):
        return ["<h2>Environment</h2><p class=note>No environment fingerprint stored with these runs.</p>"]
    groups: list[tuple[list[str], dict]] = []
    for r, f in zip(runs, flats):
        for ids, g in groups:
            if g == f:
                ids.append((r.get("id") or "?")[:8])
                break
        else:
            groups.append(([(r.get("id") or "?")[:8]], f))
    keys = sorted(set().union(*[g for _, g in groups]))
    head = ["key"] + [", ".join(ids) for ids, _ in groups]
    rows = []
    for k in keys:
        vals = [_v(g.get(k)) for _, g in groups]
        differs = len(set(vals)) > 1
        rows.append([esc(k)] + [(f"<b>{_wrap(v)}</b>" if differs else _wrap(v)) for v in vals])
    note = ("all runs share one environment" if len(groups) == 1
            else f"{len(groups)} environments; differing values in bold")
    return ["<h2>Environment</h2>", f"<p class=note>Fingerprint stored with each run ({note}; volatile fields "
            f"such as timestamps left out).</p>", html_table(head, rows, raw=True, cls="fit")]


# ---------------------------------------------------------------------------------------------- helpers

def _phase_label(name):
    return PHASE_LABELS.get(name, name)


def _img(data: bytes, alt: str) -> str:
    return (f'<figure><img alt="{esc(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
            f"</figure>")


def html_table(head, rows, num_cols=frozenset(), raw=False, cls: str | None = None) -> str:
    """raw: cells are already HTML. cls="fit": the table is laid out to its box's width (columns share it, long
    values wrap) instead of growing with its longest unbreakable value."""
    th = "".join(f"<th{' class=n' if i in num_cols else ''}>{esc(h)}</th>" for i, h in enumerate(head))
    body = []
    for row in rows:
        tds = "".join(f"<td{' class=n' if i in num_cols else ''}>{c if raw else esc(c)}</td>"
                      for i, c in enumerate(row))
        body.append(f"<tr>{tds}</tr>")
    table = f"<table class={cls}>" if cls else "<table>"
    return f"<div class=tw>{table}<thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"


def esc(s) -> str:
    return html.escape("" if s is None else str(s))


def _code(s) -> str:
    return f"<code>{esc(s)}</code>"


def _path(s) -> str:
    """A path or model name that may wrap only after a '/' or '-', never inside a word."""
    return esc(s).replace("/", "/<wbr>")


def _wrap(v) -> str:
    """A long value (a CPU flag list, a path, a command line) that may wrap after a ',', '/' or '=' as well as at
    spaces: an environment table stays in its box."""
    return re.sub(r"([,/=;:])", r"\1<wbr>", esc(v))


def _f(v, unit="") -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "-"
    return (f"{v:.3f}" if abs(v) < 10 else f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}") + unit


def _v(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return _f(x)
    return json.dumps(x) if isinstance(x, (list, dict)) else str(x)


def _short(p) -> str:
    """A model path shown by its last two components: the cache root says nothing."""
    if not p:
        return ""
    parts = str(p).rstrip("/").split("/")
    return "/".join(parts[-2:]) if len(parts) > 2 else str(p)


def specscope_version() -> str:
    return __version__


CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;color:#222;margin:0;background:#fafafa}
main{max-width:1000px;margin:0 auto;padding:16px 20px 40px;background:#fff}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
.meta,.note{color:#666;font-size:12.5px}.headline{font-size:16px;margin:10px 0}
figure{margin:8px 0}img{max-width:100%;height:auto;display:block}
.pair{display:flex;flex-wrap:wrap;gap:0}.pair figure{flex:1 1 480px;min-width:0}
.tw{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;width:100%;table-layout:auto;font-size:12.5px;margin:6px 0}
th,td{border-bottom:1px solid #eee;padding:3px 6px;text-align:left;vertical-align:top;overflow-wrap:normal;
word-break:normal;hyphens:none}
th{background:#f3f3f3;font-weight:600;white-space:nowrap}td.n,th.n{text-align:right;white-space:nowrap}
table.fit{table-layout:fixed}table.fit th{white-space:normal}table.fit th:first-child{width:26%}
table.fit td{overflow-wrap:break-word}
.warn{border:1px solid #e0a800;background:#fff8e1;padding:6px 10px;margin:10px 0;border-radius:4px}
code{font-size:12px;white-space:nowrap}.k{white-space:nowrap}small{color:#555}.good{color:#1a7f37;font-weight:600}.bad{color:#c62828;font-weight:600}
.dim{color:#888}details{margin:6px 0}summary{cursor:pointer;color:#333}ul{margin:4px 0 8px 18px;padding:0}
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title><style>{css}</style></head>
<body><main>
{body}
</main></body></html>
"""
