"""The HTML page of a sweep (`specscope sweep` writes it beside its sweep file), built with the report module's
page, style and tables: the matrix, what compare says about each axis, the baselines, failed cells with the
engine's last log lines, and the order the cells ran in. Drawn from the same document and with the same words as
the terminal table (`sweep.render`)."""

from __future__ import annotations

import datetime as _dt

from specscope.report.build import CSS, PAGE, esc, html_table, specscope_version
from specscope.sweep import render


def build_sweep_report(doc: dict) -> str:
    sw, p = doc["sweep"], doc["progress"]
    title = f"specscope sweep {sw['name']}"
    body = [f"<h1>{esc(title)}</h1>",
            f"<p class=meta>{p['done']} of {p['slots']} runs · {sw['repeats']} repeat(s) a cell · runs tagged "
            f"<code>{esc(sw['tag'])}</code> · written {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}"
            f" · specscope {esc(specscope_version())}</p>",
            f"<p class=note>launch: <code>{esc(sw['command'])}</code></p>",
            "<h2>Matrix</h2>", f"<p class=note>{esc(render.LEGEND)}.</p>", _matrix(doc)]
    body += _axes(doc)
    if doc.get("engine_surfaces"):
        body.append("<h2>Engine surface</h2>")
        for sf in doc["engine_surfaces"]:
            head, *rest = render.surface_lines(sf)
            body.append(f"<p><b>{esc(head)}</b></p>" + ("<ul>" + "".join(f"<li>{esc(x.strip())}</li>" for x in rest)
                                                         + "</ul>" if rest else ""))
    if doc["baselines"]:
        body += ["<h2>Baselines</h2>", "<ul>" + "".join(f"<li>{esc(render.baseline_words(b))}</li>"
                                                        for b in doc["baselines"]) + "</ul>"]
    if doc["failures"]:
        body.append("<h2>Failed cells</h2>")
        for f in doc["failures"]:
            body.append(f"<p><b>{esc(f['slot'])}</b>: {esc(f['reason'])}</p><pre>{esc(f.get('log_tail') or '')}</pre>")
    order = ", ".join(f"{o['cell']} #{o['repeat'] + 1}" for o in doc["order"])
    body += ["<h2>Order</h2>", f"<p class=note>Interleaved ABBA over the repeats: {esc(order) or 'nothing ran'}.</p>"]
    return PAGE.format(title=esc(title), css=CSS + "pre{font-size:11.5px;background:#f6f6f6;padding:6px}",
                       body="\n".join(body))


def _matrix(doc: dict) -> str:
    heads = [doc["matrix"]["rows"]["axis"]] + render.column_heads(doc)
    rows = [[esc(h)] + ["<br>".join(esc(x) for x in render.cell_lines(c)) for c in line]
            for h, line in zip(render.row_heads(doc), doc["matrix"]["cells"])]
    return html_table(heads, rows, num_cols=set(range(1, len(heads))), raw=True)


def _axes(doc: dict) -> list[str]:
    rule = ("Each axis's first value against the others, the other axes held fixed; the repeats of a cell pooled; "
            "a change is called when compare calls it on the pooled cells, no repeat pair points the other way, "
            "and it is larger than the metric's launch-to-launch noise (compare's intervals cover the noise within "
            "a run; two launches of one setting differ by more on a shared machine, which only repeats show). "
            "Phases under 3% of the cycle are listed, not called.")
    out = ["<h2>What compare says about each axis</h2>",
           f"<p class=note>{esc(rule if doc.get('launch_noise') else render.axes_header(doc) + '.')}</p>"]
    if doc.get("launch_noise"):
        out.append(f"<p class=note>{esc(render.launch_words(doc))}.</p>")
        if (words := render.resolves_words(doc)):
            out.append(f"<p class=note>{esc(words)}.</p>")
    out += [f"<p class=note>placement: {esc(w)}.</p>" for w in doc.get("placement") or []]
    if doc.get("host"):
        out.append(f"<p class=note>{esc(render.host_words(doc))}.</p>")
    for a in doc["axes"]:
        out.append(f"<p><b>{esc(render.axis_headline(a))}</b></p>")
        out.append("<ul>" + "".join(f"<li>{esc(render.slice_words(a['axis'], s))}</li>" for s in a["slices"])
                   + "</ul>")
    return out
