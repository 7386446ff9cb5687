"""Runs as `specscope bench-serve` stores them against a drafting `specscope serve`: the server's /metrics text
before and after the level, read by the real parser (`ingest.prometheus.spec_delta`), the level summarized by
bench-serve's own `summarize`, the record made by `make_record` as `record_run` does. The numbers are those of
issue 52's served runs: a priced server that drafted in 4 of 501 steps (τ 2.196 over its few drafts, a draft phase
of 0.009 ms per step) and the same server drafting at every step."""

from __future__ import annotations

from specscope.benchserve.bench import summarize
from specscope.ingest.prometheus import parse_text, spec_delta
from specscope.registry import make_record

P = "specscope:"


def _metrics(steps: int, phase_ms: dict, drafts: int, per_pos: list[int], draft_steps: int, gen: int) -> str:
    lines = [f"{P}spec_decode_num_drafts_total {drafts}",
             f"{P}spec_decode_num_draft_tokens_total {drafts * len(per_pos)}",
             f"{P}spec_decode_num_accepted_tokens_total {sum(per_pos)}",
             f"{P}generation_tokens_total {gen}", f"{P}prompt_tokens_total {40 * 8}",
             f'{P}spec_decode_steps_total{{mode="draft"}} {draft_steps}',
             f'{P}spec_decode_steps_total{{mode="plain"}} {steps - draft_steps}']
    lines += [f'{P}spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {n}' for i, n in enumerate(per_pos)]
    for ph, ms in phase_ms.items():
        lines += [f'{P}cycle_phase_seconds_count{{phase="{ph}"}} {steps}',
                  f'{P}cycle_phase_seconds_sum{{phase="{ph}"}} {ms * steps / 1e3}']
    return "\n".join(lines) + "\n"


def served_run(name: str, *, steps: int, draft_steps: int, draft_ms: float, verify_ms: float, drafts: int,
               per_pos: list[int], tok_s: float, draft: str | None = None, env: dict | None = None) -> dict:
    """One bench_serve record at one concurrency level; per_pos: accepted tokens at each draft position."""
    phase_ms = {"draft": draft_ms, "verify": verify_ms, "accept": 0.21, "commit": 0.34, "other": 1.1}
    gen = steps + sum(per_pos)
    before = parse_text(_metrics(0, {p: 0.0 for p in phase_ms}, 0, [0] * len(per_pos), 0, 0))
    after = parse_text(_metrics(steps, phase_ms, drafts, per_pos, draft_steps, gen))
    level = {"max_concurrency": 1, "completed": 8, "failed": 0, "output_throughput": tok_s,
             "request_throughput": tok_s / 64, "server_metrics": spec_delta(before, after)}
    config = {"url": "http://127.0.0.1:8000", "backend": "openai-chat", "endpoint": "chat",
              "endpoint_path": "/v1/chat/completions", "model": "SmolLM2-135M-Instruct", "engine": "specscope",
              "prompt_set": "mt-bench", "num_prompts": 8, "max_tokens": 64, "max_concurrency": [1]}
    if draft:
        config["draft"] = draft
    rec = make_record("bench_serve", name, config=config, results=summarize({"levels": [level]}),
                      samples={"per_request": []}, env=env)
    rec["config"].pop("model_hash", None)
    return rec


def priced_and_always(env: dict | None = None) -> tuple[dict, dict]:
    """The priced server (drafted in 4 of 501 steps) and the same server drafting at every step."""
    priced = served_run("serve priced", steps=501, draft_steps=4, draft_ms=0.009, verify_ms=71.5, drafts=46,
                        per_pos=[30, 12, 6, 3, 2, 1, 1], tok_s=37.35, env=env)
    always = served_run("serve always", steps=420, draft_steps=420, draft_ms=14.02, verify_ms=58.0, drafts=420,
                        per_pos=[180, 80, 30, 10, 3, 1, 0], tok_s=31.2, env=env)
    return priced, always
