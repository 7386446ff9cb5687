"""Measurements the tuner needs from real decoding: a profiled baseline, one profiled speculative run that also
records acceptance by (depth, sibling rank), and the validation runs of predicted configurations."""

from __future__ import annotations

import time

from specscope.errors import SpecscopeError
from specscope.generate import generate, speculative_generate
from specscope.profile import CycleProfiler
from specscope.registry import drafting_config, make_record, store_record
from specscope.speculative.acceptance import RankCounts, SourceCounts
from specscope.speculative.decode import SpecConfig, check_chain


def encode_prompts(tokenizer, prompts: list[str], chat: bool = True) -> list[list[int]]:
    ids = [tokenizer.encode(p, chat=chat) for p in prompts]
    if not ids or any(not x for x in ids):
        raise SpecscopeError("a prompt is empty after tokenisation")
    return ids


def _decode(res) -> tuple[int, float]:
    """(decode tokens, decode seconds): the first token comes from the prefill, which both sides pay alike."""
    return res.num_tokens - 1, res.decode_s


def run_pair(target, drafter, prompt_ids, max_new_tokens, stop_ids, cfg, base_prof=None, spec_prof=None,
             baseline=True, tick=None) -> dict:
    """Plain and speculative decoding alternated prompt by prompt, so that a machine whose load drifts (shared
    CPUs) slows both sides alike and their ratio stays meaningful. Returns ms/token of each side and τ.
    tick(): after each prompt (both sides), for progress."""
    bt = bs = st = ss = 0.0
    acc = cycles = 0
    stats = []
    for ids in prompt_ids:
        if baseline:
            n, s = _decode(generate(target, ids, max_new_tokens, None, stop_ids, profiler=base_prof))
            bt, bs = bt + n, bs + s
        r = speculative_generate(target, drafter, ids, max_new_tokens, None, stop_ids, cfg, profiler=spec_prof)
        n, s = _decode(r)
        st, ss = st + n, ss + s
        acc += sum(r.stats.accept_lengths)
        cycles += r.stats.cycles
        stats.append(r.stats)
        if tick:
            tick()
    if st <= 0 or (baseline and bt <= 0):
        raise SpecscopeError("no decode tokens were produced; raise --max-new-tokens")
    return {"baseline_ms_per_token": bs * 1e3 / bt if baseline else None, "ms_per_token": ss * 1e3 / st,
            "tokens": int(st), "accept_length": acc / cycles if cycles else 0.0, "stats": stats}


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
    # one untimed pass warms caches and the allocator for both paths
    run_pair(target, drafter, prompt_ids[:1], min(8, max_new_tokens), stop_ids, cfg)
    bprof, sprof = CycleProfiler(dev), CycleProfiler(dev)
    t0 = time.perf_counter()
    pair = run_pair(target, drafter, list(prompt_ids) * max(1, rounds), max_new_tokens, stop_ids, cfg, bprof, sprof,
                    tick=tick)
    stats = pair["stats"]
    n_cycles = sum(x.cycles for x in stats)
    brec = make_record("baseline", "tune baseline", config={**config, "draft": None, **drafting_config()},
                       profiler=bprof, results={"decode_ms_per_token": pair["baseline_ms_per_token"]})
    gen_per_prompt = pair["tokens"] / (len(prompt_ids) * max(1, rounds))
    mean_prompt = sum(len(p) for p in prompt_ids) / len(prompt_ids)
    hybrid = {"hybrid_cycles": SourceCounts.merge([x.hybrid_cycles for x in stats])} \
        if cfg.ngram_tokens else {}
    srec = make_record("speculative", f"tune profile s{cfg.steps} k{cfg.topk} n{cfg.draft_tokens}"
                                      + (f" g{cfg.ngram_tokens}" if cfg.ngram_tokens else ""),
                       config={**config, **drafting_config(cfg)},
                       profiler=sprof,
                       results={"acceptance_by_depth_rank": RankCounts.merge([x.acceptance_by_depth_rank
                                                                             for x in stats]),
                                "verify_tokens_mean": sum(x.verify_tokens_mean * x.cycles for x in stats
                                                          if x.cycles) / max(1, n_cycles),
                                **hybrid,
                                "mean_context": mean_prompt + gen_per_prompt / 2,
                                "spec_ms_per_token": pair["ms_per_token"],
                                "baseline_decode_ms_per_token": pair["baseline_ms_per_token"],
                                "wall_s": time.perf_counter() - t0})
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
