"""`specscope demo`: the tour a newcomer sees first.

Loads the demo model (pulling it on first use) and its drafter (by default the shipped EAGLE-3 drafter with n-gram
copying in one tree, `demo_drafter()`), decodes a handful of MT-bench first turns twice each (speculative, then
plain greedy decoding), profiles both, stores one baseline and one speculative run (aggregated over the prompts,
per-prompt stats in the samples), measures a short verify-cost curve for the report, judges the speedup by the
report's noise-aware rule, works out the break-even for the measured costs, and writes the HTML report.

The CLI (`specscope.cli.demo`) only renders: everything here reports through a `DemoUI`.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from specscope import session   # session.load_target, decode.ASSETS looked up per call: tests stub them
from specscope.economics.breakeven import BreakevenInputs, breakeven, describe, inputs_from_runs
from specscope.economics.probe import decode_pairs, warm_up
from specscope.economics.verify_curve import measure_curve
from specscope.errors import SpecscopeError
from specscope.fileio import check_output_file, check_writable, write_atomic
from specscope.jsonio import dtype_name
from specscope.models.hub import KNOWN_MODELS, is_pulled, resolve_model
from specscope.models.loader import describe_dtype, parse_dtype
from specscope.profile import CycleProfiler
from specscope.prompts import PACKAGED, SPEC_BENCH_FILE, mt_bench_prompts, spec_bench_path, warn
from specscope.registry import (check_registry, drafting_config, machine_config, make_record, open_registry,
                                prompt_set_hash)
from specscope.registry.compare import compare_runs, speed_change
from specscope.registry.fingerprint import load_warning
from specscope.registry.metrics import RunMetrics
from specscope.report import write_report
from specscope.runtime.tokenizer import StreamDecoder
from specscope.speculative import decode
from specscope.speculative.decode import DEFAULT_DRAFTER, DraftOptions, DraftSpec

# Used only when the packaged Spec-Bench question file is missing (a broken install); said loudly.
FALLBACK_NAME = "built-in demo prompts (the packaged Spec-Bench file is missing)"
FALLBACK_PROMPTS = (
    "Write a short blog post about a weekend trip to the mountains, with two things to see and one to eat.",
    "You are a tour guide in Rome. Greet a group of visitors and describe the first stop of the day.",
    "Alice is taller than Bob, and Bob is taller than Carol. Who is the shortest? Explain your reasoning.",
    "Solve for x: 3x + 7 = 22. Show each step.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
)


def demo_drafter() -> str:
    """The drafter the demo uses without --draft: the shipped EAGLE-3 drafter and n-gram copying in one tree, the
    fastest lossless method on MT-bench (the demo's prompts) in bench/results/speculative.json (2026-12-01, AVX2
    host, all 80 first turns: 1.49x at τ 2.42, against n-gram 1.44x and EAGLE-3 alone 1.25x) and, priced (the
    default --draft-budget), in bench/results/speculative_priced.json (2026-12-02, a 2-core AVX-512 host where the
    unpriced hybrid lost to n-gram alone)."""
    return f"{DEFAULT_DRAFTER}+ngram"


@dataclass
class DemoOptions:
    model: str = "smollm2-135m"
    drafting: DraftOptions = field(default_factory=DraftOptions)   # draft None: demo_drafter()
    prompts: int = 4
    max_new_tokens: int = 112
    dtype: str = "auto"
    device: str = "cpu"
    out: str = "specscope-demo"
    db: str | None = None
    verify_curve: bool = True             # a short T(n) curve for the report (a few seconds)
    report: bool = True
    tags: list = field(default_factory=lambda: ["demo"])

    @property
    def draft_budget(self) -> str:
        return self.drafting.budget


class DemoUI:
    """What the demo tells its caller; the default says nothing. The CLI renders these with rich."""

    def stage(self, text: str) -> None: ...
    def note(self, text: str) -> None: ...
    def stream_start(self, prompt: dict, method: str) -> None: ...
    def stream(self, text: str) -> None: ...
    def stream_end(self) -> None: ...
    # done / total `unit`s of one long step (the remaining prompts, the verify curve's forwards), drawn as every
    # command's progress is (specscope.progress); info: what the last one was
    def progress_start(self, what: str, total: int, unit: str) -> None: ...
    def progress(self, done: int, info: str = "") -> None: ...
    def progress_end(self) -> None: ...


def pick_prompts(n: int) -> tuple[list[dict], str]:
    """The first `n` MT-bench first turns of the packaged Spec-Bench file, one category after another (writing,
    roleplay, reasoning, math, coding, ...). Returns (prompts, prompt set name). Without the file (a broken
    install) the built-in prompts stand in, with a warning on stderr and in the summary."""
    if n < 1:
        raise SpecscopeError(f"--num-prompts must be >= 1, got {n}")
    try:
        spec_bench_path()
    except SpecscopeError as e:
        warn(f"{e}; the demo falls back to {len(FALLBACK_PROMPTS)} built-in prompts, not MT-bench "
             f"(expected {PACKAGED / SPEC_BENCH_FILE})")
        rows = [{"question_id": None, "category": None, "prompt": p} for p in FALLBACK_PROMPTS]
        return (rows * (n // len(rows) + 1))[:n], FALLBACK_NAME
    return mt_bench_prompts(n)


def run_demo(opts: DemoOptions, ui: DemoUI | None = None) -> dict:
    """Run the whole demo; returns a JSON-ready summary (runs, numbers, break-even, report path)."""
    ui = ui or DemoUI()
    prompts, prompt_set, drafting, out_dir = _plan(opts)
    draft, spec_cfg = drafting.draft, drafting.shape
    dev = str(opts.device)
    t_start = time.perf_counter()
    dtype = dtype_name(parse_dtype(opts.dtype, dev))
    target, tok, path, drafter = _load(opts, drafting, ui)
    stop = session.stop_ids_for(target, tok)
    ids = [tok.encode(p["prompt"], chat=True) for p in prompts]
    if any(not x for x in ids):
        raise SpecscopeError("a demo prompt is empty after tokenisation")
    method = _method_name(draft, drafter)
    bprof, sprof = CycleProfiler(dev), CycleProfiler(dev)
    pairs, per_prompt, shown_text = _decode_all(target, drafter, tok, prompts, ids, stop, spec_cfg,
                                                opts.max_new_tokens, (bprof, sprof), method, ui)
    config = {**machine_config(path, dtype, dev), "model_name": opts.model,
              "sampling": {"temperature": 0.0, "greedy": True}, "max_new_tokens": opts.max_new_tokens, "chat": True,
              "prompt_set": prompt_set, "prompt_set_hash": _hash([p["prompt"] for p in prompts]),
              # the texts, so that `specscope tune --run` re-runs the same prompts
              "num_prompts": len(prompts), "prompts": [p["prompt"] for p in prompts], "source": "demo"}
    curve_rec = None
    if opts.verify_curve:
        ui.stage("measuring the verify-cost curve")
        curve_rec = _verify_curve(target, per_prompt, spec_cfg, config, ui)
    ui.stage("storing runs")
    brec, srec = _records(config, draft, drafter, spec_cfg, bprof, sprof, pairs, per_prompt, opts)
    brec, srec, curve_rec, db_path = _store(brec, srec, curve_rec, opts.db)
    result = {
        "model": str(path), "draft": draft, "method": method, "drafting": asdict(spec_cfg), "dtype": dtype,
        "dtype_why": describe_dtype(target),
        "device": dev, "threads": torch.get_num_threads(), "prompt_set": prompt_set, "prompts": len(prompts),
        "max_new_tokens": opts.max_new_tokens,
        "baseline": _side(brec), "speculative": _side(srec),
        "speedup": _ratio(srec["results"]["tok_per_s"], brec["results"]["tok_per_s"]),
        "speedup_judged": _judged(brec, srec),
        "speedup_end_to_end": _ratio(srec["results"]["e2e_tok_per_s"], brec["results"]["e2e_tok_per_s"]),
        "identical_outputs": sum(r["identical"] for r in per_prompt),
        "accepted_by_source": srec["results"].get("accepted_by_source"),
        "profile_lines": {"baseline": bprof.lines(), "speculative": sprof.lines(brec["results"]["tok_per_s"])},
        "breakeven": _breakeven(srec, brec), "shown": {"prompt": prompts[0]["prompt"], "text": shown_text},
        "runs": {"baseline": brec["id"], "speculative": srec["id"],
                 "verify_curve": curve_rec["id"] if curve_rec else None},
        "db": db_path, "report": None,
        "warnings": _warnings(prompt_set, brec),
    }
    if opts.report:
        ui.stage("writing the HTML report")
        linked = {brec["id"]: brec, **({curve_rec["id"]: curve_rec} if curve_rec else {})}
        report = write_report([brec, srec], out_dir / "report.html", linked=linked,
                              title=f"specscope demo: {Path(str(path)).name} + {draft}")
        result["report"] = str(report)
    result["seconds"] = round(time.perf_counter() - t_start, 2)
    summary_path = write_atomic(out_dir / "summary.json", json.dumps(result, indent=1, default=str), "--output",
                                make_parents=True)
    result["summary_json"] = str(summary_path)
    return result


def _plan(opts: DemoOptions):
    """What flags and files decide, before a model loads: (prompts, prompt set name, the drafting, output
    directory). The output files, the registry and the drafter's files are checked now rather than after minutes
    of decoding."""
    if opts.max_new_tokens < 2:
        raise SpecscopeError(f"--max-new-tokens must be >= 2, got {opts.max_new_tokens}")
    prompts, prompt_set = pick_prompts(opts.prompts)
    draft = opts.drafting.draft or demo_drafter()
    _check_shipped(draft)
    # no knobs: the drafter's own best measured shape (a shipped drafter declares it), else the defaults
    drafting = replace(opts.drafting, draft=draft).checked()
    out_dir = Path(opts.out).expanduser()
    check_writable(out_dir, "--output", is_dir=True)
    for name in ("report.html", "summary.json"):
        check_output_file(out_dir / name, "--output")
    check_registry(opts.db)
    return prompts, prompt_set, drafting, out_dir


def _load(opts: DemoOptions, drafting: DraftOptions, ui: DemoUI):
    """(target, tokenizer, model path, drafter), the target pulled first on a machine's first run."""
    if opts.model in KNOWN_MODELS and not is_pulled(opts.model):
        # first run on this machine: the pull draws its own progress bar, so no spinner meanwhile
        ui.note(f"pulling {opts.model} into the model cache (first run only)")
        resolve_model(opts.model)
    spec = session.decode_spec(opts.model, drafting, dtype=opts.dtype, device=str(opts.device),
                               max_new_tokens=opts.max_new_tokens)
    ui.stage(f"loading {opts.model}")
    target, tok, path = spec.load()
    ui.stage(f"loading drafter {drafting.draft}")
    return target, tok, path, spec.drafter(target, ui.note)


