"""Short torch-profiler windows inside the engine's worker: a few decode/verify steps every N seconds, split into
components (`profile/components.py`) per phase, and for a MoE target the experts each step's tokens touched.

Why windows, not always on: a profiler records every op and slows the steps it watches; a few steps every 30 s
(the default) keep the plugin's cost small (bench/plugin_windows.py measures it) while a serving run of minutes still
gathers dozens of profiled steps per bucket. Window steps stay in the phase timings (flagged `"win": 1` in the
JSONL) so acceptance is counted exactly as the engine counts it.

Each of a profiled step's phase scopes is recorded as a `specscope:s<step>:<phase>|<part>` annotation on the worker
thread, and stamped inside it, just around the phase timers, on the profiler's clock (the wall clock: kineto stamps
with it, checked to a few µs): a scope's components fill exactly the time its phase timer measured, not the
profiler's own ~10-30 µs per annotation. A step's ops are the ones inside its stamps on that thread (CPU), or the
kernels its scopes launched (CUDA, linked by correlation id, placed on the device's time line: under CUDA graphs
the graph's kernels are linked to the graph launch).

Settings (environment): SPECSCOPE_WINDOW_EVERY seconds between windows (default 30; 0 turns windows off),
SPECSCOPE_WINDOW_STEPS steps per window (default 4), SPECSCOPE_WINDOW_FIRST the step the first window opens at
(default 20: after warm-up).
"""

from __future__ import annotations

import os
import re
import time

from specscope.profile.components import Classifier, Scope, Span, step_components

ENV_EVERY, ENV_STEPS, ENV_FIRST = "SPECSCOPE_WINDOW_EVERY", "SPECSCOPE_WINDOW_STEPS", "SPECSCOPE_WINDOW_FIRST"
TAG = re.compile(r"^specscope:s(\d+):(\w+)\|(\w+)$")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaLaunchCooperativeKernel")


