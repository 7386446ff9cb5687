"""The target, as far as a drafter cares: its facts from a config.json alone (`TargetFacts`, `resolve_target`, a
drafter directory's own `specscope_target.json`), and every reason a drafter cannot serve it (sizes, aux layer ids,
the d2t / t2d maps), named at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specscope.errors import SpecscopeError
from specscope.models.config import (MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB,
                                     cfg_int, rope_scaling_of, rope_theta_of)
from specscope.models.hub import KNOWN_MODELS, parse_hub_id, resolve_model
from specscope.models.loader import read_json_object
from specscope.speculative.eagle3 import DrafterConfig, Eagle3Drafter
from specscope.speculative.eagle3_config import one_error


@dataclass
class TargetFacts:
    """What a drafter must agree with, read from a target's config.json alone (no weights needed)."""
    name_or_path: str | None
    architectures: list[str]
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    max_position_embeddings: int | None = None
    torch_dtype: str | None = None
    path: Path | None = None         # the checkpoint directory, when there is one

    @classmethod
    def from_raw(cls, raw: dict, name_or_path: str | None, path: Path | None = None) -> "TargetFacts":
        """Checked as `generate` checks a config: integers in range (not "576", not 0), so that an impossible
        target is refused here rather than exported against or passed by check-drafter."""
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        src = {**raw, **{k: v for k, v in text.items() if k not in raw}}   # multimodal: the LM under text_config
        where = "target config.json"
        missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if src.get(k) is None]
        if missing:
            raise SpecscopeError(f"target config.json lacks {', '.join(missing)}; is it a causal LM config?")
        hidden = cfg_int(src, "hidden_size", hi=MAX_HIDDEN, where=where)
        heads = cfg_int(src, "num_attention_heads", None, hi=MAX_HEADS, where=where)
        if heads is not None:
            cfg_int(src, "num_key_value_heads", None, hi=heads, where=where)
            if hidden % heads and src.get("head_dim") is None:
                raise SpecscopeError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads "
                                     f"{heads} and no head_dim is given; fix the file or re-export the checkpoint")
        cfg_int(src, "head_dim", None, hi=MAX_HEAD_DIM, where=where)
        try:
            return cls(name_or_path=name_or_path, architectures=list(raw.get("architectures") or []),
                       hidden_size=hidden, vocab_size=cfg_int(src, "vocab_size", hi=MAX_VOCAB, where=where),
                       num_hidden_layers=cfg_int(src, "num_hidden_layers", hi=MAX_LAYERS, where=where),
                       rope_theta=float(rope_theta_of(text or raw)),
                       rope_scaling=rope_scaling_of(text or raw),
                       max_position_embeddings=cfg_int(src, "max_position_embeddings", None, hi=MAX_POSITIONS,
                                                       where=where),
                       torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), path=path)
        except (TypeError, ValueError) as e:
            raise SpecscopeError(f"target config.json has an invalid value: {e}") from None

    @classmethod
    def from_model(cls, target) -> "TargetFacts":
        c = target.config
        return cls(name_or_path=getattr(target, "source_path", None), architectures=[c.architecture],
                   hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_hidden_layers=c.num_hidden_layers,
                   rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                   max_position_embeddings=c.max_position_embeddings, torch_dtype=c.torch_dtype)

    def info(self) -> dict:
        return {"name_or_path": self.name_or_path, "architectures": self.architectures}


def resolve_target(spec: str, record_as: str | None = None, files: str = "config") -> TargetFacts:
    """--model (the target): a known name (pulled on first use), a local HF directory, just its config.json, or a
    Hugging Face id (only its config.json is fetched unless `files="model"`: no weights needed)."""
    f = Path(spec).expanduser()
    if f.is_file():
        raw = read_json_object(f)
        d = f.parent
        name = record_as or raw.get("_name_or_path") or str(d.resolve())
        return TargetFacts.from_raw(raw, name, d if any(d.glob("*.safetensors")) else None)
    d = resolve_model(spec, files=files)
    if not (d / "config.json").exists():
        raise SpecscopeError(f"target {spec!r} ({d}) has no config.json; pass a Hugging Face checkpoint directory, "
                             f"its config.json, a Hugging Face id or a known name ({', '.join(KNOWN_MODELS)})")
    km = KNOWN_MODELS.get(spec)
    hub = parse_hub_id(spec) if not f.exists() and not km else None
    name = record_as or (getattr(km, "hf_repo", None) if km else None) or (hub[0] if hub else None) or \
        (spec if km else str(d.resolve()))
    return TargetFacts.from_raw(read_json_object(d / "config.json"), name, d)