def _decode_all(target, drafter, tok, prompts, ids, stop, spec_cfg, max_new_tokens, profs, method, ui):
    """After a warm-up, the pairing over the prompts, each speculative then plain (profiled by profs = (plain,
    speculative)): the first streamed, the rest under a progress bar. Returns (the pairs, per-prompt stats, the
    streamed text)."""
    ui.stage("warming up")
    warm_up(target, drafter, ids[0], max_new_tokens, stop, spec_cfg)
    shown = []

    def stream(i):
        if i > 0:
            if i == 1:
                ui.progress_start(f"remaining prompts ({method}, then plain decoding)", len(prompts) - 1, "prompt")
            return None
        dec = StreamDecoder(tok)
        ui.stream_start(prompts[0], method)
        return lambda t: ui.stream(dec.push(t))

    def between(i, s):
        if i == 0:
            ui.stream_end()
            shown.append(tok.decode(s.token_ids))
            if len(prompts) > 1:
                ui.stage("plain decoding of the same prompt")

    def after(i, pair):
        if i > 0:
            ui.progress(i, prompts[i].get("category") or "")

    pairs = decode_pairs(target, drafter, ids, max_new_tokens, stop, spec_cfg, profs, spec_first=True,
                         streams=stream, between=between, after=after)
    if len(prompts) > 1:
        ui.progress_end()
    per_prompt = [_prompt_stats(p, pid, pair.baseline, pair.speculative) for p, pid, pair in zip(prompts, ids, pairs)]
    return pairs, per_prompt, shown[0]


