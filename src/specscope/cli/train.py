"""`specscope train` (data -> vocab -> train, each resumable) and `specscope export`."""

from __future__ import annotations

from pathlib import Path

import click

from specscope.cli.common import (MAX_STEPS as MAX_DRAFT_STEPS, SEED, FiniteFloat, alias_option, check_writable,
                                  device_option, dtype_option, emit_json, json_option, output_option, setup_runtime)
from specscope.errors import SpecscopeError
from specscope.jsonio import dtype_name

STAGES = ("data", "vocab", "train", "select")
# upper bounds of the integer flags: far past any real run, short of what would hang or exhaust memory
MAX_COUNT, MAX_BATCH, MAX_TOKENS, MAX_VOCAB, MAX_STEPS = 10**8, 65_536, 1 << 20, 1 << 24, 10**9


def _stages(value: str) -> list[str]:
    got = [s.strip() for s in value.split(",") if s.strip()]
    bad = [s for s in got if s not in STAGES]
    if bad or not got:
        raise SpecscopeError(f"--stages takes a comma list of {', '.join(STAGES)}; got {value!r}")
    return got


@click.command()
@click.option("--workdir", required=True, type=click.Path(file_okay=False), help="Where data, checkpoints go.")
@alias_option("--model", "--target-model-path", "target_name", hidden=("--target",), default="smollm2-135m",
              show_default=True,
              help="Target model the drafter is for: a Hugging Face checkpoint directory, a Hugging Face id "
                   "(org/name[@revision]) or a known name.")
@click.option("--stages", default="data,vocab,train", show_default=True, help="Which stages to run (comma list).")
@click.option("--dataset", "--train-data-path", "dataset", default=None,
              help="Conversations (ShareGPT conversations/from/value, OpenAI messages/role/content, SpecForge "
                   "conversations/role/content): a JSONL, JSON or Parquet file, a directory of them, or a Hugging "
                   "Face dataset id (org/name[@revision]).")
@click.option("--dataset-split", default="train", show_default=True,
              help="Split of a dataset directory or hub id.")
@click.option("--dataset-config", default=None, help="Configuration (subset) of a hub dataset.")
@click.option("--dataset-streaming", is_flag=True,
              help="Stream a hub dataset instead of downloading it whole into the datasets cache.")
@click.option("--prompt-file", "prompt_files", multiple=True, type=click.Path(dir_okay=False),
              help="Real prompts (JSONL: prompt / question / instruction+input / turns / conversations), answered "
                   "by the target; repeatable. Prompts overlapping evaluation sets are dropped and counted.")
@click.option("--synth", type=click.IntRange(0, MAX_COUNT), default=0, show_default=True,
              help="Without --dataset: synthesise this many conversations from the target (Magpie).")
@click.option("--regenerate", type=click.Choice(["none", "greedy", "sample"]), default="none", show_default=True,
              help="Replace the dataset's assistant turns with the target's own answers (sample: temperature 0.8, "
                   "top_p 0.95; --prompt-file answers are greedy unless sample).")
@alias_option("--answers-from", "answers_from", hidden=("--server-address",), default=None, metavar="URL",
              help="Take the answers (to --prompt-file prompts, or the --dataset's new assistant turns) from a running "
                   "OpenAI-compatible server at URL (vLLM, SGLang, specscope serve: /v1/chat/completions, its chat "
                   "template), greedy unless --regenerate sample; cached in WORKDIR/endpoint_answers.jsonl, a rerun "
                   "asks only for what is missing. See below.")
@click.option("--capture", "capture", default=None, metavar="vllm|URL",
              help="Compute the data stage's hidden states in vLLM instead of specscope's own forward: vllm starts "
                   "one here (with this Python, --engine-args), URL uses one started with SPECSCOPE_CAPTURE=DIR "
                   "(--capture-dir DIR). Any architecture vLLM serves, with its parallelism; answers (--prompt-file, "
                   "--regenerate) come from that server too. See below.")
