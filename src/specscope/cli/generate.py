"""`specscope generate`: baseline or speculative decoding of one prompt, streamed."""

from __future__ import annotations

import sys

import click

from specscope.cli.checks import THREADS
from specscope.cli.common import (SEED, TEMPERATURE, TOP_K, TOP_P, db_option, device_option, draft_budget_option, draft_option,
                                  dtype_option, emit_json, json_option, read_stdin_text, setup_runtime, spec_options)
from specscope.errors import SpecscopeError


@click.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="Target: a Hugging Face checkpoint directory, a Hugging Face id (org/name[@revision]) or a "
                   "known name.")
@click.option("--prompt", required=True, help="Prompt text ('-' reads standard input).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="Most tokens to generate (HF max_new_tokens; the API's max_tokens).")
@click.option("--temperature", type=TEMPERATURE, default=0.0, show_default=True, help="0 = greedy; at most 2.")
@click.option("--top-p", type=TOP_P, default=1.0, show_default=True, help="Nucleus sampling mass, in (0, 1].")
@click.option("--top-k", type=TOP_K, default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=SEED, default=None, help="0..2**63-1.")
@dtype_option()
@device_option()
@click.option("--threads", type=THREADS, default=None, help="CPU threads for torch.")
@draft_option()
@draft_budget_option()
@spec_options()
@json_option("Print one JSON object (with run_id) instead of streaming.")
@click.option("--no-record", is_flag=True, help="Do not store this run in the registry.")
@db_option
def generate(model_name, prompt, chat, max_new_tokens, temperature, top_p, top_k, seed, dtype, device, threads,
             draft, draft_budget, steps, topk, draft_tokens, ngram_tokens, as_json, no_record, db):
    """Generate text from one prompt with baseline or speculative decoding."""
    from specscope.session import GenerateRequest, run_generate
    from specscope.speculative.decode import DraftOptions

    if draft is None and draft_budget is not None:
        raise SpecscopeError(f"--draft-budget {draft_budget} budgets a drafter's cycles, but no --draft is given; add "
                             f"--draft (e.g. ngram or smollm2-135m-eagle3) or drop --draft-budget")
    if prompt == "-":
        prompt = read_stdin_text("--prompt -")
    dev = setup_runtime(threads, device, fit_load=True)
    req = GenerateRequest(model=model_name, prompt=prompt, chat=chat, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, dtype=dtype,
                          device=str(dev), threads=threads, record=not no_record, db=db,
                          drafting=DraftOptions(draft, steps, topk, draft_tokens, ngram_tokens,
                                                draft_budget or "priced"))

    if as_json:
        emit_json(run_generate(req).report.to_json())
        return
    out = sys.stdout

    def stream(text):
        out.write(text)
        out.flush()

    res = run_generate(req, on_text=stream)
    out.write("\n")
    for line in res.lines:
        click.echo(line, err=True)