def _store(brec: dict, srec: dict, curve_rec: dict | None, db) -> tuple[dict, dict, dict | None, str]:
    """The runs into the registry, linked (speculative -> baseline, verify curve); read back as `specscope
    report` would read them. Returns (baseline, speculative, curve, registry path)."""
    with open_registry(db) as reg:
        db_path = str(reg.path)
        brec["id"] = reg.add_run(brec)
        srec["config"]["baseline_run"] = brec["id"]
        if curve_rec is not None:
            curve_rec["id"] = reg.add_run(curve_rec)
            srec["config"]["verify_curve_run"] = curve_rec["id"]
        srec["id"] = reg.add_run(srec)
        # the report reads the stored records, as `specscope report` would
        brec, srec = reg.get_run(brec["id"]), reg.get_run(srec["id"])
        curve_rec = reg.get_run(curve_rec["id"]) if curve_rec is not None else None
    return brec, srec, curve_rec, db_path


def _judged(brec: dict, srec: dict) -> dict | None:
    """The speedup as the report's headline judges it (registry.compare's speed_change on the same pair: ratio,
    interval, verdict), so the summary never calls faster what the report calls noise. None when not comparable."""
    try:
        return speed_change(compare_runs([brec, srec]), 1)
    except SpecscopeError:
        return None