@click.option("--capture-dir", default=None, type=click.Path(file_okay=False),
              help="--capture URL: the directory the server's SPECSCOPE_CAPTURE names (default with --capture vllm: "
                   "WORKDIR/data/.incoming).")
@click.option("--engine-args", default=None, metavar="ARGS",
              help="--capture vllm: vLLM's flags, one string (e.g. \"--tensor-parallel-size 8 --dtype bfloat16\").")
@click.option("--served-model-name", default=None,
              help="--answers-from / --capture URL: the model id to ask for (default: the first of the server's "
                   "/v1/models; --capture: the one that is --model, else the only one, with a warning).")
@click.option("--api-key", envvar=["SPECSCOPE_API_KEY", "OPENAI_API_KEY"], default=None,
              help="--answers-from: Bearer key (env SPECSCOPE_API_KEY, else OPENAI_API_KEY).")
@alias_option("--max-concurrency", "concurrency", hidden=("--concurrency",), type=click.IntRange(1, 4096), default=8,
              show_default=True, help="--answers-from: requests in flight.")
@click.option("--timeout", "timeout_s", type=FiniteFloat(1, 86400), default=600.0, show_default=True,
              help="--answers-from: per-request timeout in seconds (a timeout, dropped connection, 429 or 5xx is "
                   "retried 3 times).")
@click.option("--synth-batch", type=click.IntRange(1, MAX_BATCH), default=16, show_default=True,
              help="Conversations synthesised per batched generation.")
@click.option("--user-temperature", type=FiniteFloat(0.0, 2.0), default=0.8, show_default=True,
              help="Sampling temperature of synthesised user turns.")
@click.option("--answer-batch", type=click.IntRange(1, MAX_BATCH), default=32, show_default=True,
              help="Prompts answered per batched generation.")
@click.option("--capture-batch", type=click.IntRange(1, MAX_BATCH), default=4, show_default=True,
              help="Sequences per capture forward (--capture: capture requests in flight).")
@click.option("--user-tokens", type=click.IntRange(8, MAX_TOKENS), default=64, show_default=True)
@alias_option("--response-tokens", "response_tokens", hidden=("--max-tokens",), type=click.IntRange(8, MAX_TOKENS),
              default=192, show_default=True, help="Most tokens per answer (max_tokens of --answers-from requests).")
@dtype_option("--gen-dtype", short=("fp32", "bf16", "fp16"), default="fp32",
              help="Target dtype for synthesis/regeneration (features are always captured in fp32).")
@click.option("--max-len", "--max-length", "max_len", type=click.IntRange(8, MAX_TOKENS), default=1024,
              show_default=True, help="Most tokens per training sequence.")
@click.option("--draft-vocab", type=click.IntRange(1, MAX_VOCAB), default=8192, show_default=True)
@click.option("--ttt-steps", "--ttt-length", "ttt_steps", type=click.IntRange(1, 64), default=7, show_default=True,
              help="K unrolled TTT steps.")
@alias_option("--max-train-steps", "total_steps", hidden=("--steps",), type=click.IntRange(1, MAX_STEPS),
              default=None, help="Optimizer steps (default 1000 without --num-epochs; with it, the fewer of the "
                                 "two). --steps elsewhere is the draft depth.")
@click.option("--num-epochs", type=FiniteFloat(min=0, min_open=True, max=10**6), default=None,
              help="Passes over the training split (fractions allowed); the cosine schedule spans them.")
@click.option("--batch-size", type=click.IntRange(1, MAX_BATCH), default=8, show_default=True,
              help="Sequences per optimizer step (global).")
@click.option("--lr", "--learning-rate", "lr", type=FiniteFloat(min=0, min_open=True), default=3e-4,
              show_default=True, help="Peak learning rate (AdamW).")
@click.option("--warmup", type=click.IntRange(1, MAX_STEPS), default=20, show_default=True)
@click.option("--grad-clip", type=FiniteFloat(min=0, min_open=True), default=0.5, show_default=True,
              help="Largest gradient norm.")