class Windows:
    """When to profile, the profiler, and each window's steps turned into components."""

    def __init__(self, classifier: Classifier, cuda: bool = False, every_s: float | None = None,
                 steps: int | None = None, first: int | None = None, experts=None):
        self.classifier, self.cuda, self.experts = classifier, cuda, experts
        self.every_s = _setting(ENV_EVERY, "30", float) if every_s is None else float(every_s)
        self.steps = max(1, _setting(ENV_STEPS, "4", int) if steps is None else int(steps))
        self.first = _setting(ENV_FIRST, "20", int) if first is None else int(first)
        self._prof = None
        self._in_window: list[dict] = []       # the open window's steps: {"i", "kind", "tokens", "measured"}
        self._next_at = None                   # monotonic time the next window may open
        self._step_tag = None                  # "specscope:s<i>:" while a window step runs
        self._step_i = -1
        self._stamps: list[tuple] = []         # (step, phase, part, start µs, end µs) of the open window's scopes
        self.unknown: dict[str, float] = {}    # op name -> µs no rule classified (all windows)
        self.paused = False                    # the engine's own profiler is on: one profiler at a time
        self.cost_ns = 0                       # host time spent opening, closing and splitting windows (all)
        self._warm = False                     # the profiler has been started once (its first start is slow)

    @property
    def enabled(self) -> bool:
        return self.every_s > 0

    def begin(self, i: int) -> bool:
        """A decode/verify step `i` starts: open a window when one is due; True while this step is profiled."""
        if not self.enabled:
            return False
        if self._prof is None:
            now = time.monotonic()
            if self.paused or i < self.first or (self._next_at is not None and now < self._next_at):
                return False
            if not self._open():
                return False
        self._step_tag, self._step_i = f"specscope:s{i}:", i
        if self.experts is not None:
            self.experts.begin()
        return True

    def scope(self, phase: str, part: str) -> "_Stamped":
        """The profiler annotation of one phase scope of the profiled step, stamped inside."""
        from torch.profiler import record_function

        return _Stamped(record_function(f"{self._step_tag}{phase}|{part}"), self._stamps, self._step_i, phase, part)

    def end(self, i: int, kind: str, tokens: int, measured: dict[str, float] | None):
        """The profiled step `i` ended; returns the window's steps (with components) when this closed the window,
        else None."""
        experts = self.experts.end() if self.experts is not None else None
        self._in_window.append({"i": i, "kind": kind, "tokens": int(tokens), "measured": measured or {},
                                **({"experts": experts} if experts else {})})
        self._step_tag = None
        if len(self._in_window) < self.steps:
            return None
        return self.close()

    def close(self):
        """Stop the profiler and split its steps; None when no window is open."""
        if self._prof is None:
            return None
        t0 = time.perf_counter_ns()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self._next_at = time.monotonic() + self.every_s
        steps, self._in_window = self._in_window, []
        stamps, self._stamps = self._stamps, []
        split = self.split(prof.profiler.kineto_results.events(), stamps)
        for s in steps:
            s["phases"], s["scopes"] = split.get(s["i"], ({}, {}))
        self.cost_ns += time.perf_counter_ns() - t0
        return [s for s in steps if s["phases"]]

    def _open(self) -> bool:
        """Start the profiler; False (and no window until the next is due) when another profiler is on: torch runs
        one at a time, and the engine's own (vLLM's /start_profile) must never fail because of ours."""
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        self._next_at = time.monotonic() + self.every_s
        if torch.autograd.profiler._is_profiler_enabled:
            return False
        t0 = time.perf_counter_ns()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        try:
            if not self._warm:
                self._warm = True
                _warm_up(acts)
            prof = profile(activities=acts, record_shapes=False, with_stack=False)
            prof.__enter__()
        except RuntimeError:
            return False
        self._prof = prof
        self.cost_ns += time.perf_counter_ns() - t0
        return True

    def split(self, events, stamps: list[tuple]) -> dict[int, dict]:
        """Step -> (phase -> component -> ms, phase -> scopes), from the kineto events of one window and the
        stamps of its scopes."""
        tid = next((e.start_thread_id() for e in events if e.is_user_annotation() and TAG.match(e.name())), None)
        if tid is None:
            return {}
        scopes: dict[int, list[Scope]] = {}
        for i, phase, part, a, b in stamps:
            scopes.setdefault(i, []).append(Scope(phase, part, a, b))
        counts = {i: _counts(sc) for i, sc in scopes.items()}
        spans = self._gpu_spans(events, scopes) if self.cuda else None
        if spans is not None:
            return {i: (c, counts[i]) for i, c in spans.items()}
        ops = [Span(e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3) for e in events
               if e.start_thread_id() == tid and not e.is_user_annotation() and e.device_type().name == "CPU"
               and e.duration_ns() > 0]
        return {i: (step_components(sc, ops, self.classifier, self.unknown), counts[i]) for i, sc in scopes.items()}

    def _gpu_spans(self, events, scopes: dict[int, list[Scope]]) -> dict[int, dict] | None:
        """CUDA: each scope's kernels (by their launch inside the scope), painted on the device time line from the
        scope's first kernel to its last; None when the window holds no kernels (a CPU step)."""
        launch_at = {e.correlation_id(): e.start_ns() / 1e3 for e in events
                     if e.name() in LAUNCHES and e.correlation_id()}
        kernels = [(launch_at.get(e.correlation_id()), Span(e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3))
                   for e in events if e.device_type().name == "CUDA" and e.duration_ns() > 0]
        kernels = [(t, k) for t, k in kernels if t is not None]
        if not kernels:
            return None
        out = {}
        for i, scs in scopes.items():
            dev_scopes, spans = [], []
            for sc in scs:
                mine = [k for t, k in kernels if sc.start <= t <= sc.end]
                if mine:
                    dev_scopes.append(Scope(sc.phase, sc.part, min(k.start for k in mine), max(k.end for k in mine)))
                    spans += mine
            out[i] = step_components(dev_scopes, spans, self.classifier, self.unknown)
        return out


def _setting(name: str, default: str, kind):
    """An environment setting as a number, or ValueError naming it and the fix (the plugin then turns windows off
    in one line instead of failing the engine's first step)."""
    raw = os.environ.get(name, default)
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value < 0:
        raise ValueError(f"{name}={raw!r} is not a {'whole ' if kind is int else ''}number >= 0 "
                         f"(default {default}); profiler windows off")
    return value


