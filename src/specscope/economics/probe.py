"""Measurements the tuner needs from real decoding: a profiled baseline, one profiled speculative run that also
records acceptance by (depth, sibling rank), and the validation runs of predicted configurations."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specscope.errors import SpecscopeError
from specscope.generate import GenerationResult, generate, speculative_generate
from specscope.profile import CycleProfiler
from specscope.registry import drafting_config, make_record, store_record
from specscope.registry.metrics import RunMetrics
from specscope.speculative.decode import SpecConfig, check_chain


def encode_prompts(tokenizer, prompts: list[str], chat: bool = True) -> list[list[int]]:
    ids = [tokenizer.encode(p, chat=chat) for p in prompts]
    if not ids or any(not x for x in ids):
        raise SpecscopeError("a prompt is empty after tokenisation")
    return ids


def _decode(res) -> tuple[int, float]:
    """(decode tokens, decode seconds): the first token comes from the prefill, which both sides pay alike."""
    return res.num_tokens - 1, res.decode_s


@dataclass
class PromptPair:
    """One prompt decoded both ways: plain (None where only speculative decoding was asked for) and speculative."""
    baseline: GenerationResult | None
    speculative: GenerationResult


def warm_up(target, drafter, ids, max_new_tokens, stop_ids, cfg) -> None:
    """One short untimed pass of each path: first calls pay for allocator and kernel warm-up."""
    n = min(8, max_new_tokens)
    generate(target, ids, n, None, stop_ids)
    speculative_generate(target, drafter, ids, n, None, stop_ids, cfg)


def decode_pairs(target, drafter, prompt_ids, max_new_tokens, stop_ids, cfg, profs=(None, None), baseline=True,
                 spec_first=False, streams=None, between=None, after=None) -> list[PromptPair]:
    """The pairing of plain and speculative decoding over prompts (greedy), the demo's and the tuner's: the two
    alternate prompt by prompt, so that a machine whose load drifts (shared CPUs) slows both sides alike and their
    ratio stays meaningful. profs: (plain, speculative) profilers; spec_first: speculative first on each prompt
    (the demo streams it); streams(i): the speculative side's on_tokens for prompt i, or None; between(i, first
    result) after prompt i's first side, after(i, pair) after both."""
    out = []
    for i, ids in enumerate(prompt_ids):
        def plain():
            return generate(target, ids, max_new_tokens, None, stop_ids, profiler=profs[0]) if baseline else None

        def spec():
            return speculative_generate(target, drafter, ids, max_new_tokens, None, stop_ids, cfg,
                                        on_tokens=streams(i) if streams else None, profiler=profs[1])

        first = spec() if spec_first else plain()
        if between:
            between(i, first)
        pair = PromptPair(plain(), first) if spec_first else PromptPair(first, spec())
        out.append(pair)
        if after:
            after(i, pair)
    return out


def run_pair(target, drafter, prompt_ids, max_new_tokens, stop_ids, cfg, base_prof=None, spec_prof=None,
             baseline=True, tick=None) -> dict:
    """`decode_pairs` (plain first), summed: ms/token of each side and τ. tick(): after each prompt (both sides),
    for progress."""
    pairs = decode_pairs(target, drafter, prompt_ids, max_new_tokens, stop_ids, cfg, (base_prof, spec_prof),
                         baseline, after=(lambda i, p: tick()) if tick else None)
    bt = bs = st = ss = 0.0
    for p in pairs:
        if baseline:
            n, s = _decode(p.baseline)
            bt, bs = bt + n, bs + s
        n, s = _decode(p.speculative)
        st, ss = st + n, ss + s
    if st <= 0 or (baseline and bt <= 0):
        raise SpecscopeError("no decode tokens were produced; raise --max-new-tokens")
    stats = [p.speculative.stats for p in pairs]
    cycles = sum(x.cycles for x in stats)
    return {"baseline_ms_per_token": bs * 1e3 / bt if baseline else None, "ms_per_token": ss * 1e3 / st,
            "tokens": int(st), "accept_length": sum(sum(x.accept_lengths) for x in stats) / cycles if cycles else 0.0,
            "stats": stats}


