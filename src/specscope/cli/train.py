"""`specscope train` (data -> vocab -> train, each resumable) and `specscope export`."""

from __future__ import annotations

from pathlib import Path

import click

from specscope.cli.common import (alias_option, device_option, dtype_option, emit_json, json_option, output_option,
                                  setup_runtime)
from specscope.errors import SpecscopeError

STAGES = ("data", "vocab", "train")


def _stages(value: str) -> list[str]:
    got = [s.strip() for s in value.split(",") if s.strip()]
    bad = [s for s in got if s not in STAGES]
    if bad or not got:
        raise SpecscopeError(f"--stages takes a comma list of {', '.join(STAGES)}; got {value!r}")
    return got


@click.command()
@click.option("--workdir", required=True, type=click.Path(file_okay=False), help="Where data, checkpoints go.")
@alias_option("--model", "target_name", hidden=("--target",), default="smollm2-135m", show_default=True,
              help="Target model the drafter is for: a Hugging Face checkpoint directory or a known name.")
@click.option("--stages", default="data,vocab,train", show_default=True, help="Which stages to run (comma list).")
@click.option("--dataset", default=None, type=click.Path(dir_okay=False),
              help="Conversations JSONL (ShareGPT conversations/from/value or OpenAI messages/role/content).")
@click.option("--synth", type=click.IntRange(min=0), default=0, show_default=True,
              help="Without --dataset: synthesise this many conversations from the target (Magpie).")
@click.option("--regenerate", type=click.Choice(["none", "greedy", "sample"]), default="none", show_default=True,
              help="Replace the dataset's assistant turns with the target's own answers.")
