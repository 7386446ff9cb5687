"""The `specscope train` stages over one work directory, each resumable:

    WORKDIR/conversations.jsonl   synthesised (Magpie) or regenerated conversations
    WORKDIR/data/                 captured target features: manifest.json + safetensors shards
    WORKDIR/vocab.pt              d2t / t2d and the response-token coverage
    WORKDIR/train/                metrics.jsonl, checkpoints/ (model, optimizer, scheduler, RNG)
    WORKDIR/drafter/              the exported drafter (SGLang layout unless asked otherwise)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specscope.errors import SpecscopeError


def load_target(name: str, device, dtype="fp32"):
    from specscope.engine.tokenizer import Tokenizer
    from specscope.models import load_model
    from specscope.models.hub import resolve_model

    path = resolve_model(name)
    model = load_model(path, dtype, device)
    return model, Tokenizer(path), path


def target_info(name: str, path: Path, model) -> dict:
    return {"name_or_path": name, "path": str(path), "architectures": [model.config.architecture],
            "num_hidden_layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size,
            "vocab_size": model.config.vocab_size}


def data_stage(workdir: Path, model, tok, tinfo: dict, *, dataset: str | None = None, synth: int = 0,
               regenerate: str = "none", aux_layers: list[int], synth_batch: int = 16, user_tokens: int = 64,
               response_tokens: int = 192, max_len: int = 1024, seed: int = 0, gen_model=None, log=print) -> dict:
    from specscope.engine.sampling import SamplingParams
    from specscope.train.data import capture, read_conversations, regenerate as regen, synthesise

    workdir.mkdir(parents=True, exist_ok=True)
    gen_model = gen_model or model
    if dataset:
        convs, rep = read_conversations(dataset)
        log(rep.summary())
        if regenerate != "none":
            out = workdir / "conversations.jsonl"
            if out.exists():
                convs, _ = read_conversations(out)
                log(f"reusing {len(convs)} regenerated conversations in {out}")
            else:
                sp = SamplingParams(temperature=0.0 if regenerate == "greedy" else 0.8, top_p=0.95, seed=seed)
                convs = regen(gen_model, tok, convs, response_tokens, sp, seed=seed)
                tmp = out.with_suffix(".tmp")
                tmp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
                tmp.replace(out)
    elif synth > 0:
        out = workdir / "conversations.jsonl"
        have = synthesise(gen_model, tok, out, synth, batch=synth_batch, user_tokens=user_tokens,
                          response_tokens=response_tokens, seed=seed,
                          progress=lambda n: log(f"synthesised {n}/{synth} conversations"))
        convs, rep = read_conversations(out)
        convs = convs[:synth]
        log(f"{have} synthesised conversations in {out}")
    else:
        raise SpecscopeError("the data stage needs --dataset JSONL or --synth N (conversations to synthesise)")
    manifest = capture(model, tok, convs, workdir / "data", aux_layers, max_len=max_len, target_info=tinfo,
                       progress=lambda n: log(f"captured {n}/{len(convs)} conversations"))
    log(f"data: {manifest['sequences']} sequences, {manifest['tokens']} tokens "
        f"({manifest['loss_tokens']} assistant tokens) in {workdir / 'data'}")
    return manifest


def vocab_stage(workdir: Path, data, vocab_size: int, draft_vocab: int, log=print) -> dict:
    from specscope.train.vocab import build_vocab, coverage, token_counts

    counts = token_counts(data, vocab_size)
    d2t, t2d = build_vocab(counts, draft_vocab)
    cov = coverage(counts, t2d)
    torch.save({"d2t": d2t, "t2d": t2d, "coverage": cov, "draft_vocab_size": draft_vocab}, workdir / "vocab.pt")
    log(f"draft vocabulary: {draft_vocab} tokens cover {cov:.2%} of the {int(counts.sum())} response tokens")
    return {"coverage": cov, "draft_vocab_size": draft_vocab}


def fresh_drafter(target, d2t: torch.Tensor, t2d: torch.Tensor, aux_layers: list[int], seed: int = 0,
                  norm_before_residual: bool = False):
    """A new drafter shaped like one layer of the target (the EAGLE-3 recipe); lm_head and the final norm start as
    the target's (its rows for the draft vocabulary): a warm start for a head that predicts the same tokens."""
    from specscope.speculative.eagle3 import DrafterConfig, Eagle3Drafter

    tc = target.config
    cfg = DrafterConfig(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                        head_dim=tc.head_dim, vocab_size=tc.vocab_size, draft_vocab_size=int(d2t.numel()),
                        target_hidden_size=tc.hidden_size, aux_layer_ids=list(aux_layers),
                        aux_convention_in_file="input", rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
                        rope_scaling=tc.rope_scaling, max_position_embeddings=tc.max_position_embeddings,
                        norm_before_residual=norm_before_residual)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        d.d2t.copy_(d2t)
        d.t2d.copy_(t2d)
        d.lm_head.weight.copy_(target.lm_head.weight.detach().float()[t2d.to(target.device)].to(d.lm_head.weight))
        d.norm.weight.copy_(target.norm.weight.detach().float())     # the scale those rows expect
    return d