def plain_decode_ms(target, prompt_ids, max_new_tokens, stop_ids, tick=None) -> float:
    """Plain decoding ms/token over the prompts (decode only; one short untimed pass first). tick(): after each
    prompt, for progress."""
    generate(target, prompt_ids[0], min(8, max_new_tokens), None, stop_ids)
    toks = secs = 0.0
    for ids in prompt_ids:
        n, s = _decode(generate(target, ids, max_new_tokens, None, stop_ids))
        toks, secs = toks + n, secs + s
        if tick:
            tick()
    if toks <= 0:
        raise SpecscopeError("no decode tokens were produced; raise --max-new-tokens")
    return secs * 1e3 / toks


def profile(target, drafter, prompt_ids, cfg, max_new_tokens, stop_ids, config: dict, db=None, record=True,
            rounds: int = 1, tick=None):
    """One profiled baseline and one profiled speculative run (with rank-wise acceptance) over the prompts,
    `rounds` times over; stores both. Returns (baseline_record, speculative_record), ids filled in when recorded.
    tick(): after each timed prompt (both sides), for progress."""
    check_chain(drafter, cfg.topk)
    dev = str(target.device)
    warm_up(target, drafter, prompt_ids[0], max_new_tokens, stop_ids, cfg)
    bprof, sprof = CycleProfiler(dev), CycleProfiler(dev)
    t0 = time.perf_counter()
    pair = run_pair(target, drafter, list(prompt_ids) * max(1, rounds), max_new_tokens, stop_ids, cfg, bprof, sprof,
                    tick=tick)
    brec = make_record("baseline", "tune baseline", config={**config, "draft": None, **drafting_config()},
                       profiler=bprof, results={"decode_ms_per_token": pair["baseline_ms_per_token"]})
    gen_per_prompt = pair["tokens"] / (len(prompt_ids) * max(1, rounds))
    mean_prompt = sum(len(p) for p in prompt_ids) / len(prompt_ids)
    # acceptance by (depth, sibling rank) and a hybrid's cycles: what `specscope tune --run` predicts from
    metrics = RunMetrics.measured(sprof, pair["stats"])
    metrics.update({"mean_context": mean_prompt + gen_per_prompt / 2, "spec_ms_per_token": pair["ms_per_token"],
                    "baseline_decode_ms_per_token": pair["baseline_ms_per_token"],
                    "wall_s": time.perf_counter() - t0})
    srec = make_record("speculative", f"tune profile s{cfg.steps} k{cfg.topk} n{cfg.draft_tokens}"
                                      + (f" g{cfg.ngram_tokens}" if cfg.ngram_tokens else ""),
                       config={**config, **drafting_config(cfg)}, profiler=sprof, metrics=metrics)
    if record:
        brec["id"] = store_record(brec, db)
        srec["config"]["baseline_run"] = brec["id"]
        srec["id"] = store_record(srec, db)
    return brec, srec


def validate(target, drafter, prompt_ids, configs, max_new_tokens, stop_ids, progress=None, tick=None):
    """Run each (steps, topk, draft_tokens) — or (steps, topk, draft_tokens, ngram_tokens) for a hybrid — for real,
    alternating with plain decoding prompt by prompt; measured speedup = plain ms/token ÷ speculative ms/token.
    progress(row) after each configuration; tick(knobs) after each of its prompts."""
    out = []
    for knobs in configs:
        cfg = SpecConfig(*knobs)
        cfg.validate()
        r = run_pair(target, drafter, prompt_ids, max_new_tokens, stop_ids, cfg,
                     tick=(lambda: tick(knobs)) if tick else None)
        row = {"steps": cfg.steps, "topk": cfg.topk, "draft_tokens": cfg.draft_tokens,
               **({"ngram_tokens": cfg.ngram_tokens} if len(knobs) > 3 else {}),
               "measured": r["baseline_ms_per_token"] / r["ms_per_token"], "measured_tau": r["accept_length"],
               "ms_per_token": r["ms_per_token"], "baseline_ms_per_token": r["baseline_ms_per_token"]}
        out.append(row)
        if progress:
            progress(row)
    return out
