"""The library entry point behind `specscope generate`: what a run decodes with, checked once (`DecodeSpec`, the
one place every command's target and drafter are resolved and every drafter is built), then baseline or
speculative decoding and a typed result (`GenerateReport`: its `to_json()` is what --json prints). The CLI, the
demo and the server stay thin over this."""

from __future__ import annotations

from dataclasses import dataclass, asdict, field
from functools import lru_cache
from pathlib import Path

from specscope import cpuload
from specscope.errors import SpecscopeError
from specscope.generate import GenerationResult, generate, speculative_generate
from specscope.models import loader   # loader.load_model looked up per call: tests stub it
from specscope.models.hub import resolve_model
from specscope.models.config import ModelConfig
from specscope.models.loader import load_config, weight_files
from specscope.profile import CycleProfiler
from specscope.registry import (check_registry, drafting_config, machine_config, make_record, open_registry,
                                prompt_set_hash)
from specscope.registry.fingerprint import timing_warning
from specscope.registry.metrics import RunMetrics
from specscope.runtime.sampling import SamplingParams
from specscope.runtime.tokenizer import StreamDecoder, Tokenizer, check_tokenizer_files
from specscope.speculative.decode import DraftOptions, SpecConfig


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
    drafting: DraftOptions = field(default_factory=DraftOptions)
    record: bool = True
    db: str | None = None
    name: str = ""                 # the stored run's name and tags (registry)
    tags: tuple[str, ...] = ()

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    @property
    def draft(self) -> str | None:
        return self.drafting.draft

    @property
    def draft_budget(self) -> str:
        return self.drafting.budget

    def decoding(self) -> "DecodeSpec":
        return decode_spec(self.model, self.drafting, dtype=self.dtype, device=self.device,
                           max_new_tokens=self.max_new_tokens)


@lru_cache(maxsize=4)
def load_target(model: str, dtype: str, device: str):
    """(model, tokenizer, path) for a name or directory; cached per process."""
    path = resolve_model(model)
    m = loader.load_model(path, dtype=dtype, device=device)
    return m, Tokenizer(path), path


def stop_ids_for(model, tokenizer) -> list[int]:
    ids = set(tokenizer.eos_ids) | set(model.config.eos_token_id)
    return sorted(ids)


@dataclass(frozen=True)
class DecodeSpec:
    """What a run decodes with, checked once before any model loads (8-18 s for a real one): the target (its
    directory and config), dtype, device, and the drafting, checked (None: plain decoding). `generate`, the demo,
    `serve` and `tune` each build theirs with `decode_spec`; every drafter they run comes from `drafter()`."""
    model: str
    path: Path
    config: ModelConfig
    dtype: str = "auto"
    device: str = "cpu"
    drafting: DraftOptions | None = None

    @property
    def shape(self) -> SpecConfig | None:
        return self.drafting.shape if self.drafting is not None else None

    def load(self):
        """(model, tokenizer, path), cached per process."""
        return load_target(self.model, self.dtype, self.device)

    def drafter(self, target, note=None):
        """The drafter, on the target's device and dtype (None for plain decoding). Budget "priced" prices every
        drafter's cycles with this host's verify cost by rows (economics/prices.py: measured once, cached) within
        its shape; "fixed" verifies the shape every cycle."""
        if self.drafting is None:
            return None
        prices = None
        if self.drafting.budget == "priced":
            from specscope.economics.prices import host_prices

            prices = host_prices(target, note)
        return self.drafting.build(target, prices)


def decode_spec(model: str, drafting: DraftOptions | None = None, *, dtype: str = "auto", device: str = "cpu",
                max_new_tokens: int | None = None) -> DecodeSpec:
    """Everything checkable from flags and files before the model loads: the drafting options (checked here unless
    the caller already did: `DraftOptions.checked()` carries its shape), the target's directory, config.json,
    weight files and tokenizer, max_new_tokens against its context, and the drafter's files against it."""
    if drafting is not None and drafting.shape is None:
        drafting = drafting.checked()
    path = resolve_model(model)
    cfg, _ = load_config(path)
    weight_files(path)
    check_tokenizer_files(path)
    ctx = cfg.max_position_embeddings
    if max_new_tokens is not None and max_new_tokens >= ctx:
        raise SpecscopeError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context "
                             f"of {ctx} tokens (max_position_embeddings in config.json); use at most {ctx - 1}")
    if drafting is not None:
        drafting.check_against(cfg)
    return DecodeSpec(model, path, cfg, dtype, device, drafting)


