"""A vLLM torch trace's decode cycles split into components, the way the plugin's profiler windows split theirs
(`profile/components.py`, vLLM's op table by the trace's version): each cycle's gpu_model_runner scopes painted with
the CPU ops recorded on the same thread. CPU traces (vLLM's CPU build, or a GPU trace's host side: there it is
launch time, said in a note)."""

from __future__ import annotations

import bisect

from specscope.engines.vllm import FORWARD, SCOPE_PHASE, op_table
from specscope.profile.components import Bucket, Classifier, Scope, Span, bucket_key, step_components


def trace_components(cyc, ev, version: str | None) -> tuple[dict, dict, str | None]:
    """({bucket: Bucket.mean()}, {unclassified op name: ms}, a note or None) over every decode cycle of the trace
    (`cyc`: trace_cycles.Cycles, `ev`: its TraceEvents)."""
    rules, note = op_table(version or "?")
    if version is None:
        note = "the trace names no vLLM version: vLLM's own ops count as unclassified"
    classifier = Classifier(rules, note)
    ops = {k: [Span(n, a, b) for a, b, n in sorted(v)] for k, v in ev.ops.items()}
    starts = {k: [s.start for s in v] for k, v in ops.items()}
    buckets: dict[str, Bucket] = {}
    unknown: dict[str, float] = {}
    for key, tokens, fwd, scopes in cyc.scoped:
        mine = [Scope(fwd if SCOPE_PHASE[n] == FORWARD else SCOPE_PHASE[n], n, a, b) for a, b, n in scopes
                if n in SCOPE_PHASE]
        if not mine:
            continue
        spans, st = ops.get(key, []), starts.get(key, [])
        lo = bisect.bisect_left(st, min(s.start for s in mine))
        hi = bisect.bisect_right(st, max(s.end for s in mine))
        comps = step_components(mine, spans[lo:hi], classifier, unknown)
        measured, count = {}, {}
        for s in mine:
            measured[s.phase] = measured.get(s.phase, 0.0) + (s.end - s.start) / 1e3
            count[s.phase] = count.get(s.phase, 0) + 1
        buckets.setdefault(bucket_key(fwd, tokens), Bucket()).add(comps, measured, scopes=count)
    if ev.kernels:
        note = ((note + "; ") if note else "") + ("GPU trace: the components are the host side of each scope "
                                                  "(launches), not the device's kernel time")
    top = dict(sorted(((n, round(us / 1e3, 3)) for n, us in unknown.items()), key=lambda kv: -kv[1])[:20])
    return {k: b.mean() for k, b in buckets.items()}, top, note
