"""A vLLM torch trace's events (as `torch_trace` collects them) -> one cycle per decode step, split into specscope's
phases, and the run `ingest_file` stores: results, samples, config, warnings. The module docstring of `torch_trace`
says what vLLM writes and how steps, scopes and kernels become cycles and phases."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from specscope.engines.vllm import FORWARD, SCOPE_PHASE, SINGLE   # one table for the trace and the plugin
from specscope.errors import SpecscopeError
from specscope.ingest.lines import histogram, stats
from specscope.profile.cycle import PHASE_LABELS, TOP_PHASES, quantile

_RUN_ORDER = list(SCOPE_PHASE)          # sub-phases are listed in the order vLLM runs the scopes

TIMES = {"torch_profiler_cpu_scopes": "CPU-side: the worker thread's wall clock inside vLLM's gpu_model_runner scopes "
                                     "(the torch profiler's user_annotation events)",
         "gpu_kernels_by_launching_scope": "device time of the GPU kernels each scope launched (linked by correlation "
                                           "id); cycle and other from the worker's host window; CPU-side times in "
                                           "cpu_phases"}
STEPS, SCOPES, KERNELS = "steps", "scopes", "kernels"
PREFILL = "prefill step (requests without an output token yet): not a decode cycle"
MIXED = "mixed prefill + decode step: its time is not one decode cycle"
EMPTY = "empty step (no token scheduled)"
CUT = "cut off: no forward or sample scope in the step (the trace starts or ends inside it?)"


@dataclass
class TraceEvents:
    """What a trace holds for the cycles, by kind of event (the parser fills it)."""
    steps: dict[tuple, list] = field(default_factory=dict)    # (pid, tid) -> [(ts, end, C, T, G, U, name)]
    scopes: dict[tuple, list] = field(default_factory=dict)   # (pid, tid) -> [(ts, end, scope name)]
    launches: dict = field(default_factory=dict)              # correlation -> (ts, pid, tid)
    kernels: list = field(default_factory=list)               # (correlation, dur ms)
    overhead: list = field(default_factory=list)  # (ts, dur) of the profiler's own "overhead" events (CUPTI buffers)
    cpu_ops: list[float] = field(default_factory=list)  # start stamps of recorded ops: how much the profiler recorded
    ops: dict[tuple, list] = field(default_factory=dict)     # (pid, tid) -> [(ts, end, name)] of the CPU ops
    other_annotations: int = 0                               # user annotations neither steps nor scopes


@dataclass
class Cycles:
    """The decode cycles, in order: per-cycle columns and what the results and warnings need beside them."""
    cpu: dict[str, list[float]] = field(default_factory=dict)   # phase -> CPU-side scope ms per cycle
    windows: list[tuple] = field(default_factory=list)          # (key, start, end, forward phase) per cycle
    totals: list[float] = field(default_factory=list)           # the worker's host window per cycle, ms
    gaps: list[float] = field(default_factory=list)             # ms from a cycle's end to the next decode step
    batch: list[int] = field(default_factory=list)              # decode requests per cycle
    drafts: list[float] = field(default_factory=list)   # draft tokens per decode request, per verify step
    unknown: dict[str, int] = field(default_factory=dict)       # scope names this reader does not know -> count
    outer: dict[tuple, list] = field(default_factory=dict)      # (pid, tid) -> the outermost scopes, sorted
    scoped: list[tuple] = field(default_factory=list)  # (key, tokens, forward phase, scopes) per cycle: components


@dataclass
class Timing:
    """The columns the phases are summarised from: kernel time on a GPU trace, the CPU-side scopes otherwise."""
    cycle_ms: dict[str, list[float]]
    totals: list[float]
    timer: str                # a key of TIMES
    gpu: dict | None          # results.gpu, on a GPU trace


# ---- summary statistics (as CycleProfiler.summary() computes them) ------------------------------------------------
def _order(names) -> list[str]:
    def key(name):
        top, _, sub = name.partition(".")
        return (TOP_PHASES.index(top) if top in TOP_PHASES else len(TOP_PHASES), top, bool(sub),
                _RUN_ORDER.index(sub) if sub in _RUN_ORDER else len(_RUN_ORDER), name)
    return sorted(names, key=key)


def summarise(cycle_ms: dict[str, list[float]], total_ms: list[float]) -> dict:
    """{"cycles", "cycle_ms": {mean_ms, median_ms, p90_ms}, "phases": {name: {mean_ms, median_ms, p90_ms, share}}}
    from per-cycle columns, the shapes and rounding of `CycleProfiler.summary()` (share of the summed cycle time)."""
    n, total = len(total_ms), sum(total_ms)
    phases = {}
    for name in _order(cycle_ms):
        col = cycle_ms[name]
        if name == "other" and not any(col):
            continue
        s = sorted(col)
        phases[name] = {"mean_ms": round(sum(col) / n, 4), "median_ms": round(quantile(s, 0.5), 4),
                        "p90_ms": round(quantile(s, 0.9), 4),
                        "share": round(sum(col) / total, 4) if total > 0 else 0.0}
    st = sorted(total_ms)
    cyc = {"mean_ms": round(total / n, 4) if n else 0.0, "median_ms": round(quantile(st, 0.5), 4),
           "p90_ms": round(quantile(st, 0.9), 4)}
    return {"cycles": n, "cycle_ms": cyc, "phases": phases}


def phase_lines(results: dict) -> list[str]:
    """The profile report's lines (`CycleProfiler.lines()`): 'Target verify: 95.10 ms/cyc ( 63.2%)', ..."""
    out = []
    for name, ph in (results.get("phases") or {}).items():
        label = PHASE_LABELS.get(name, ("  " + name) if "." in name else name)
        out.append(f"{label}: {ph['mean_ms']:.2f} ms/cyc ({ph['share'] * 100:5.1f}%)")
    c = results.get("cycle_ms") or {}
    if results.get("cycles"):
        tokens = f", tokens: {results['tokens']}" if results.get("tokens") is not None else ""
        out.append(f"Cycles: {results['cycles']}{tokens}, {c['mean_ms']:.2f} ms/cyc "
                   f"(median {c['median_ms']:.2f}, p90 {c['p90_ms']:.2f})")
    if results.get("accept_length") is not None and results.get("tok_per_s"):
        out.append(f"Decode: {results['tok_per_s']:.2f} tok/s ({results['decode_ms_per_token']:.2f} ms/token)")
    b = results.get("between_steps_ms")
    if b:
        out.append(f"Between steps (engine core, not in the cycles): {b['mean']:.2f} ms (median {b['median']:.2f})")
    return out


