"""What a phase spent its time on: the ops a profiler recorded inside one phase scope, painted onto the scope's time
line by kind (attention, experts, GEMMs, LM head, collectives, sampling, elementwise) and the host gap between them.

Input: the phase scopes of a step (`Scope`: phase, the engine's own scope name, start, end) and the ops recorded on
the same thread (CPU ops) or device (kernels) as `Span`s; a `Classifier` names each op's component from one table per
engine version (`engines/<engine>.py`) over torch's and CUDA's own op names (here). Every instant of a scope is
given to exactly one component, so a scope's components sum to its duration:

- covered by a classified op: that op's component, the *outermost* classified one (`aten::linear` holds
  `aten::addmm`; vLLM's attention op holds its kernels' ops: the caller's name wins);
- covered only by ops no table knows: `unclassified` (never guessed; the names are kept for the one-line note);
- covered by no op, or only by a wrapper whose own time is the host's (torch.compile's regions): `host_gap`, time
  the host spent between ops (Python, guards, scheduling, launch latency).

Used by the vLLM plugin's profiler windows (`plugins/windows.py`) and by `ingest` of vLLM's own torch traces, so
both read a step the same way.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

# display order; each label says what the component holds
COMPONENTS = {
    "attention": "attention",
    "experts": "MoE experts",
    "gemm": "GEMMs",
    "lm_head": "LM head",
    "collectives": "collectives",
    "sampling": "sampling",
    "elementwise": "norms & elementwise",
    "host_gap": "host gap",
    "unclassified": "unclassified",
}
HOST_GAP, UNCLASSIFIED = "host_gap", "unclassified"

# torch's and CUDA's own names, the same under every engine version: (regex, component, engine scope parts or None)
TORCH_RULES = (
    # torch.compile's wrappers (there even under vLLM's --enforce-eager): their own time is the host's (guards,
    # Python between the compiled graph's ops); the ops inside them are painted as themselves
    (r"^(Torch-Compiled Region|TorchDynamo Cache Lookup|## Call CompiledFxGraph|Pregraph bytecode|AOTDispatcher )",
     "host_gap", None),
    (r"^(c10d::|_?c10d_functional::|gloo:|nccl:|record_param_comms)", "collectives", None),
    (r"(?i)^nccl.*(kernel|allreduce|allgather|reducescatter|sendrecv)", "collectives", None),
    (r"^aten::(_?scaled_dot_product|_flash_attention|_efficient_attention)", "attention", None),
    (r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_addmm_activation)$", "gemm", None),
    (r"(?i)(gemm|gemv|cublas|cutlass|nvjet|xmma|sgemm|hgemm)", "gemm", None),
    (r"^aten::(argmax|topk|multinomial|exponential_|sort|cumsum|log_softmax|_log_softmax)$", "sampling", None),
    (r"^aten::", "elementwise", None),
    (r"(?i)(elementwise|vectorized_|reduce_kernel|memcpy|memset|copy_kernel|index_select|cat_|fill_kernel)",
     "elementwise", None),
)
# a phase's own nature wins over an op's name in these scope parts: the rejection sampler is sampling whatever ops
# it runs; the logits GEMM after the forward is the LM head
PART_RULES = {"sample": {"*": "sampling"}, "postprocess": {"gemm": "lm_head"}}


@dataclass(frozen=True)
class Span:
    """One recorded op or kernel, times in µs on one clock."""
    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Scope:
    """One phase scope of a step: specscope's phase, the engine's own scope name (`part`), times in µs."""
    phase: str
    part: str
    start: float
    end: float


class Classifier:
    """Op name -> component by the engine version's rules, then torch's; None for a name no rule knows."""

    def __init__(self, engine_rules=None, note: str | None = None):
        self.note = note         # why the engine's own ops are not classified (a version with no table), or None
        rules = tuple(engine_rules or ()) + TORCH_RULES
        self._rules = [(re.compile(p), comp, frozenset(parts) if parts else None) for p, comp, parts in rules]
        self._cache: dict[tuple[str, str], str | None] = {}

    def component(self, name: str, part: str = "") -> str | None:
        key = (name, part)
        if key in self._cache:
            return self._cache[key]
        comp = None
        for rx, c, parts in self._rules:
            if (parts is None or part in parts) and rx.search(name):
                comp = c
                break
        over = PART_RULES.get(part, {})
        if comp is not None or "*" in over:
            comp = over.get("*", over.get(comp, comp))
        self._cache[key] = comp
        return comp


def paint(scope: Scope, spans: list[Span], classifier: Classifier, unknown: dict | None = None) -> dict[str, float]:
    """Component -> µs of one scope (summing to its duration); `spans` need not be sorted nor inside the scope
    (clipped to it). Ops no rule knows add their uncovered time to `unknown` (name -> µs) when given."""
    items = []
    for s in spans:
        a, b = max(s.start, scope.start), min(s.end, scope.end)
        if b > a:
            items.append((a, -b, b, s.name, classifier.component(s.name, scope.part)))
    items.sort()
    cuts = sorted({scope.start, scope.end, *(i[0] for i in items), *(i[2] for i in items)})
    out: dict[str, float] = {}
    active: list[tuple] = []          # (start, -end, end, name, comp), outermost first
    nxt = 0
    for t0, t1 in zip(cuts, cuts[1:]):
        active = [i for i in active if i[2] > t0]
        while nxt < len(items) and items[nxt][0] <= t0:
            bisect.insort(active, items[nxt])
            nxt += 1
        # a host-gap wrapper is transparent: an op inside it, known or not, is painted as itself
        comp = next((i[4] for i in active if i[4] not in (None, HOST_GAP)), None)
        if comp is None:
            nameless = [i for i in active if i[4] is None]
            comp = UNCLASSIFIED if nameless else HOST_GAP
            if nameless and unknown is not None:
                name = nameless[-1][3]
                unknown[name] = unknown.get(name, 0.0) + (t1 - t0)
        out[comp] = out.get(comp, 0.0) + (t1 - t0)
    return out


def step_components(scopes: list[Scope], spans: list[Span], classifier: Classifier,
                    unknown: dict | None = None) -> dict[str, dict[str, float]]:
    """Phase -> component -> ms of one step's scopes (a phase with several scopes adds them)."""
    spans = sorted(spans, key=lambda s: s.start)
    starts = [s.start for s in spans]
    out: dict[str, dict[str, float]] = {}
    for sc in scopes:
        # spans that start before the scope can still cover it (an op around a scope is rare but possible)
        lo = bisect.bisect_left(starts, sc.start)
        inside = spans[lo:bisect.bisect_right(starts, sc.end)]
        inside += [s for s in spans[max(0, lo - 64):lo] if s.end > sc.start]
        got = paint(sc, inside, classifier, unknown)
        ph = out.setdefault(sc.phase, {})
        for c, us in got.items():
            ph[c] = ph.get(c, 0.0) + us / 1e3
    return out