@click.option("--weight-decay", type=FiniteFloat(min=0), default=0.0, show_default=True)
@dtype_option(short=("fp32", "bf16"), default="fp32",
              help="Training compute dtype (bf16 = autocast, fp32 master weights); bfloat16 / float32 accepted.")
@click.option("--eval-every", type=click.IntRange(1, MAX_STEPS), default=100, show_default=True)
@click.option("--ckpt-every", type=click.IntRange(1, MAX_STEPS), default=100, show_default=True)
@click.option("--eval-fraction", type=FiniteFloat(0, 0.5), default=0.05, show_default=True)
@click.option("--max-minutes", type=FiniteFloat(0.1, 10**7), default=None,
              help="Stop training after this many minutes (checkpoint saved; --resume continues).")
@alias_option("--select-num-prompts", "select_prompts", hidden=("--select-prompts",), type=click.IntRange(1, 10_000),
              default=12, show_default=True, help="select stage: held-out training prompts each snapshot's τ is predicted on.")
@click.option("--select-steps", type=click.IntRange(1, 64), default=3, show_default=True,
              help="select stage: chain length used to rank snapshots by predicted decoding τ.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--resume", is_flag=True, help="Continue from the work directory's latest checkpoint.")
@click.option("--init", "init_from", default=None, help="Fine-tune an existing drafter (either format).")
@click.option("--export-format", type=click.Choice(["sglang", "speculators"]), default="sglang", show_default=True)
@dtype_option("--export-dtype", short=("fp32", "bf16", "fp16"), default="bf16")
@alias_option("-o", "--output", "--output-dir", "output", hidden=("--out",), type=click.Path(file_okay=False),
              help="Exported drafter directory (default WORKDIR/drafter).")
@click.option("--report-to", type=click.Choice(["none", "tensorboard", "wandb"]), default="none", show_default=True,
              help="Also log the training metrics to TensorBoard (WORKDIR/train/tensorboard) or Weights & Biases "
                   "(project $WANDB_PROJECT, default specscope); the library must be installed.")
