"""`specscope demo`: plain vs speculative decoding (EAGLE-3 + n-gram by default) on the demo model, profiled, stored,
explained, reported."""

from __future__ import annotations

import sys

import click

from specscope.cli.common import (alias_option, db_option, draft_budget_option, draft_option, dtype_option, emit_json, json_option,
                                  output_option, setup_runtime, spec_options, stderr_console)


class _BarUI:
    """Long steps (the remaining prompts, the verify curve) under the progress every command uses
    (specscope.progress: stderr; a live bar with rate and time left on a terminal, a line every few seconds in a
    log; under --json a bar on a terminal only). Everything else the demo says is left out."""

    def __init__(self, json_mode: bool = False):
        self.json_mode = json_mode
        self._prog = None

    def stage(self, text): ...
    def note(self, text): ...
    def stream_start(self, prompt, method): ...
    def stream(self, text): ...
    def stream_end(self): ...

    def progress_start(self, what, total, unit):
        from specscope.progress import Progress

        self.progress_end()
        self._stop_status()
        self._prog = Progress(what, total, unit, json_mode=self.json_mode)

    def progress(self, done, info=""):
        if self._prog is not None:
            self._prog.update(done, info)

    def progress_end(self):
        if self._prog is not None:
            self._prog.close()
            self._prog = None

    def _stop_status(self): ...

    def close(self):
        self.progress_end()


class _RichUI(_BarUI):
    """Stages as a spinner, the first prompt's text streamed to stdout, the long steps as _BarUI draws them."""

    def __init__(self):
        super().__init__()
        self.err = stderr_console()
        self.out = sys.stdout
        self._status = None

    def _stop_status(self):
        if self._status is not None:
            self._status.stop()
            self._status = None

    def stage(self, text):
        self._stop_status()
        self._status = self.err.status(f"{text}…")
        self._status.start()

    def note(self, text):
        self._stop_status()
        self.err.print(text)

    def stream_start(self, prompt, method):
        self._stop_status()
        cat = f" ({prompt['category']})" if prompt.get("category") else ""
        self.err.print(f"[bold]Prompt{cat}:[/bold] {prompt['prompt']}")
        self.err.print(f"[bold]{method} output, streamed:[/bold]")

    def stream(self, text):
        self.out.write(text)
        self.out.flush()

    def stream_end(self):
        self.out.write("\n\n")
        self.out.flush()

    def close(self):
        self._stop_status()
        self.progress_end()


@click.command()
@alias_option("--num-prompts", "num_prompts", hidden=("--prompts",), type=click.IntRange(min=1, max=80), default=4,
              show_default=True, help="MT-bench first turns to decode (one per category in turn; packaged set).")
@output_option("Directory for report.html and summary.json.", default="specscope-demo", hidden=("--out",),
               file_okay=False, show_default=True)
@draft_option("Drafter: by default smollm2-135m-eagle3+ngram (the shipped EAGLE-3 drafter and n-gram copying in one "
              "tree); 'ngram', an EAGLE-3 directory or Hugging Face id, a small HF model, or DRAFTER+ngram.")
@click.option("--max-new-tokens", type=click.IntRange(2, 1 << 20), default=112, show_default=True,
              help="Most tokens to generate per prompt.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch.")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="Target: a known name (pulled on first use), a Hugging Face checkpoint directory or id (org/name).")
@draft_budget_option()
@spec_options("Draft depth (default: the drafter's declared shape, specscope_shape.json; else 5).")
@dtype_option()
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True)
@click.option("--no-verify-curve", is_flag=True, help="Skip the short verify-cost measurement.")
@db_option
@json_option("Print one JSON object (no streaming).")
def demo(num_prompts, output, draft, max_new_tokens, threads, model_name, draft_budget, steps, topk, draft_tokens,
         ngram_tokens,
         dtype, device, no_verify_curve, db, as_json):
    """The tour: plain vs speculative (EAGLE-3 + n-gram) decoding of a few MT-bench prompts on the demo model, with
    the profile, τ, the speedup and the break-even, both runs stored and an HTML report written."""
    from specscope.demo import DemoOptions, run_demo
    from specscope.speculative.decode import DraftOptions
    from specscope.fileio import refuse_overlap
    from specscope.registry.db import registry_path

    refuse_overlap(output, {"--model": model_name, "--draft": draft, "--db": registry_path(db)})
    dev = setup_runtime(threads, device, fit_load=True)
    opts = DemoOptions(model=model_name, prompts=num_prompts, max_new_tokens=max_new_tokens, dtype=dtype,
                       device=str(dev), out=output, db=db, verify_curve=not no_verify_curve,
                       drafting=DraftOptions(draft, steps, topk, draft_tokens, ngram_tokens,
                                             draft_budget or "priced"))
    ui = _BarUI(json_mode=True) if as_json else _RichUI()
    try:
        res = run_demo(opts, ui)
    finally:
        ui.close()
    if as_json:
        emit_json(res)
        return
    _print_summary(res)