def bucket_key(kind: str, tokens: int) -> str:
    """A step bucket: its kind and the tokens it ran through the target ("verify@4": 1 request verifying 3 drafts)."""
    return f"{kind}@{int(tokens)}"


@dataclass
class Bucket:
    """The profiled steps of one bucket: per phase, the mean ms per step of each component, and of the phase as the
    plugin's own timer measured it in the same steps (the check that the components are the whole phase)."""
    steps: int = 0
    components: dict[str, dict[str, float]] = field(default_factory=dict)   # phase -> component -> ms (sums)
    measured: dict[str, float] = field(default_factory=dict)                # phase -> ms (sums)
    experts: dict[str, float] = field(default_factory=dict)                 # distinct experts per layer (sums)
    scopes: dict[str, int] = field(default_factory=dict)                    # phase -> engine scopes (sums)

    def add(self, comps: dict, measured: dict | None = None, experts: dict | None = None,
            scopes: dict | None = None) -> None:
        self.steps += 1
        for ph, n in (scopes or {}).items():
            self.scopes[ph] = self.scopes.get(ph, 0) + int(n)
        for ph, parts in comps.items():
            mine = self.components.setdefault(ph, {})
            for c, ms in parts.items():
                mine[c] = mine.get(c, 0.0) + ms
        for ph, ms in (measured or {}).items():
            self.measured[ph] = self.measured.get(ph, 0.0) + ms
        if experts:
            self.experts["steps"] = self.experts.get("steps", 0) + 1
            for k in ("distinct", "bytes"):
                self.experts[k] = self.experts.get(k, 0.0) + float(experts.get(k, 0.0))
            self.experts["of"] = experts.get("of", self.experts.get("of"))

    def mean(self) -> dict:
        """The bucket's stored form: per-step means."""
        n = max(self.steps, 1)
        out = {"steps": self.steps,
               "components": {ph: {c: round(ms / n, 4) for c, ms in parts.items()}
                              for ph, parts in self.components.items()},
               "measured": {ph: round(ms / n, 4) for ph, ms in self.measured.items()},
               "scopes": {ph: round(k / n, 3) for ph, k in self.scopes.items()}}
        k = self.experts.get("steps")
        if k:
            out["experts"] = {"distinct_per_layer": round(self.experts["distinct"] / k, 3),
                              "bytes": round(self.experts["bytes"] / k), "of": self.experts.get("of"), "steps": k}
        return out


def merged(runs: list[dict]) -> dict:
    """Several runs' stored components (bucket key -> `Bucket.mean()` form) as one: each bucket's per-step means
    weighted by its steps in each run (a sweep cell's repeats pooled for compare)."""
    out: dict[str, dict] = {}
    for stored in runs:
        for key, b in (stored or {}).items():
            n = int(b.get("steps") or 0)
            if not n:
                continue
            m = out.setdefault(key, {"steps": 0, "components": {}, "measured": {}, "scopes": {}, "_experts": []})
            m["steps"] += n
            for ph, parts in (b.get("components") or {}).items():
                mine = m["components"].setdefault(ph, {})
                for c, ms in parts.items():
                    mine[c] = mine.get(c, 0.0) + ms * n
            for field_ in ("measured", "scopes"):
                for ph, v in (b.get(field_) or {}).items():
                    m[field_][ph] = m[field_].get(ph, 0.0) + v * n
            if b.get("experts"):
                m["_experts"].append(b["experts"])
    for m in out.values():
        n = m["steps"]
        m["components"] = {ph: {c: round(v / n, 4) for c, v in parts.items()} for ph, parts in m["components"].items()}
        for field_ in ("measured", "scopes"):
            m[field_] = {ph: round(v / n, 4) for ph, v in m[field_].items()}
        ex = m.pop("_experts")
        k = sum(int(e.get("steps") or 0) for e in ex)
        if k:
            m["experts"] = {"distinct_per_layer": round(sum(e["distinct_per_layer"] * e["steps"] for e in ex) / k, 3),
                            "bytes": round(sum(e["bytes"] * e["steps"] for e in ex) / k), "of": ex[0].get("of"),
                            "steps": k}
    return out