@device_option()
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch.")
@click.option("--no-progress", is_flag=True, help="No progress bars (logs only).")
@json_option("Print one JSON summary at the end.")
def train(workdir, target_name, stages, dataset, dataset_split, dataset_config, dataset_streaming, prompt_files,
          synth, regenerate, answers_from, capture, capture_dir, engine_args, served_model_name, api_key, concurrency,
          timeout_s, synth_batch, user_temperature, answer_batch, capture_batch, user_tokens, response_tokens,
          gen_dtype, max_len, draft_vocab, ttt_steps, total_steps, num_epochs, batch_size, lr, warmup, grad_clip,
          weight_decay, dtype, eval_every, ckpt_every, eval_fraction, max_minutes, select_prompts, select_steps, seed,
          resume, init_from, export_format, export_dtype, output, report_to, device, threads, no_progress, as_json):
    """Train an EAGLE-3 drafter for a target: capture data, build the draft vocabulary, train with TTT.

    Multi-process: torchrun --nproc-per-node N -m specscope train ... --stages train (gloo on CPU, NCCL on GPU;
    process i of a node trains on cuda:i).

    Answers from your own deployment (--answers-from URL): the data stage asks a running vLLM / SGLang / specscope
    serve for the answers instead of decoding them here, as SpecForge's regenerate_train_data.py does. This is how to
    make data for a target too large or too slow to decode on this machine: the decoding (most of the data stage's
    time) runs on your deployment, with its parallelism. The hidden states are still computed here, by specscope,
    from the --model checkpoint (one fp32 forward pass per conversation), so --model must be the model the server
    serves and must fit this machine (4 bytes per parameter). A --dataset conversation is answered turn by turn, as
    SpecForge does: every user turn in order, with the server's own earlier answers as context. --synth
    conversations are still written by the local target. --prompt-file prompts overlapping evaluation sets are dropped
    before any request, as they are for the local target.

    Hidden states from your own vLLM (--capture vllm --engine-args "..." or --capture URL --capture-dir DIR): vLLM
    computes them, inside its workers (specscope's plugin), for the exact token ids of each conversation; specscope
    loads only the target's config and tokenizer, so the target can be anything vLLM serves (MoE, across GPUs).
    The server runs with --enforce-eager and without prefix caching. Then run --stages vocab,train as usual (it reads
    the embedding, final norm and LM head alone). docs/training.md: "Train a drafter for the model you serve".

    SpecForge's spellings work too: --target-model-path, --train-data-path, --num-epochs, --learning-rate,
    --max-length, --ttt-length, --output-dir, --report-to, --server-address, --max-tokens, --concurrency.
    """
    from specscope.train.pipeline import Answering
    from specscope.train.stages import AnswerServer, CaptureOptions, DataOptions, TrainJob, plan_stages, run_stages
    from specscope.train.trainer import TrainConfig, process_device

    cfg = TrainConfig(ttt_steps=ttt_steps, lr=lr, weight_decay=weight_decay, warmup=warmup, total_steps=total_steps,
                      num_epochs=num_epochs, batch_size=batch_size, grad_clip=grad_clip, dtype=dtype, seed=seed,
                      eval_every=eval_every, ckpt_every=ckpt_every, eval_fraction=eval_fraction, max_len=max_len,
                      max_minutes=max_minutes)
    data = DataOptions(dataset=dataset, dataset_split=dataset_split, dataset_config=dataset_config,
                       dataset_streaming=dataset_streaming, prompt_files=list(prompt_files),
                       answering=Answering(regenerate=regenerate, synth=synth, synth_batch=synth_batch,
                                           user_tokens=user_tokens, user_temperature=user_temperature,
                                           response_tokens=response_tokens, answer_batch=answer_batch),
                       capture_batch=capture_batch, gen_dtype=gen_dtype)
    job = TrainJob(workdir, target_name, _stages(stages), cfg, data, CaptureOptions(capture, capture_dir, engine_args),
                   AnswerServer(answers_from, served_model_name, api_key, concurrency, timeout_s),
                   draft_vocab=draft_vocab, init_from=init_from, resume=resume, report_to=report_to,
                   select_prompts=select_prompts, select_steps=select_steps, export_format=export_format,
                   export_dtype=export_dtype, output=output, progress=not no_progress)
    plan = plan_stages(job, echo=lambda m: click.echo(m, err=True))
    dev = process_device(setup_runtime(threads, device).type)       # under torchrun: cuda:LOCAL_RANK
    summary = run_stages(job, plan, dev)
    if as_json and summary is not None:                             # rank 0 alone
        emit_json(summary)


@click.command()
@click.argument("source")
@click.option("--format", "fmt", type=click.Choice(["sglang", "speculators"]), required=True,
              help="sglang: SGLang's EAGLE-3 layout; speculators: vLLM's (speculators) layout.")
@output_option("Directory to write.", hidden=("--out",), file_okay=False)
@dtype_option(short=("fp32", "bf16", "fp16", "keep"), default="keep",
              help="Weights dtype to write (keep = as stored); bfloat16 / float16 / float32 accepted.")
@alias_option("--model", "target_name", hidden=("--target",), default=None,
              help="The target (verifier): a Hugging Face directory, its config.json, a Hugging Face id (only its "
                   "config.json is fetched) or a known name. Checked against the drafter and recorded (default: the "
                   "target a shipped drafter declares, else the verifier the checkpoint names).")
@click.option("--verifier-name", default=None,
              help="Record this as verifier.name_or_path (e.g. the Hugging Face id of a local --model copy).")
@alias_option("--steps", "--num-speculative-tokens", "steps", hidden=("--speculative-tokens",),
              type=click.IntRange(1, MAX_DRAFT_STEPS), default=None,
              help="speculators: draft depth recorded as speculative_tokens (vLLM num_speculative_tokens; default: "
                   "the checkpoint's own, else 3).")