class _Stamped:
    """A profiler annotation with the wall-clock stamps of its inside (the profiler's clock) kept for the split."""

    __slots__ = ("rf", "out", "i", "phase", "part", "t0")

    def __init__(self, rf, out: list, i: int, phase: str, part: str):
        self.rf, self.out, self.i, self.phase, self.part = rf, out, i, phase, part

    def __enter__(self):
        self.rf.__enter__()
        self.t0 = time.time_ns()
        return self

    def __exit__(self, *exc):
        self.out.append((self.i, self.phase, self.part, self.t0 / 1e3, time.time_ns() / 1e3))
        return self.rf.__exit__(*exc)


def _warm_up(acts) -> None:
    """Start a profiler once and throw it away: the first of a process initialises its backend inside the steps it
    watches (ms on its first annotations and ops)."""
    import torch
    from torch.profiler import profile, record_function

    with profile(activities=acts, record_shapes=False, with_stack=False), record_function("specscope:warm-up"):
        torch.zeros(1).add_(1)


def _counts(scopes: list[Scope]) -> dict[str, int]:
    """Phase -> how many engine scopes it had: each scope's stamps sit a few µs outside its phase timers (two clock
    reads, the timers' own enter and leave), which the check against the timers allows per scope."""
    out: dict[str, int] = {}
    for sc in scopes:
        out[sc.phase] = out.get(sc.phase, 0) + 1
    return out


class ExpertCounter:
    """The distinct experts each MoE layer routed a profiled step's tokens to, counted from the router's own output
    (vLLM's `router.set_capture_fn` hook, called with each layer's top-k expert ids before any EPLB remapping)."""

    def __init__(self, routers: list, num_experts: int, expert_bytes: int):
        self.num_experts, self.expert_bytes = int(num_experts), int(expert_bytes)
        self._ids: dict[int, list] = {}
        self._on = False
        for layer, router in enumerate(routers):
            router.set_capture_fn(self._hook(layer, getattr(router, "capture_fn", None)))

    def _hook(self, layer: int, prev):
        def capture(topk_ids):
            if prev is not None:
                prev(topk_ids)          # vLLM's own routed-experts capture, when it is on
            if self._on:
                self._ids.setdefault(layer, []).append(topk_ids.detach().reshape(-1).clone())
        return capture

    def begin(self) -> None:
        self._ids, self._on = {}, True

    def end(self) -> dict | None:
        """{"distinct": mean distinct experts per layer, "of": experts, "bytes": expert weights read, "layers": n}."""
        import torch

        self._on = False
        if not self._ids:
            return None
        per_layer = [int(torch.unique(torch.cat(v)).numel()) for _, v in sorted(self._ids.items())]
        self._ids = {}
        return {"distinct": sum(per_layer) / len(per_layer), "of": self.num_experts,
                "bytes": sum(per_layer) * self.expert_bytes, "layers": len(per_layer), "per_layer": per_layer}


def moe_routers(model) -> tuple[list, int, int] | None:
    """(the routers of a vLLM model's MoE layers in layer order, experts per layer, bytes of one expert's weights on
    this rank) or None for a dense model. A MoE layer is a module with a `router` that takes a capture hook and a
    `moe_config` (vLLM 0.32's MoERunner); its experts' weights are its `w13_weight` / `w2_weight` parameters."""
    routers, n, nbytes = [], 0, 0
    for mod in model.modules():
        router, cfg = getattr(mod, "router", None), getattr(mod, "moe_config", None)
        if router is None or cfg is None or not hasattr(router, "set_capture_fn"):
            continue
        weights = [p for name, p in mod.named_parameters() if name.endswith(("w13_weight", "w2_weight"))]
        local = int(getattr(cfg, "num_local_experts", 0) or 0)
        routers.append(router)
        n = int(getattr(cfg, "num_experts", 0) or local)
        if weights and local:
            nbytes = sum(p.numel() * p.element_size() for p in weights) // local
    return (routers, n, nbytes) if routers else None