def lines(stored: dict, phases=("verify", "decode", "draft"), unknown: dict | None = None, note: str | None = None) -> list[str]:
    """The report's lines under `Target verify:` from stored buckets ({key: Bucket.mean()}): per phase and bucket,
    each component's ms and share; experts touched beside it."""
    out = []
    for key in sorted(stored, key=_bucket_order):
        kind, _, tokens = key.partition("@")
        b = stored[key]
        for ph in phases:
            parts = b["components"].get(ph)
            if not parts:
                continue
            total = sum(parts.values()) or 1.0
            shown = " · ".join(f"{COMPONENTS.get(c, c)} {ms:.2f} ({ms / total * 100:.0f}%)"
                               for c, ms in _ordered(parts) if ms >= 0.005)
            out.append(f"  {ph} components, {tokens} tokens ({b['steps']} steps profiled): {shown}")
            ex = b.get("experts")
            if ex and ph == kind:
                out.append(f"    experts touched: {ex['distinct_per_layer']:.1f} of {ex['of']} per layer"
                           f" ({ex['bytes'] / 1e6:.1f} MB of expert weights per step)")
    if note:
        out.append(f"  note: {note}")
    if unknown:
        top = sorted(unknown.items(), key=lambda kv: -kv[1])[:4]
        out.append("  unclassified ops (no rule for them in this engine version's table): "
                   + ", ".join(f"{n} {us / 1e3:.2f} ms" for n, us in top))
    return out


def pooled(buckets, phase: str) -> tuple[dict[str, float], float, int] | None:
    """(component -> mean ms per step, mean tokens per step, steps) of `phase` over every bucket that has it;
    `buckets`: (key "kind@tokens", stored bucket) pairs, from one run or several. None when none has it."""
    comps: dict[str, float] = {}
    tokens = steps = 0
    for key, b in buckets:
        parts = (b.get("components") or {}).get(phase)
        n = int(b.get("steps") or 0)
        if not parts or not n:
            continue
        steps += n
        tokens += n * int(key.partition("@")[2] or 0)
        for c, ms in parts.items():
            comps[c] = comps.get(c, 0.0) + ms * n
    if not steps:
        return None
    return {c: ms / steps for c, ms in comps.items()}, tokens / steps, steps


def change(a: dict, b: dict, phase: str) -> dict | None:
    """How `phase`'s components moved from run a's stored components to run b's: the total, each component's
    delta and share of it (largest in the total's direction first), and the tokens per step on each side; None
    when either run has no profiled step of the phase."""
    pa, pb = pooled(a.items(), phase), pooled(b.items(), phase)
    if pa is None or pb is None:
        return None
    (ca, ta, na), (cb, tb, nb) = pa, pb
    total = sum(cb.values()) - sum(ca.values())
    by = [{"component": c, "delta_ms": round(cb.get(c, 0.0) - ca.get(c, 0.0), 4)} for c in dict.fromkeys([*ca, *cb])]
    for d in by:
        d["share"] = round(d["delta_ms"] / total, 4) if abs(total) > 1e-9 else None
    by.sort(key=lambda d: -d["delta_ms"] * (1 if total >= 0 else -1))
    lead = by[0] if by and by[0]["delta_ms"] * total > 0 else None
    words = f"{phase} {total:+.2f} ms/step in the profiled steps ({na} vs {nb})"
    if lead is not None and lead["share"] is not None:
        words += f": {COMPONENTS.get(lead['component'], lead['component'])} {lead['delta_ms']:+.2f} " \
                 f"({lead['share'] * 100:.0f}%)"
    if abs(ta - tb) >= 0.5:     # a bucket's tokens are its step's: a draft or accept runs in a verify step
        words += f"; {'decode' if phase == 'decode' else 'verify'} tokens per step {ta:g} -> {tb:g}"
    return {"phase": phase, "delta_ms": round(total, 4), "by": by, "tokens": [round(ta, 3), round(tb, 3)],
            "lead": lead["component"] if lead else None, "words": words}


def _ordered(parts: dict) -> list[tuple[str, float]]:
    order = list(COMPONENTS)
    return sorted(parts.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))


def _bucket_order(key: str):
    kind, _, tokens = key.partition("@")
    return (kind, int(tokens) if tokens.isdigit() else 0)