# a drafter directory's own record of the target it was trained for (the shipped drafters carry one)
TARGET_FILE = "specscope_target.json"


def declared_target(drafter_dir: str | Path, record_as: str | None = None) -> TargetFacts | None:
    """The target `drafter_dir/specscope_target.json` names ({"name_or_path": hub id, "config": the fields of its
    config.json a drafter is checked against}), so exporting a shipped drafter needs no --model and no download;
    None when the directory declares none."""
    f = Path(drafter_dir) / TARGET_FILE
    if not f.is_file():
        return None
    raw = read_json_object(f)
    name, cfg = raw.get("name_or_path"), raw.get("config")
    if not isinstance(name, str) or not name or not isinstance(cfg, dict):
        raise SpecscopeError(f"{f} must hold \"name_or_path\" (the target's id) and \"config\" (its config.json "
                             f"fields); fix it, or delete it and pass --model")
    return TargetFacts.from_raw(cfg, record_as or name)


def pair_problems(cfg: DrafterConfig, t: TargetFacts) -> list[str]:
    """Every reason this drafter cannot serve this target (sizes and layer ids; each names both values)."""
    out = []
    if cfg.target_hidden_size != t.hidden_size:
        out.append(f"drafter expects target hidden size {cfg.target_hidden_size} (fc takes "
                   f"3x{cfg.target_hidden_size}) but the target's hidden size is {t.hidden_size}")
    if cfg.hidden_size != t.hidden_size:
        out.append(f"drafter hidden size {cfg.hidden_size} differs from the target's {t.hidden_size}; "
                   f"the drafter reads the target's token embeddings, so they must match")
    if cfg.vocab_size != t.vocab_size:
        out.append(f"drafter was built for a target vocabulary of {cfg.vocab_size} tokens but the target "
                   f"has {t.vocab_size}; it belongs to a different model")
    L = t.num_hidden_layers
    fourth = cfg.meta.verifier_logits_layer
    ids = list(cfg.aux_layer_ids) + ([fourth] if fourth is not None else [])
    bad = [i for i in ids if not 0 <= i <= L]
    if bad:
        out.append(f"drafter aux layer ids {ids} (entering-layer convention) are out of range for a target "
                   f"with {L} layers (valid: 0..{L})")
    return out


def map_problems(drafter: Eagle3Drafter, vocab_size: int) -> list[str]:
    """d2t / t2d / lm_head consistency against a target vocabulary of `vocab_size`."""
    c = drafter.config
    out = []
    d2t, t2d = drafter.d2t.cpu(), drafter.t2d.cpu()
    if d2t.numel() != c.draft_vocab_size:
        out.append(f"d2t has {d2t.numel()} entries but draft_vocab_size is {c.draft_vocab_size}")
    if t2d.numel() != vocab_size:
        out.append(f"t2d has {t2d.numel()} entries but the target vocabulary has {vocab_size}")
    if drafter.lm_head.weight.shape[0] != c.draft_vocab_size:
        out.append(f"lm_head has {drafter.lm_head.weight.shape[0]} rows but draft_vocab_size is "
                   f"{c.draft_vocab_size}")
    ids = torch.arange(d2t.numel()) + d2t
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        out.append(f"d2t maps draft ids to target ids {lo}..{hi}, outside the target vocabulary "
                   f"0..{vocab_size - 1}")
    elif ids.unique().numel() != ids.numel():
        out.append(f"d2t maps {ids.numel()} draft ids onto only {ids.unique().numel()} distinct target "
                   f"ids; the map must be one-to-one")
    elif t2d.numel() == vocab_size and (int(t2d.sum()) != d2t.numel() or not bool(t2d[ids].all())):
        out.append(f"t2d marks {int(t2d.sum())} target ids but d2t maps {d2t.numel()} draft ids (or marks "
                   f"different ones); d2t and t2d are inconsistent")
    return out


def validate_drafter(drafter: Eagle3Drafter, target) -> None:
    """Refuse a drafter that cannot serve `target`, naming every reason at once (each with both values)."""
    problems = pair_problems(drafter.config, TargetFacts.from_model(target))
    problems += map_problems(drafter, target.config.vocab_size)
    if problems:
        raise SpecscopeError(one_error("drafter does not fit the target", problems))
