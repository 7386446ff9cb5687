"""`specscope generate`: baseline or speculative decoding of one prompt, streamed."""

from __future__ import annotations

import click

from specscope.cli.common import SEED, TEMPERATURE, TOP_K, TOP_P, emit_json, read_stdin_text, setup_runtime


@click.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="Target: a Hugging Face checkpoint directory or a known name.")
@click.option("--prompt", required=True, help="Prompt text ('-' reads standard input).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=TEMPERATURE, default=0.0, show_default=True, help="0 = greedy; at most 2.")
@click.option("--top-p", type=TOP_P, default=1.0, show_default=True)
@click.option("--top-k", type=TOP_K, default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=SEED, default=None, help="0..2**63-1.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16", "auto"]), default="auto", show_default=True,
              help="auto = fp32 on CPU, bf16 on CUDA.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="auto", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch.")
@click.option("--draft", default=None, help="Drafter: EAGLE-3 directory or name, 'ngram', or a small HF model.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Draft depth (tree) / chain length.")
@click.option("--topk", type=click.IntRange(min=1), default=None, help="Tree branching; 1 = chain.")
@click.option("--draft-tokens", type=click.IntRange(min=2), default=None,
              help="Tokens verified per cycle (tree nodes + root).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
@click.option("--no-record", is_flag=True, help="Do not store this run in the registry.")
@click.option("--db", default=None, help="Registry database (default: SPECSCOPE_DB or the XDG data dir).")
def generate(model_name, prompt, chat, max_new_tokens, temperature, top_p, top_k, seed, dtype, device, threads,
             draft, steps, topk, draft_tokens, as_json, no_record, db):
    """Generate text from one prompt with baseline or speculative decoding."""
    from specscope.engine.session import GenerateRequest, run_generate

    if prompt == "-":
        prompt = read_stdin_text("--prompt -")
    dev = setup_runtime(threads, device)
    req = GenerateRequest(model=model_name, prompt=prompt, chat=chat, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, dtype=dtype,
                          device=str(dev), threads=threads, draft=draft, steps=steps, topk=topk,
                          draft_tokens=draft_tokens, record=not no_record, db=db)

    if as_json:
        res = run_generate(req)
        emit_json(res)
        return
    out = click.get_text_stream("stdout")

    def stream(text):
        out.write(text)
        out.flush()

    res = run_generate(req, on_text=stream)
    out.write("\n")
    for line in res.get("summary_lines", []):
        click.echo(line, err=True)