def _warnings(prompt_set: str, brec: dict) -> list[str]:
    """What makes these numbers less than they seem: said in the summary, the JSON and the report."""
    out = []
    if prompt_set == FALLBACK_NAME:
        out.append("the packaged Spec-Bench file is missing: these are built-in prompts, not MT-bench "
                   "(reinstall specscope)")
    w = load_warning(brec.get("env"))
    if w:
        out.append(f"these runs were {w}; run the demo again on a quieter machine before trusting the speedup")
    return out


def _check_shipped(draft: str) -> None:
    draft = DraftSpec.parse(draft).model
    if draft == DEFAULT_DRAFTER and not (decode.ASSETS / draft / "config.json").exists():
        raise SpecscopeError(f"the shipped EAGLE-3 drafter {draft!r} is missing from this install "
                             f"({decode.ASSETS / draft}); reinstall specscope, train one with `specscope train`, "
                             f"or run the demo with n-gram drafting: specscope demo --draft ngram")


def _method_name(draft: str, drafter) -> str:
    spec = DraftSpec.parse(draft)
    kind = str(getattr(drafter, "kind", "") or "")
    if spec.ngram_only:
        return "n-gram, priced" if getattr(drafter, "prices", None) is not None else "n-gram"
    name = "EAGLE-3" if "eagle" in kind.lower() or "eagle" in spec.model.lower() else "draft model"
    name = f"{name} + n-gram" if spec.hybrid else name
    return f"{name}, priced" if getattr(drafter, "prices", None) is not None else name


def _prompt_stats(p: dict, ids: list[int], b, s) -> dict:
    def side(r):
        n = r.num_tokens - 1           # the first token comes from the prefill, which both sides pay alike
        return {"tokens": r.num_tokens, "prefill_s": round(r.prefill_s, 5), "decode_s": round(r.decode_s, 5),
                "decode_tok_per_s": round(n / r.decode_s, 4) if r.decode_s > 0 and n > 0 else None,
                "tok_per_s": round(r.tok_per_s, 4), "stop_reason": r.stop_reason}

    sp = side(s)
    sp.update(accept_length=round(s.stats.accept_length, 4), cycles=s.stats.cycles,
              **RunMetrics.measured(stats=[s.stats]).to_results())
    return {"question_id": p.get("question_id"), "category": p.get("category"), "prompt_tokens": len(ids),
            "baseline": side(b), "speculative": sp, "identical": b.token_ids == s.token_ids}


def _records(config, draft, drafter, spec_cfg, bprof, sprof, pairs, per_prompt, opts) -> tuple[dict, dict]:
    def totals(side):
        toks = sum(r[side]["tokens"] for r in per_prompt)
        secs = sum(r[side]["prefill_s"] + r[side]["decode_s"] for r in per_prompt)
        return {"e2e_tok_per_s": round(toks / secs, 4) if secs > 0 else None, "total_tokens": toks,
                "total_seconds": round(secs, 4),
                "prefill_ms_mean": round(1e3 * sum(r[side]["prefill_s"] for r in per_prompt) / len(per_prompt), 3)}

    def flat(side):
        return [{"question_id": r["question_id"], "category": r["category"], "prompt_tokens": r["prompt_tokens"],
                 **r[side]} for r in per_prompt]

    n_prompts = f"{len(per_prompt)} prompt{'s' if len(per_prompt) != 1 else ''}"
    brec = make_record("baseline", f"demo baseline ({n_prompts})",
                       config={**config, "draft": None, **drafting_config(), "engine": "baseline"},
                       profiler=bprof, results=totals("baseline"), samples={"per_prompt": flat("baseline")},
                       tags=opts.tags)
    env = brec["env"]
    bres = brec["results"]
    # acceptance by (depth, sibling rank), a hybrid's cycles: `specscope tune --run` predicts other shapes from them
    metrics = RunMetrics.measured(sprof, [p.speculative.stats for p in pairs])
    metrics.update({**totals("speculative"),
                    "baseline_decode_ms_per_token": bres.get("decode_ms_per_token"),
                    "baseline": {"decode_ms_per_token": bres.get("decode_ms_per_token"),
                                 "tok_per_s": bres.get("tok_per_s")},
                    "identical_outputs": sum(r["identical"] for r in per_prompt), "prompts": len(per_prompt),
                    "mean_context": sum(r["prompt_tokens"] + r["speculative"]["tokens"] / 2 for r in per_prompt)
                    / len(per_prompt)})
    name = (f"demo {draft} s{spec_cfg.steps} k{spec_cfg.topk} n{spec_cfg.draft_tokens}"
            + (f" g{spec_cfg.ngram_tokens}" if spec_cfg.ngram_tokens else "") + f" ({n_prompts})")
    srec = make_record("speculative", name,
                       config={**config, "draft": _draft_ref(draft), "drafter_kind": getattr(drafter, "kind", None),
                               "draft_budget": opts.draft_budget,
                               **drafting_config(spec_cfg), "engine": "speculative"},
                       profiler=sprof, metrics=metrics, samples={"per_prompt": flat("speculative")},
                       tags=opts.tags, env=env)
    srec["results"]["speedup"] = _ratio(srec["results"]["tok_per_s"], bres["tok_per_s"])
    return brec, srec


