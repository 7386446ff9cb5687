"""`specscope check-drafter`: will this EAGLE-3 drafter work with this target (and this engine launch)?"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specscope.cli.common import MAX_STEPS, alias_option, device_option, emit_json, json_option

MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


@click.command("check-drafter")
@click.argument("drafter")
@alias_option("--model", "target_name", hidden=("--target",), required=True,
              help="The target: a Hugging Face directory, its config.json, a Hugging Face id (org/name[@revision]) "
                   "or a known name.")
@click.option("--engine-args", default=None,
              help="An SGLang / vLLM launch command line, or its server-args log line, to check against the drafter.")
@alias_option("--num-prompts", "num_prompts", hidden=("--prompts",), type=click.IntRange(min=1), default=3,
              show_default=True,
              help="Prompts (the packaged Spec-Bench questions) for coverage and acceptance.")
@click.option("--max-new-tokens", type=click.IntRange(min=4), default=48, show_default=True,
              help="Most tokens per prompt in the acceptance measurement.")
@click.option("--steps", "--speculative-num-steps", "--num-speculative-tokens", "steps",
              type=click.IntRange(1, MAX_STEPS),
              default=5, show_default=True,
              help="Draft depth (a chain) for the acceptance measurement. SGLang --speculative-num-steps; vLLM "
                   "num_speculative_tokens.")
@click.option("--no-run", is_flag=True, help="Static checks only; do not run the target.")
@click.option("--predict", is_flag=True,
              help="Predict the τ greedy decoding gets with chains of 1..--steps and the drafter's default tree: "
                   "decoding replayed on the target's greedy output, one target forward per prompt.")
@click.option("--features", type=click.Path(file_okay=False), default=None,
              help="Predict from the target's states captured in a training run's data directory (WORKDIR/data, "
                   "greedy answers) instead of running the target; implies --predict. With --served: the capture's "
                   "own prompts are served (each asking for what its answer verifies with chains up to --steps) and "
                   "predicted from its states, for a target this toolkit cannot run.")
@click.option("--served", metavar="URL", default=None,
              help="A running engine serving the target with this drafter (vLLM, or specscope serve): run the "
                   "prompts through it, read its spec-decode counters, set its τ against the prediction and name "
                   "the cause of a gap.")
@device_option(default="cpu")
@json_option("Print the checks, faults and acceptance as one JSON object.")
def check_drafter(drafter, target_name, engine_args, num_prompts, max_new_tokens, steps, no_run, predict, features,
                  served, device, as_json):
    """One report of everything that decides whether DRAFTER (a directory, shipped name or Hugging Face id) works
    with the target.
    Exit status 1 when it names a fault."""
    from specscope.cli.common import setup_runtime
    from specscope.errors import SpecscopeError
    from specscope.models.hub import parse_hub_id, resolve_drafter
    from specscope.check_drafter import check_drafter as run_check, default_prompts, size_problem
    from specscope.speculative.formats import resolve_target

    if not drafter.strip():
        raise SpecscopeError("DRAFTER is empty; pass a drafter directory, a shipped drafter name or a Hugging Face id")
    if features is not None and not (Path(features).expanduser() / "manifest.json").is_file():
        # before the acceptance run: a wrong directory is refused in a second, not after minutes of decoding
        raise SpecscopeError(f"--features {features}: no captured data there (no manifest.json); pass a training "
                             f"run's data directory, WORKDIR/data, written by `specscope train` or its --capture")
    path = resolve_drafter(drafter)
    dev = setup_runtime(None, device)
    facts = resolve_target(target_name)
    if not no_run and facts.path is not None and not any(facts.path.glob("*.safetensors")) \
            and not Path(target_name).expanduser().exists() and parse_hub_id(target_name) \
            and size_problem(facts) is None:
        facts = resolve_target(target_name, files="model")   # a hub target small enough to run: fetch its weights
    from specscope.progress import Progress

    # the acceptance measurement decodes every prompt (seconds to minutes): the progress every command shows
    report = run_check(path, facts, engine_args, run=not no_run,
                       prompts=None if no_run and not (predict or served) else default_prompts(num_prompts),
                       max_new_tokens=max_new_tokens, steps=steps, device=str(dev),
                       progress=lambda n: Progress("check-drafter acceptance", n, "prompt", json_mode=as_json),
                       predict=predict, features=features, served=served)
    d = report.to_dict()
    if as_json:
        emit_json(d)
    else:
        click.echo(f"drafter {path}  ->  target {facts.name_or_path} ({', '.join(facts.architectures) or '?'}, "
                   f"{facts.num_hidden_layers} layers, hidden {facts.hidden_size}, vocab {facts.vocab_size})")
        for c in d["checks"]:
            click.echo(f"  [{MARK[c['status']]}] {c['check']}: {c['detail']}")
        acc = d["acceptance"]
        if acc and acc.get("teacher_forced_tau") is not None:
            click.echo(f"  teacher-forced τ {acc['teacher_forced_tau']:.2f}   measured τ "
                       f"{acc['measured_tau']:.2f} (chain of {acc['steps']}, {acc['prompts']} prompts)")
        click.echo(f"{len(d['faults'])} fault(s)" if d["faults"] else "no faults")
    if d["faults"]:
        sys.exit(1)