def _hist(values: list[float]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in sorted(values):
        k = f"{v:g}"
        out[k] = out.get(k, 0) + 1
    return out


def _inside(stamps: list[float], windows: list[tuple]) -> int:
    """How many stamps fall inside a cycle window (any thread: the windows are the worker's steps in time)."""
    wins = sorted((a, b) for _, a, b, _ in windows)
    starts = [w[0] for w in wins]
    n = 0
    for ts in stamps:
        j = bisect.bisect_right(starts, ts) - 1
        if j >= 0 and ts <= wins[j][1]:
            n += 1
    return n


# ---- steps -> cycles (CPU-side scopes) ----------------------------------------------------------------------------
def _put(col: dict, name: str, v: float, i: int) -> None:
    """Add v to cycle i of column `name` (a column starts when a cycle first has that phase)."""
    c = col.setdefault(name, [])
    c += [0.0] * (i + 1 - len(c))
    c[i] += v


def _outermost(scopes: list, acct) -> list:
    """Only the outermost gpu_model_runner scopes of a thread (sorted): a nested one is already counted in its
    parent."""
    outer, reach = [], -math.inf
    for s in scopes:
        if s[1] <= reach:
            acct.skip(SCOPES, "nested in another gpu_model_runner scope (counted in it)")
            continue
        outer.append(s)
        reach = max(reach, s[1])
    return outer


def _scopes_by_step(steps: list, outer: list, acct) -> list[list]:
    """Each scope to the step that started last before it (sample_tokens runs after the step annotation closes)."""
    starts = [s[0] for s in steps]
    by_step: list[list] = [[] for _ in steps]
    for s in outer:
        j = bisect.bisect_right(starts, s[0]) - 1
        if j < 0:
            acct.skip(SCOPES, "before the first step annotation")
        else:
            by_step[j].append(s)
    return by_step


def _left_out(c: int, g: int, mine: list) -> str | None:
    """Why a step is not a decode cycle (prefill, mixed, empty, cut off), or None."""
    if c and g:
        return MIXED
    if c:
        return PREFILL
    if not g:
        return EMPTY
    if not {"forward", "sample"} <= {s[2] for s in mine}:
        return CUT
    return None


def _add_cycle(cyc: Cycles, key: tuple, step: tuple, mine: list) -> float:
    """One decode step's cycle: its host window and CPU-side phases; returns the window's end."""
    ts, end, c, t, g, u, name = step
    i = len(cyc.totals)
    fwd = "verify" if u > g else "decode"
    w_end = max([end] + [s[1] for s in mine])
    total = (w_end - ts) / 1e3
    inside = 0.0
    for s0, s1, sname in mine:
        ms = (s1 - s0) / 1e3
        top = SCOPE_PHASE.get(sname)
        if top is None:
            cyc.unknown[sname] = cyc.unknown.get(sname, 0) + 1
            _put(cyc.cpu, f"other.{sname}", ms, i)
            continue
        top = fwd if top == FORWARD else top
        _put(cyc.cpu, top, ms, i)
        if top not in SINGLE:
            _put(cyc.cpu, f"{top}.{sname}", ms, i)
        inside += ms
    _put(cyc.cpu, "other", max(total - inside, 0.0), i)
    cyc.totals.append(total)
    cyc.windows.append((key, ts, w_end, fwd))
    cyc.scoped.append((key, u, fwd, mine))
    cyc.batch.append(g)
    if u > g:
        cyc.drafts.append(u / g - 1)
    return w_end


def decode_cycles(ev: TraceEvents, acct) -> Cycles:
    """Every decode step of every thread -> a cycle; the other steps and their scopes are counted as skipped on
    `acct` (the parser's line accounting)."""
    cyc = Cycles()
    for key in sorted(ev.steps, key=str):
        st = sorted(ev.steps[key])
        cyc.outer[key] = _outermost(sorted(ev.scopes.get(key, [])), acct)
        for j, mine in enumerate(_scopes_by_step(st, cyc.outer[key], acct)):
            reason = _left_out(st[j][2], st[j][4], mine)
            if reason:
                acct.skip(STEPS, reason)
                acct.skip(SCOPES, "in a step left out (see steps)", len(mine))
                continue
            w_end = _add_cycle(cyc, key, st[j], mine)
            if j + 1 < len(st) and st[j + 1][4]:     # the next step still decodes: the engine was not idle
                cyc.gaps.append((st[j + 1][0] - w_end) / 1e3)
    for col in cyc.cpu.values():
        col += [0.0] * (len(cyc.totals) - len(col))
    return cyc


# ---- GPU kernels --------------------------------------------------------------------------------------------------
def _launching_phase(scopes: list, lts: float, fwd: str) -> tuple[str, str | None]:
    """(phase, sub-phase or None) of the scope open at launch time lts (other.unscoped outside every scope)."""
    k = bisect.bisect_right(scopes, (lts, math.inf, "")) - 1
    sname = scopes[k][2] if k >= 0 and scopes[k][0] <= lts <= scopes[k][1] else None
    top = SCOPE_PHASE.get(sname) if sname else None
    if top is None:
        return "other", (f"other.{sname}" if sname else "other.unscoped")
    name = fwd if top == FORWARD else top
    return name, None if name in SINGLE else f"{name}.{sname}"


def kernel_phases(cyc: Cycles, ev: TraceEvents, acct, warnings: list) -> tuple[dict, dict] | None:
    """Each kernel to the cycle and phase whose scope launched it (its launch event has the same correlation):
    (phase -> kernel ms per cycle, results.gpu), or None when no kernel belongs to a timed cycle."""
    by_key: dict = {}
    for i, (key, a, b, fwd) in enumerate(cyc.windows):
        by_key.setdefault(key, []).append((a, b, i, fwd))
    gpu: dict[str, list[float]] = {}
    used = 0
    for corr, ms in ev.kernels:
        la = ev.launches.get(corr) if corr is not None else None
        if la is None:
            acct.skip(KERNELS, "no launch event with its correlation id")
            continue
        lts, pid, tid = la
        wins = by_key.get((pid, tid)) or []
        j = bisect.bisect_right(wins, (lts, math.inf)) - 1
        if j < 0 or lts > wins[j][1]:
            acct.skip(KERNELS, "launched outside the timed cycles (prefill, between steps, ...)")
            continue
        _, _, i, fwd = wins[j]
        for nm in _launching_phase(cyc.outer.get((pid, tid), []), lts, fwd):
            if nm:
                c = gpu.setdefault(nm, [0.0] * len(cyc.windows))
                c[i] += ms
        used += 1
    n_k = len(ev.kernels)
    if not used:
        warnings.append(f"{n_k} GPU kernel events, none linked to a timed cycle's launch: the phases are "
                        "CPU-side scope times")
        return None
    warnings.append(f"phases are GPU kernel time by the scope that launched each kernel ({used} of {n_k} "
                    "kernels; concurrent streams would be summed); the CPU-side scope times are in "
                    "results.cpu_phases")
    busy = [sum(gpu[k][i] for k in gpu if "." not in k) for i in range(len(cyc.windows))]
    return gpu, {"kernels": n_k, "attributed": used, "kernel_ms_per_cycle": stats(busy)}


def _gpu_cycles(gpu: dict, host_totals: list[float]) -> tuple[dict, list[float]]:
    """Phases = kernel time (other = launches outside scopes + host time no kernel covers); the cycle is the host
    window, or the kernels' time when that is longer (the host ran ahead of the device)."""
    cols = {k: list(v) for k, v in gpu.items()}
    tops = [k for k in cols if "." not in k and k != "other"]
    totals = []
    other = cols.setdefault("other", [0.0] * len(host_totals))
    for i, host in enumerate(host_totals):
        inside = sum(cols[k][i] for k in tops)
        total = max(host, inside + other[i])
        other[i] = total - inside
        totals.append(total)
    return cols, totals


def phase_timing(cyc: Cycles, ev: TraceEvents, acct, warnings: list) -> Timing:
    """Kernel time by launching scope when the trace holds kernels linked to the cycles, else the CPU-side scopes."""
    linked = kernel_phases(cyc, ev, acct, warnings) if ev.kernels else None
    if linked is None:
        return Timing(cyc.cpu, cyc.totals, "torch_profiler_cpu_scopes", None)
    gpu, info = linked
    cycle_ms, totals = _gpu_cycles(gpu, cyc.totals)
    return Timing(cycle_ms, totals, "gpu_kernels_by_launching_scope", info)


def _overhead(overhead: list, windows: list) -> dict | None:
    if not overhead or not windows:
        return None
    inside = sum(dur for ts, dur in overhead if _inside([ts], windows)) / 1e3
    total = sum(b - a for _, a, b, _ in windows) / 1e3
    per = inside / len(windows)
    return {"events": len(overhead), "ms_per_cycle": round(per, 5),
            "share": round(inside / total, 6) if total > 0 else 0.0,
            "what": "the trace's own 'overhead' events inside the cycles (Kineto/CUPTI buffer handling)"}


# ---- the run ------------------------------------------------------------------------------------------------------
def _dist(doc: dict) -> dict:
    return doc.get("distributedInfo") if isinstance(doc.get("distributedInfo"), dict) else {}


def _results(doc: dict, ev: TraceEvents, cyc: Cycles, timing: Timing) -> dict:
    n = len(cyc.totals)
    summ = summarise(timing.cycle_ms, timing.totals)
    res: dict = {"cycles": n, "cycle_ms": summ["cycle_ms"], "phases": summ["phases"]}
    if timing.gpu is not None:
        res["cpu_phases"] = summarise(cyc.cpu, cyc.totals)["phases"]
        res["gpu"] = timing.gpu
    if not cyc.drafts:
        # plain decoding: every decode request gets exactly one token per step (per request, as τ is)
        tot = sum(timing.totals)
        res.update({"accept_length": 1.0, "tokens": n, "tok_per_s": round(n / (tot / 1e3), 4),
                    "decode_tok_per_s": round(n / (tot / 1e3), 4), "decode_ms_per_token": round(tot / n, 4),
                    "accept_length_hist": {"1": n}})
    res["batch_size"] = stats(cyc.batch)
    res["batch_size_hist"] = histogram(cyc.batch)
    if cyc.drafts:
        res["draft_tokens_per_request_hist"] = _hist(cyc.drafts)
    if cyc.gaps:
        res["between_steps_ms"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in stats(cyc.gaps).items()}
    span = (max(w[2] for w in cyc.windows) - min(w[1] for w in cyc.windows)) / 1e6
    res["duration_s"] = round(span, 6)
    dist = _dist(doc)
    res["trace"] = {"steps": sum(len(v) for v in ev.steps.values()), "threads": len(ev.steps),
                    "rank": dist.get("rank"), "world_size": dist.get("world_size")}
    ops_per_cycle = round(_inside(ev.cpu_ops, cyc.windows) / n, 1) if ev.cpu_ops else None
    res["profiler"] = {"timer": timing.timer, "times": TIMES[timing.timer],
                       "overhead": _overhead(ev.overhead, cyc.windows), "cpu_ops_per_cycle": ops_per_cycle}
    return res


def _draft_steps(drafts: list[float]) -> int | None:
    """The most common whole number of draft tokens per request: the drafter's steps (k)."""
    whole = [round(d) for d in drafts if abs(d - round(d)) < 1e-9]
    return max(set(whole), key=whole.count) if whole else None


def _speculative_notes(cyc: Cycles, res: dict, steps_k: int | None) -> list[str]:
    n, notes = len(cyc.totals), []
    if len(cyc.drafts) < n:
        notes.append(f"{n - len(cyc.drafts)} of {n} decode steps verified no draft token (decode, not verify, "
                     "in those cycles): drafts left out near the context limit?")
    if len(set(cyc.drafts)) > 1:
        notes.append("draft tokens per request vary between steps (" + ", ".join(
            f"{k}: {v}" for k, v in res["draft_tokens_per_request_hist"].items()) + f"); steps = {steps_k}, "
            "the most common")
    notes.append("a torch trace holds no acceptance counts: τ, tok/s and ms/token are left out. For τ "
                 "ingest the server's /metrics scrape or the specscope vLLM plugin's JSONL from the same "
                 "run")
    return notes


def _cycle_notes(doc: dict, ev: TraceEvents, cyc: Cycles, res: dict) -> list[str]:
    n, batch, notes = len(cyc.totals), cyc.batch, []
    if not all(b == 1 for b in batch):
        notes.append(f"{sum(1 for b in batch if b > 1)} of {n} cycles decode several requests at once "
                     f"(batch up to {max(batch)}): a cycle's time is per step, shared by its requests")
    if cyc.unknown:
        notes.append("scopes this reader does not know, counted under other: "
                     + ", ".join(f"{k} ({v})" for k, v in sorted(cyc.unknown.items())))
    if len(ev.steps) > 1:
        notes.append(f"step annotations on {len(ev.steps)} threads; their cycles are pooled")
    if cyc.gaps:
        notes.append(f"a cycle is the worker's time for a step (its execute_model and sample_tokens scopes); "
                     f"the {res['between_steps_ms']['median']:.2f} ms median between steps (engine core: "
                     f"scheduling, IPC, output processing) is not in it: results.between_steps_ms")
    if "gpu" not in res and (doc.get("deviceProperties") or []):
        notes.append("the trace names GPUs but holds no kernel events: the phases are CPU-side scope times "
                     "(host launch and wait time), not device time; record with CUDA activity for kernels")
    elif "gpu" not in res:
        notes.append("times are the CPU-side scopes' wall clock on the worker thread (a CPU run: that is the "
                     "compute)")
    oh, ops_per_cycle = res["profiler"]["overhead"], res["profiler"]["cpu_ops_per_cycle"]
    if oh:
        notes.append(f"the profiler's own overhead events (CUPTI buffer handling) take {oh['ms_per_cycle']:.3f} "
                     f"ms per cycle ({oh['share'] * 100:.2f}% of it); recording every op costs more than that")
    notes.append("profiled steps run slower than unprofiled ones (the torch profiler records every op"
                 + (f": {ops_per_cycle:.0f} CPU ops per cycle here" if ops_per_cycle else "")
                 + "); the trace cannot measure that cost itself: bench/vllm_live.py compares profiled "
                 "and unprofiled steps")
    return notes


def _samples(cyc: Cycles, timing: Timing) -> dict:
    samples = {"cycle_ms": {k: [round(v, 5) for v in timing.cycle_ms[k]] for k in _order(timing.cycle_ms)},
               "cycle_total_ms": [round(v, 5) for v in timing.totals]}
    if not cyc.drafts:
        samples["accept_lengths"] = [1] * len(cyc.totals)
        samples["num_draft"] = [0] * len(cyc.totals)
    return samples


def _env(doc: dict) -> dict:
    env = {"engine": "vllm", "engine_version": doc.get("vllm_version"), "host": doc.get("host_name")}
    devs = [d for d in (doc.get("deviceProperties") or []) if isinstance(d, dict)]
    if devs:
        env["gpu"] = {"name": devs[0].get("name"), "count": len(devs)}
    return env


def trace_run(doc: dict, ev: TraceEvents, acct, path) -> dict:
    """{"config", "results", "samples", "warnings", "env"} of a trace's decode cycles; acct is the parser, whose
    line accounting counts what is left out. One clear error when no step is a decode step."""
    cyc = decode_cycles(ev, acct)
    if not cyc.totals:
        kinds = acct.line_report().get(STEPS, {})
        why = "; ".join(f"{v} {k}" for k, v in kinds.get("skipped", {}).items())
        raise SpecscopeError(f"{path}: no decode step to time among {kinds.get('read', 0)} step(s) ({why}): "
                             f"profile while requests are decoding")
    warnings: list[str] = []
    timing = phase_timing(cyc, ev, acct, warnings)
    res = _results(doc, ev, cyc, timing)
    if ev.ops:
        from specscope.ingest.trace_components import trace_components

        res["components"], unknown, note = trace_components(cyc, ev, doc.get("vllm_version"))
        if unknown:
            res["components_unclassified"] = unknown
        warnings += [note] if note else []
    steps_k = _draft_steps(cyc.drafts)
    if cyc.drafts:
        warnings += _speculative_notes(cyc, res, steps_k)
    warnings += _cycle_notes(doc, ev, cyc, res)
    config = {"engine": "vllm", "engine_version": doc.get("vllm_version"),
              "device": "cuda" if timing.gpu is not None or doc.get("deviceProperties") else "cpu",
              "steps": steps_k, "draft_tokens": (steps_k + 1) if steps_k else None,
              "batch": max(set(cyc.batch), key=cyc.batch.count), "world_size": _dist(doc).get("world_size")}
    return {"config": config, "results": res, "samples": _samples(cyc, timing), "warnings": warnings,
            "env": _env(doc)}