def _print_speedup(con, res: dict) -> None:
    """The speedup with the verdict the report's headline gives it (registry.compare's rule: faster, slower or no
    significant change, with its interval), so the two never disagree; the bare ratio where it could not be judged."""
    from rich.markup import escape

    from specscope.registry.compare import speed_words

    sc = res.get("speedup_judged")
    if sc is not None:
        color = {"better": "green", "worse": "red"}.get(sc["verdict"], "yellow")
        con.print(f"[bold]Speedup: [{color}]{sc['ratio']:.2f}×[/{color}][/bold] "
                  f"{escape(speed_words(sc, ratio=False))}")
    else:
        sp = res["speedup"]
        con.print(f"[bold]Speedup: {sp:.2f}×[/bold] decode (not judged: no comparable samples)")
    con.print(f"  {res['speedup_end_to_end']:.2f}× end to end, prefill included; outputs identical to plain "
              f"decoding: {res['identical_outputs']}/{res['prompts']}")


def _print_summary(res: dict) -> None:
    from rich.console import Console

    con = Console(highlight=False, soft_wrap=True)
    b, s = res["baseline"], res["speculative"]
    d = res["drafting"]
    method = res["method"]
    con.rule(f"[bold]{res['prompts']} prompt(s) × up to {res['max_new_tokens']} new tokens, greedy, "
             f"{res['dtype']} on {res['device']} ({res['threads']} thread{'s' if res['threads'] != 1 else ''})")
    con.print(f"[dim]dtype: {res['dtype_why']}[/dim]")
    con.print(f"Plain decoding:        {b['tok_per_s']:7.2f} tok/s   {b['decode_ms_per_token']:6.2f} ms/token")
    shape = f"s{d['steps']} k{d['topk']} n{d['draft_tokens']}"
    if d.get("ngram_tokens"):
        shape += f" g{d['ngram_tokens']}"
    con.print(f"{method + ' (' + shape + '):':<22}"
              f"{s['tok_per_s']:7.2f} tok/s   {s['decode_ms_per_token']:6.2f} ms/token   τ = {s['accept_length']:.2f}")
    if res.get("accepted_by_source"):
        from specscope.profile.cycle import source_line

        con.print(source_line(res["accepted_by_source"]))
    _print_speedup(con, res)
    for w in res.get("warnings") or []:
        con.print(f"[bold yellow]warning:[/bold yellow] {w}")
    con.print("\n[bold]Speculative cycle profile[/bold]")
    for line in res["profile_lines"]["speculative"]:
        con.print("  " + line)
    con.print("\n[bold]Plain decoding profile[/bold]")
    for line in res["profile_lines"]["baseline"][:3]:
        con.print("  " + line)
    con.print("\n[bold]Break-even for these measured costs[/bold]")
    for line in res["breakeven"]["lines"]:
        con.print("  " + line)
    runs = res["runs"]
    con.print(f"\n[bold]Stored[/bold] in {res['db']}:")
    con.print(f"  baseline run     {runs['baseline']}")
    con.print(f"  speculative run  {runs['speculative']}")
    if runs.get("verify_curve"):
        con.print(f"  verify curve     {runs['verify_curve']}")
    if res.get("report"):
        con.print(f"[bold]Report:[/bold] {res['report']}")
    con.print(f"[bold]Summary:[/bold] {res['summary_json']}  ({res['seconds']:.0f} s in all)")
    bid, sid = runs["baseline"], runs["speculative"]
    con.print("\n[bold]Try next[/bold]")
    for cmd, why in ((f"specscope compare {bid} {sid}", "phase by phase, with noise-aware verdicts"),
                     (f"specscope breakeven --run {sid} --baseline-run {bid}", "the τ this setup needs"),
                     (f"specscope tune --run {sid}", "predict better steps / topk / draft tokens"),
                     (f"specscope report {bid} {sid} -o report.html", "the HTML report again, or for any runs")):
        con.print(f"  {cmd:<64} # {why}", soft_wrap=True)