def init_drafter(path: str, target):
    """--init: an existing drafter (either layout) to fine-tune; it must fit the target."""
    from specscope.speculative.formats import load_drafter
    from specscope.speculative.eagle3 import Eagle3Drafter

    try:
        d = load_drafter(_resolve_drafter_path(path), target, dtype=torch.float32, device="cpu")
    except SpecscopeError as e:
        raise SpecscopeError(f"--init {path}: {e}") from None
    fresh = Eagle3Drafter(d.config)
    fresh.load_state_dict(d.state_dict())
    return fresh


def _resolve_drafter_path(name: str) -> Path:
    p = Path(name)
    if p.is_dir():
        return p
    shipped = Path(__file__).resolve().parent.parent / "assets" / "drafters" / name
    if shipped.is_dir():
        return shipped
    raise SpecscopeError(f"drafter {name!r} is neither a directory nor a shipped drafter name")


def export(source: str | Path, out: str | Path, fmt: str, dtype: torch.dtype | None = None,
           tinfo: dict | None = None, extra_files: dict | None = None, target=None,
           speculative_tokens: int | None = None) -> Path:
    """A work directory (its latest checkpoint), a checkpoint file, or a drafter directory -> `out` in `fmt`.
    `target` (formats.TargetFacts) checks the pair and names the verifier; without it the name a checkpoint
    recorded is kept."""
    from specscope.speculative.formats import load_drafter, map_problems, pair_problems, save_drafter
    from specscope.train.trainer import drafter_from_checkpoint, latest_checkpoint, load_checkpoint

    source = Path(source)
    meta = {}
    if source.is_file():
        st = load_checkpoint(source)
        drafter, meta = drafter_from_checkpoint(st), st.get("meta", {})
    elif (source / "train" / "checkpoints").is_dir() or (source / "checkpoints").is_dir():
        ck_dir = source / "train" / "checkpoints" if (source / "train").is_dir() else source / "checkpoints"
        ck = latest_checkpoint(ck_dir)
        if ck is None:
            raise SpecscopeError(f"{ck_dir} holds no checkpoint yet")
        st = load_checkpoint(ck)
        drafter, meta = drafter_from_checkpoint(st), st.get("meta", {})
    elif (source / "config.json").exists():
        drafter = load_drafter(source, target)       # checks the pair when a target is given
    else:
        raise SpecscopeError(f"{source} is not a training work directory, a checkpoint or a drafter directory")
    if target is not None:
        problems = pair_problems(drafter.config, target) + map_problems(drafter, target.vocab_size)
        if problems:
            raise SpecscopeError(f"drafter does not fit the target {target.name_or_path}: " + "; ".join(problems))
        tinfo = target.info()
    tinfo = tinfo or meta.get("target")
    return save_drafter(drafter, out, format=fmt, target_info=tinfo, dtype=dtype, extra_files=extra_files,
                        speculative_tokens=speculative_tokens)