@dataclass
class GenerateReport:
    """What one `specscope generate` measured and said, typed; `to_json()` is what --json prints (its keys and their
    order unchanged since they were a dict)."""
    text: str
    result: GenerationResult               # ids, counts, timings, stop reason; a speculative run's SpecStats
    model: str                             # the target's directory
    dtype: str
    device: str
    sampling: SamplingParams
    profile: dict                          # CycleProfiler.summary()
    threads: cpuload.ThreadChoice | None = None   # how many CPU threads decoded and why, where a command chose
    draft: str | None = None               # the --draft value; None: plain decoding
    drafting: SpecConfig | None = None     # the cycle's shape
    recorded: bool = False                 # storing was asked for: run_id is stated (None where it failed)
    run_id: str | None = None
    record_error: str | None = None
    load_warning: str | None = None
    summary_lines: list[str] = field(default_factory=list)

    def figures(self) -> dict:
        """The run's counts and timings as printed and stored (rounded)."""
        res = self.result
        return {"num_tokens": res.num_tokens, "prompt_tokens": res.prompt_len, "seconds": round(res.seconds, 4),
                "prefill_seconds": round(res.prefill_s, 4), "tok_per_s": round(res.tok_per_s, 3),
                "stop_reason": res.stop_reason}

    def to_json(self) -> dict:
        res = self.result
        out = {"text": self.text, "token_ids": res.token_ids, **self.figures(), "model": self.model,
               "dtype": self.dtype, "device": self.device, "sampling": self.sampling.to_dict()}
        if self.threads is not None:
            out["threads"] = self.threads.to_dict()
        if self.drafting is not None:
            out.update({"draft": self.draft, "accept_length": round(res.stats.accept_length, 4),
                        "cycles": res.stats.cycles, "drafting": asdict(self.drafting)})
        out["profile"] = self.profile
        if self.recorded:
            out["run_id"] = self.run_id
            if self.record_error is not None:
                out["record_error"] = self.record_error
        out.update({"load_warning": self.load_warning, "summary_lines": self.summary_lines,
                    "internal": {"step_ms": res.step_ms}})
        return out


@dataclass
class GenerateOutcome:
    """One `specscope generate`: the decoding `result`, the typed `report` (`report.to_json()` is what --json
    prints: text, timings, drafting, profile, run id, and the summary lines) and `lines`, the summary for people."""
    result: GenerationResult
    report: GenerateReport
    lines: list[str]


def run_generate(req: GenerateRequest, on_text=None) -> GenerateOutcome:
    spec = req.decoding()
    spec_cfg = spec.shape
    if req.record:      # a registry that cannot take the run is refused now, not warned about after the work
        check_registry(req.db)
    sp = req.sampling()
    model, tok, path = spec.load()
    prompt_ids = tok.encode(req.prompt, chat=req.chat)
    if not prompt_ids:
        raise SpecscopeError("the prompt is empty after tokenisation")
    dec = StreamDecoder(tok)
    on_tokens = (lambda ids: on_text(dec.push(ids))) if on_text else None
    stop = stop_ids_for(model, tok)
    prof = CycleProfiler(device=model.device)      # where the model really is ("auto" resolved)
    if spec_cfg is None:
        res = generate(model, prompt_ids, req.max_new_tokens, sp, stop, on_tokens=on_tokens, profiler=prof)
    else:
        res = speculative_generate(model, spec.drafter(model), prompt_ids, req.max_new_tokens, sp, stop, spec_cfg,
                                   on_tokens=on_tokens, profiler=prof)
    lines = [f"{res.num_tokens} tokens in {res.seconds:.2f} s: {res.tok_per_s:.2f} tok/s "
             f"(prefill {res.prefill_s * 1e3:.0f} ms)"]
    lines += prof.lines()           # per-phase ms/cycle, τ histogram, per-position acceptance
    rep = GenerateReport(tok.decode(res.token_ids), res, str(path), req.dtype, req.device, sp, prof.summary(),
                         threads=_threads_used(model), draft=req.draft, drafting=spec_cfg, recorded=req.record,
                         summary_lines=lines)
    if req.record:
        _record_run(req, path, model, prof, rep)
    rep.load_warning = timing_warning()      # the tok/s above is a timing: say what load it ran under
    if rep.load_warning:
        lines.append(rep.load_warning)
    return GenerateOutcome(res, rep, lines)


def _threads_used(model) -> cpuload.ThreadChoice | None:
    """How many CPU threads decoded and why, where a decode command chose them and the choice is still in force (a
    library caller may have set others since); else None."""
    import torch

    choice = cpuload.thread_choice()
    if choice is None or model.device.type != "cpu" or choice.threads != torch.get_num_threads():
        return None
    return choice


def _record_run(req: GenerateRequest, path, model, prof, rep: GenerateReport) -> None:
    """Store this run in the registry; a failure to store warns instead of losing the generation."""
    spec_cfg = rep.drafting
    config = {**machine_config(path, loader.compute_dtype(model), model.device), "draft": req.draft,
              **drafting_config(spec_cfg),
              **({"draft_budget": req.draft_budget} if req.draft else {}),
              "sampling": rep.sampling.to_dict(), "max_new_tokens": req.max_new_tokens, "chat": req.chat,
              "prompt_set": "single prompt", "prompt_set_hash": prompt_set_hash([req.prompt]),
              "engine": "baseline" if spec_cfg is None else "speculative"}
    f = rep.figures()
    results = {k: f[k] for k in ("tok_per_s", "seconds", "prefill_seconds", "num_tokens", "prompt_tokens",
                                 "stop_reason")}
    try:
        rec = make_record("generate", name=req.name, config=config, profiler=prof, results=results, tags=req.tags,
                          metrics=RunMetrics.measured(prof, [rep.result.stats]))
        with open_registry(req.db) as reg:
            rep.run_id = reg.add_run(rec)
        rep.summary_lines.append(f"Run stored: {rep.run_id}")
    except SpecscopeError as e:
        rep.record_error = str(e)
        rep.summary_lines.append(f"warning: run not stored: {e} (use --no-record to skip)")
