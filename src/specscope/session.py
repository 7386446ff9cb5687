"""The library entry point behind `specscope generate`: resolve models, run baseline or speculative decoding,
and return a JSON-ready result. The CLI and the server stay thin over this."""

from __future__ import annotations

from dataclasses import dataclass, asdict, field
from functools import lru_cache

from specscope.errors import SpecscopeError
from specscope.generate import generate
from specscope.models import loader   # loader.load_model looked up per call: tests stub it
from specscope.models.hub import resolve_model
from specscope.models.loader import load_config, weight_files
from specscope.profile import CycleProfiler
from specscope.registry import (check_registry, drafting_config, machine_config, make_record, open_registry,
                                prompt_set_hash)
from specscope.registry.fingerprint import timing_warning
from specscope.runtime.sampling import SamplingParams
from specscope.runtime.tokenizer import StreamDecoder, Tokenizer, check_tokenizer_files
from specscope.speculative.decode import (DraftSpec, SpecConfig, build_drafter, check_chain, drafter_path,
                                         speculative_generate)
from specscope.speculative.formats import is_eagle3_config, parse_config, read_config


@dataclass
class GenerateRequest:
    model: str = "smollm2-135m"
    prompt: str = ""
    chat: bool = False
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    dtype: str = "auto"
    device: str = "cpu"
    threads: int | None = None
    draft: str | None = None
    draft_budget: str = "priced"
    steps: int | None = None
    topk: int | None = None
    draft_tokens: int | None = None
    ngram_tokens: int | None = None
    record: bool = True
    db: str | None = None
    extra: dict = field(default_factory=dict)

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)


@lru_cache(maxsize=4)
def load_target(model: str, dtype: str, device: str):
    """(model, tokenizer, path) for a name or directory; cached per process."""
    path = resolve_model(model)
    m = loader.load_model(path, dtype=dtype, device=device)
    return m, Tokenizer(path), path


def stop_ids_for(model, tokenizer) -> list[int]:
    ids = set(tokenizer.eos_ids) | set(model.config.eos_token_id)
    return sorted(ids)


def preflight(model: str, max_new_tokens: int | None = None, draft: str | None = None, steps=None, topk=None,
              draft_tokens=None, ngram_tokens=None):
    """Everything checkable from flags and files before the model loads (8-18 s for a real one): the directory,
    config.json, weight files, tokenizer, the drafting knobs, the drafter's config, and max_new_tokens against the
    context. Returns (path, ModelConfig, SpecConfig or None)."""
    path = resolve_model(model)
    cfg, _ = load_config(path)
    weight_files(path)
    check_tokenizer_files(path)
    ctx = cfg.max_position_embeddings
    if max_new_tokens is not None and max_new_tokens >= ctx:
        raise SpecscopeError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context "
                             f"of {ctx} tokens (max_position_embeddings in config.json); use at most {ctx - 1}")
    if draft is None:
        if any(v is not None for v in (steps, topk, draft_tokens, ngram_tokens)):
            raise SpecscopeError("--steps/--topk/--draft-tokens/--ngram-tokens need --draft")
        return path, cfg, None
    spec_cfg = SpecConfig.for_drafter(draft, steps, topk, draft_tokens, ngram_tokens)
    spec = DraftSpec.parse(draft)
    if spec.ngram_only:
        check_chain(spec, spec_cfg.topk, say_topk=True)
        return path, cfg, spec_cfg
    dpath = drafter_path(draft)
    raw = read_config(dpath)
    if is_eagle3_config(raw):
        parse_config(raw, cfg.num_hidden_layers)
    else:  # a small HF model as the drafter
        load_config(dpath)
        weight_files(dpath)
    return path, cfg, spec_cfg


DRAFT_BUDGETS = ("priced", "fixed")


def drafter_for(draft: str, target, budget: str = "priced", note=None):
    """build_drafter with the --draft-budget rule: "priced" (the default) prices every drafter's cycles with this
    host's verify cost by rows (economics/prices.py: measured once, cached) within its declared shape; "fixed"
    verifies the declared shape every cycle."""
    if budget not in DRAFT_BUDGETS:
        raise SpecscopeError(f"--draft-budget must be one of {', '.join(DRAFT_BUDGETS)}, got {budget!r}")
    prices = None
    if budget == "priced":
        from specscope.economics.prices import host_prices

        prices = host_prices(target, note)
    return build_drafter(draft, target, prices)