@json_option("Print what was written (path, format, aux ids, verifier, notes) as one JSON object.")
def export(source, fmt, output, dtype, target_name, verifier_name, steps, as_json):
    """Write a drafter (training work directory, checkpoint file, drafter directory, shipped drafter name or Hugging
    Face id) in SGLang or speculators form."""
    from specscope.fileio import refuse_overlap
    from specscope.models.hub import resolve_drafter
    from specscope.models.loader import DTYPES
    from specscope.speculative.eagle3_export import WRITES
    from specscope.speculative.formats import (TARGET_FILE, aux_conventions, declared_target, load_drafter,
                                               read_config, resolve_target)
    from specscope.train.pipeline import export as do_export

    if output is None:
        raise SpecscopeError("export needs -o/--output DIR (the directory to write)")
    if steps is not None and fmt != "speculators":
        raise SpecscopeError("--steps is recorded only by --format speculators (vLLM's num_speculative_tokens); "
                             "SGLang takes the depth at launch (--speculative-num-steps): drop --steps")
    check_writable(output, "--output", is_dir=True)
    source = resolve_drafter(source)
    # a shipped drafter names the target it was trained for, so it needs no --model (and no download)
    target = resolve_target(target_name, verifier_name) if target_name else declared_target(source, verifier_name)
    local = target_name and Path(target_name).expanduser().exists()     # as typed; else where a name resolved
    refuse_overlap(output, {"drafter": source, "--model": target_name if local else target and target.path},
                   writes=WRITES)
    tinfo = {"name_or_path": verifier_name} if verifier_name and not target else None
    notes = _export_notes(Path(source), fmt, target or tinfo)
    if target is not None and not target_name:
        done = "checked against and recorded as the verifier" if fmt == "speculators" else "checked against"
        notes.append(f"no --model: {done} {target.name_or_path}, the target {Path(source).name}/{TARGET_FILE} "
                     f"declares; --model names another")
    path = do_export(source, output, fmt, None if dtype == "keep" else DTYPES[dtype], tinfo, target=target,
                     speculative_tokens=steps)
    d = load_drafter(path, target)      # proves the written directory loads (and still fits the target)
    raw = read_config(path)
    info = {"out": str(path), "format": fmt, "draft_vocab_size": d.config.draft_vocab_size,
            "aux_layer_ids": aux_conventions(d.config), "dtype": dtype_name(d.dtype)}
    if fmt == "speculators":
        info["verifier"] = raw["speculators_config"]["verifier"]
        info["speculators_version"] = raw["speculators_version"]
    info["notes"] = notes
    if as_json:
        emit_json(info)
    else:
        aux = info["aux_layer_ids"]
        click.echo(f"wrote {fmt} drafter to {path} (draft vocab {info['draft_vocab_size']}, {info['dtype']}; aux "
                   f"layers: hidden-state indices {aux['hidden_state_index']} = SGLang output-of-layer ids "
                   f"{aux['sglang_output_of_layer']})")
        if "verifier" in info:
            click.echo(f"verifier: {info['verifier']['name_or_path']} ({', '.join(info['verifier']['architectures'])})")
        for n in notes:
            click.echo(f"note: {n}")


def _export_notes(source: Path, fmt: str, target) -> list[str]:
    """What the conversion changes that a user should know about (a drafter directory as the source)."""
    from specscope.speculative.formats import read_config

    if not (source.is_dir() and (source / "config.json").exists()):
        return []
    raw = read_config(source)
    notes = []
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if fmt == "sglang" and isinstance(ids, list) and len(ids) == 4:
        notes.append(f"the 4th aux id ({ids[3]}, the verifier-logits layer used in training) is not written: "
                     f"SGLang would read 4 ids as 4 fc inputs")
    old = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    new = target.name_or_path if hasattr(target, "name_or_path") else (target or {}).get("name_or_path")
    if fmt == "speculators" and old and new and old != new:
        notes.append(f"verifier {old!r} recorded in the source is replaced by {new!r}")
    return notes