@click.option("--synth-batch", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--user-tokens", type=click.IntRange(min=8), default=64, show_default=True)
@click.option("--response-tokens", type=click.IntRange(min=8), default=192, show_default=True)
@dtype_option("--gen-dtype", short=("fp32", "bf16", "fp16"), default="fp32",
              help="Target dtype for synthesis/regeneration (features are always captured in fp32).")
@click.option("--max-len", type=click.IntRange(min=8), default=1024, show_default=True)
@click.option("--draft-vocab", type=click.IntRange(min=1), default=8192, show_default=True)
@click.option("--ttt-steps", type=click.IntRange(min=1), default=7, show_default=True, help="K unrolled TTT steps.")
@alias_option("--max-train-steps", "total_steps", hidden=("--steps",), type=click.IntRange(min=1), default=1000,
              show_default=True, help="Optimizer steps (--steps elsewhere is the draft depth).")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Sequences per optimizer step (global).")
@click.option("--lr", type=float, default=3e-4, show_default=True)
@click.option("--warmup", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--grad-clip", type=float, default=0.5, show_default=True)
@click.option("--weight-decay", type=float, default=0.0, show_default=True)
@dtype_option(short=("fp32", "bf16"), default="fp32",
              help="Training compute dtype (bf16 = autocast, fp32 master weights); bfloat16 / float32 accepted.")
@click.option("--eval-every", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--ckpt-every", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--eval-fraction", type=click.FloatRange(0, 0.5), default=0.05, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--resume", is_flag=True, help="Continue from the work directory's latest checkpoint.")
@click.option("--init", "init_from", default=None, help="Fine-tune an existing drafter (either format).")
@click.option("--export-format", type=click.Choice(["sglang", "speculators"]), default="sglang", show_default=True)
@dtype_option("--export-dtype", short=("fp32", "bf16", "fp16"), default="bf16")
@output_option("Exported drafter directory (default WORKDIR/drafter).", hidden=("--out",), file_okay=False)
@device_option()
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch.")
@click.option("--no-progress", is_flag=True, help="No progress bars (logs only).")
@json_option("Print one JSON summary at the end.")
def train(workdir, target_name, stages, dataset, synth, regenerate, synth_batch, user_tokens, response_tokens,
          gen_dtype, max_len, draft_vocab, ttt_steps, total_steps, batch_size, lr, warmup, grad_clip, weight_decay,
          dtype, eval_every, ckpt_every, eval_fraction, seed, resume, init_from, export_format, export_dtype, output,
          device, threads, no_progress, as_json):
    """Train an EAGLE-3 drafter for a target: capture data, build the draft vocabulary, train with TTT.

    Multi-process: torchrun --nproc-per-node N -m specscope train ... --stages train (gloo on CPU, NCCL on GPU).
    """
    import torch

    from specscope.models.loader import DTYPES
    from specscope.speculative.eagle3 import DrafterConfig
    from specscope.train import pipeline
    from specscope.train.data import CapturedData
    from specscope.train.trainer import TrainConfig, dist_info, train as run_train

    dev = setup_runtime(threads, device)
    todo = _stages(stages)
    work = Path(workdir)
    rank, world = dist_info()
    say = (lambda m: click.echo(m, err=True)) if rank == 0 else (lambda m: None)
    if world > 1 and ("data" in todo or "vocab" in todo):
        raise SpecscopeError("run the data and vocab stages in one process, then torchrun with --stages train")
    target, tok, tpath = pipeline.load_target(target_name, dev, "fp32")
    tinfo = pipeline.target_info(target_name, tpath, target)
    init = pipeline.init_drafter(init_from, target) if init_from else None
    aux = list(init.aux_layers) if init is not None else DrafterConfig.default_aux_layers(
        target.config.num_hidden_layers)
    summary = {"workdir": str(work), "target": tinfo, "stages": todo}

    if "data" in todo:
        gen = pipeline.load_target(target_name, dev, gen_dtype)[0] if gen_dtype != "fp32" else target
        man = pipeline.data_stage(work, target, tok, tinfo, dataset=dataset, synth=synth, regenerate=regenerate,
                                  aux_layers=aux, synth_batch=synth_batch, user_tokens=user_tokens,
                                  response_tokens=response_tokens, max_len=max_len, seed=seed, gen_model=gen, log=say)
        summary["data"] = {k: man.get(k) for k in ("sequences", "tokens", "loss_tokens", "skipped")}
        del gen
    data = None
    if "vocab" in todo or "train" in todo:
        data = CapturedData(work / "data")
        if data.aux_layers != aux:
            raise SpecscopeError(f"the data in {work / 'data'} was captured at aux layers {data.aux_layers} but the "
                                 f"drafter reads {aux}; capture again into a new --workdir")
    if "vocab" in todo:
        if init is not None:
            say("--init: keeping the initial drafter's own draft vocabulary")
        else:
            summary["vocab"] = pipeline.vocab_stage(work, data, target.config.vocab_size, draft_vocab, log=say)
    if "train" in todo:
        if init is not None:
            drafter = init
        else:
            vf = work / "vocab.pt"
            if not vf.exists():
                raise SpecscopeError(f"{vf} does not exist; run the vocab stage first (--stages vocab,train)")
            v = torch.load(str(vf), weights_only=True)
            drafter = pipeline.fresh_drafter(target, v["d2t"], v["t2d"], aux, seed=seed)
        cfg = TrainConfig(ttt_steps=ttt_steps, lr=lr, weight_decay=weight_decay, warmup=warmup,
                          total_steps=total_steps, batch_size=batch_size, grad_clip=grad_clip, dtype=dtype, seed=seed,
                          eval_every=eval_every, ckpt_every=ckpt_every, eval_fraction=eval_fraction, max_len=max_len)
        last = run_train(drafter, target.embed_tokens.weight.detach(), target.lm_head.weight.detach(), data,
                         work / "train", cfg, dev, resume=resume, progress=not no_progress, log=say,
                         meta={"target": tinfo})
        summary["train"] = last
        if rank == 0:
            dest = Path(output) if output else work / "drafter"
            pipeline.export(work, dest, export_format, DTYPES[export_dtype], tinfo)
            summary["drafter"] = str(dest)
            say(f"drafter written to {dest} ({export_format}, {export_dtype})")
    if world > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    if as_json and rank == 0:
        emit_json(summary)


@click.command()
@click.argument("source", type=click.Path(exists=True))
@click.option("--format", "fmt", type=click.Choice(["sglang", "speculators"]), required=True,
              help="sglang: SGLang's EAGLE-3 layout; speculators: vLLM's (speculators) layout.")
@output_option("Directory to write.", hidden=("--out",), file_okay=False)
@dtype_option(short=("fp32", "bf16", "fp16", "keep"), default="keep",
              help="Weights dtype to write (keep = as stored); bfloat16 / float16 / float32 accepted.")
@click.option("--target", "target_name", default=None,
              help="Verifier to record in the speculators config (default: the one the checkpoint names).")
@json_option()
def export(source, fmt, output, dtype, target_name, as_json):
    """Write a drafter (training work directory, checkpoint file or drafter directory) in SGLang or speculators form."""
    from specscope.models.loader import DTYPES
    from specscope.speculative.formats import load_drafter
    from specscope.train.pipeline import export as do_export

    tinfo = {"name_or_path": target_name} if target_name else None
    if output is None:
        raise SpecscopeError("export needs -o/--output DIR (the directory to write)")
    path = do_export(source, output, fmt, None if dtype == "keep" else DTYPES[dtype], tinfo)
    d = load_drafter(path)      # proves the written directory loads
    info = {"out": str(path), "format": fmt, "draft_vocab_size": d.config.draft_vocab_size,
            "aux_layer_ids": list(d.aux_layers), "dtype": str(d.dtype).replace("torch.", "")}
    if as_json:
        emit_json(info)
    else:
        click.echo(f"wrote {fmt} drafter to {path} (draft vocab {info['draft_vocab_size']}, "
                   f"aux layers {info['aux_layer_ids']}, {info['dtype']})")