def run_generate(req: GenerateRequest, on_text=None) -> dict:
    # preflight already resolved the drafting shape (None without --draft): reuse it rather than resolve it twice
    _, _, spec_cfg = preflight(req.model, req.max_new_tokens, req.draft, req.steps, req.topk, req.draft_tokens,
                               req.ngram_tokens)
    if req.record:      # a registry that cannot take the run is refused now, not warned about after the work
        check_registry(req.db)
    sp = req.sampling()
    model, tok, path = load_target(req.model, req.dtype, req.device)
    prompt_ids = tok.encode(req.prompt, chat=req.chat)
    if not prompt_ids:
        raise SpecscopeError("the prompt is empty after tokenisation")
    dec = StreamDecoder(tok)
    on_tokens = (lambda ids: on_text(dec.push(ids))) if on_text else None
    stop = stop_ids_for(model, tok)
    prof = CycleProfiler(device=model.device)      # where the model really is ("auto" resolved)
    if req.draft is None:
        res = generate(model, prompt_ids, req.max_new_tokens, sp, stop, on_tokens=on_tokens, profiler=prof)
    else:
        drafter = drafter_for(req.draft, model, req.draft_budget)
        res = speculative_generate(model, drafter, prompt_ids, req.max_new_tokens, sp, stop, spec_cfg,
                                   on_tokens=on_tokens, profiler=prof)
    out = {
        "text": tok.decode(res.token_ids),
        "token_ids": res.token_ids,
        "num_tokens": res.num_tokens,
        "prompt_tokens": res.prompt_len,
        "seconds": round(res.seconds, 4),
        "prefill_seconds": round(res.prefill_s, 4),
        "tok_per_s": round(res.tok_per_s, 3),
        "stop_reason": res.stop_reason,
        "model": str(path),
        "dtype": req.dtype,
        "device": req.device,
        "sampling": sp.to_dict(),
    }
    lines = [f"{res.num_tokens} tokens in {res.seconds:.2f} s: {res.tok_per_s:.2f} tok/s "
             f"(prefill {res.prefill_s * 1e3:.0f} ms)"]
    if spec_cfg is not None:
        out.update({"draft": req.draft, "accept_length": round(res.stats.accept_length, 4),
                    "cycles": res.stats.cycles, "drafting": asdict(spec_cfg)})
    lines += prof.lines()           # per-phase ms/cycle, τ histogram, per-position acceptance
    out["profile"] = prof.summary()
    if req.record:
        _record_run(req, path, model, spec_cfg, res, prof, out, lines)
    out["load_warning"] = timing_warning()      # the tok/s above is a timing: say what load it ran under
    if out["load_warning"]:
        lines.append(out["load_warning"])
    out["summary_lines"] = lines
    out["_result"] = res
    return _public(out)


def _record_run(req: GenerateRequest, path, model, spec_cfg, res, prof, out: dict, lines: list[str]) -> None:
    """Store this run in the registry; a failure to store warns instead of losing the generation."""
    config = {**machine_config(path, loader.compute_dtype(model), model.device), "draft": req.draft,
              **drafting_config(spec_cfg),
              **({"draft_budget": req.draft_budget} if req.draft else {}),
              "sampling": out["sampling"], "max_new_tokens": req.max_new_tokens, "chat": req.chat,
              "prompt_set": "single prompt", "prompt_set_hash": prompt_set_hash([req.prompt]),
              "engine": "baseline" if spec_cfg is None else "speculative"}
    results = {"tok_per_s": out["tok_per_s"], "seconds": out["seconds"], "prefill_seconds": out["prefill_seconds"],
               "num_tokens": out["num_tokens"], "prompt_tokens": out["prompt_tokens"],
               "stop_reason": out["stop_reason"]}
    if spec_cfg is not None:    # so that `specscope tune --run` can predict other tree shapes from this run
        results.update(acceptance_by_depth_rank=res.stats.acceptance_by_depth_rank,
                       verify_tokens_mean=res.stats.verify_tokens_mean)
        if res.stats.hybrid:   # ... and other n-gram budgets of a hybrid
            results["hybrid_cycles"] = res.stats.hybrid_cycles
    try:
        rec = make_record("generate", name=req.extra.get("name", ""), config=config, profiler=prof,
                          results=results, tags=req.extra.get("tags", ()))
        with open_registry(req.db) as reg:
            out["run_id"] = reg.add_run(rec)
        lines.append(f"Run stored: {out['run_id']}")
    except SpecscopeError as e:
        out["run_id"] = None
        out["record_error"] = str(e)
        lines.append(f"warning: run not stored: {e} (use --no-record to skip)")


def _public(out: dict) -> dict:
    res = out.pop("_result")
    out.setdefault("internal", {})
    out["internal"] = {"step_ms": res.step_ms}
    return out