def _draft_ref(draft: str) -> str:
    """A shipped drafter's directory (so the registry hashes its weights), else what the user gave."""
    p = decode.ASSETS / draft
    return str(p) if not DraftSpec.parse(draft).ngram_only and p.exists() else draft


def _verify_curve(target, per_prompt, spec_cfg, config, ui: DemoUI) -> dict:
    """T(n) at about the demo's mean context for n = 1 .. 2·draft_tokens: enough to see whether verifying the
    drafted tokens costs about one decode step here. Its forwards are counted on the UI's progress."""
    ctx = int(sum(r["prompt_tokens"] + r["speculative"]["tokens"] / 2 for r in per_prompt) / len(per_prompt))
    ctx = max(16, min(ctx, target.config.max_position_embeddings - 64))
    top = max(8, 2 * spec_cfg.verify_tokens)
    tokens = sorted({n for n in (1, 2, 4, 8, 16, 32, 64) if n <= top}
                    | {spec_cfg.draft_tokens, spec_cfg.verify_tokens})
    tokens = [n for n in tokens if ctx + n <= target.config.max_position_embeddings]
    done = itertools.count(1)
    ui.progress_start("verify-cost curve", len(tokens) * (1 + 5), "forward")      # warmup 1 + repeats 5 per width
    try:
        res = measure_curve(target, [ctx], tokens, warmup=1, repeats=5, tick=lambda: ui.progress(next(done)))
    finally:
        ui.progress_end()
    results = {"points": res["points"], "fits": res["fits"],
               "decode_ms": {str(ctx): next(p["median_ms"] for p in res["points"] if p["tokens"] == tokens[0])}}
    return make_record("verify_curve", f"demo verify curve (context {ctx})",
                       config={**{k: config[k] for k in ("model", "model_name", "dtype", "device", "threads")},
                               "contexts": [ctx], "tokens": tokens, "warmup": 1, "repeats": 5, "source": "demo"},
                       results=results, samples={"verify_ms": res["samples"]}, tags=["demo"])


def _breakeven(srec: dict, brec: dict) -> dict:
    """`specscope breakeven --run S --baseline-run B` for the measured costs."""
    try:
        inp = inputs_from_runs(srec, brec, BreakevenInputs())
        res = breakeven(inp)
    except SpecscopeError as e:
        return {"error": str(e), "lines": [f"break-even: not computed ({e})"]}
    return {**res, "decode_ms": inp.decode_ms, "draft_ms": inp.draft_ms, "verify_ms": inp.verify_ms,
            "other_ms": inp.other_ms, "steps": inp.steps, "lines": describe(res, inp)}


def _side(rec: dict) -> dict:
    r = rec["results"]
    return {"run_id": rec.get("id"), "tok_per_s": r.get("tok_per_s"), "e2e_tok_per_s": r.get("e2e_tok_per_s"),
            "decode_ms_per_token": r.get("decode_ms_per_token"), "accept_length": r.get("accept_length"),
            "cycles": r.get("cycles"), "tokens": r.get("tokens")}


def _ratio(a, b):
    return round(a / b, 4) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _hash(prompts) -> str:
    return prompt_set_hash(prompts)
