"""Writing a drafter in either layout (config.json + model.safetensors). Export keeps what the source recorded
(verifier, speculators version, proposal methods) unless a target overrides it, and refuses the SGLang layout for
features SGLang would silently ignore.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save

from specscope.errors import SpecscopeError
from specscope.fileio import atomic_output, why
from specscope.jsonio import dtype_name
from specscope.speculative.eagle3 import DrafterConfig, Eagle3Drafter
from specscope.speculative.eagle3_config import FORMATS
from specscope.speculative.eagle3_weights import listed_names, nonfinite_tensors, ours_to_file

# written only when neither the source checkpoint nor an installed `speculators` names a version. Metadata only:
# vLLM's SpeculatorsConfig reads speculators_model_type, speculators_config and transformer_layer_config and never
# this field (vllm/transformers_utils/configs/speculators/base.py); released checkpoints carry 0.1.0.dev14 to 0.8.x
SPECULATORS_VERSION = "0.3.0"
# vLLM's usual num_speculative_tokens; used only when the source names none and --speculative-tokens is not given
DEFAULT_SPECULATIVE_TOKENS = 3


def engine_ignores(cfg: DrafterConfig, fmt: str) -> list[str]:
    """What the engine reading `fmt` would silently not honour (so the served network would differ)."""
    if fmt != "sglang":
        return []
    out = []
    for flag, does in (("norm_before_residual", "adds the un-normed residual"),
                       ("norm_output", "feeds the pre-norm hidden state to the next step"),
                       ("fc_norm", "applies no per-layer norm before fc (and never loads fc_norm.*)"),
                       ("norm_before_fc", "applies no norm over the fc input (and never loads input_norm.weight)")):
        if getattr(cfg, flag):
            out.append(f"{flag}=true (SGLang's llama_eagle3 {does})")
    if cfg.sliding_window:
        out.append(f"sliding_window={cfg.sliding_window} (SGLang's llama_eagle3 attends over the full context)")
    return out


def _decimal(x: float) -> float:
    """A float32-rounded config value (GGUF stores float32: 1e-5 -> 9.999999747378752e-06) back to its decimal."""
    f32 = np.float32(x)
    return float(str(f32)) if float(f32) == x else x


def _speculators_version(cfg: DrafterConfig) -> str:
    if cfg.meta.speculators_version:
        return cfg.meta.speculators_version
    try:
        return version("speculators")
    except Exception:
        return SPECULATORS_VERSION


def _proposal_methods(cfg: DrafterConfig, speculative_tokens: int | None) -> tuple[list[dict], str]:
    methods = [dict(m) for m in cfg.meta.proposal_methods or [] if isinstance(m, dict)]
    default = cfg.meta.default_proposal_method or "greedy"
    if not methods:
        methods = [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens or DEFAULT_SPECULATIVE_TOKENS,
                    "accept_tolerance": 0.0, "verifier_accept_k": 1}]
    elif speculative_tokens:
        for m in methods:
            m["speculative_tokens"] = speculative_tokens
    return methods, default


def config_dict(drafter: Eagle3Drafter, fmt: str, target_info: dict | None = None, dtype: str | None = None,
                speculative_tokens: int | None = None) -> dict:
    cfg = drafter.config
    dtype = dtype or dtype_name(drafter.dtype)
    layer = {
        "attention_bias": cfg.attention_bias, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings, "model_type": "llama",
        "num_attention_heads": cfg.num_attention_heads, "num_hidden_layers": 1,
        "num_key_value_heads": cfg.num_key_value_heads, "rms_norm_eps": _decimal(cfg.rms_norm_eps),
        "rope_scaling": cfg.rope_scaling, "rope_theta": cfg.rope_theta, "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
    }
    if cfg.sliding_window:
        layer.update(use_sliding_window=True, sliding_window=cfg.sliding_window, layer_types=["sliding_attention"])
    flags = {"norm_before_residual": cfg.norm_before_residual, "norm_output": cfg.norm_output,
             "fc_norm": cfg.fc_norm, "norm_before_fc": cfg.norm_before_fc}
    ours = {"specscope": {"predicted_tau": cfg.meta.predicted_tau}} if cfg.meta.predicted_tau else {}
    if fmt == "sglang":
        ignored = engine_ignores(cfg, fmt)
        if ignored:
            raise SpecscopeError(f"SGLang would serve a different network: it ignores {'; '.join(ignored)}. "
                                 f"Export with --format speculators (vLLM reads these) instead")
        if min(cfg.aux_layer_ids) < 1:
            raise SpecscopeError(f"aux layer ids {cfg.aux_layer_ids} include the embedding output (layer 0), which "
                                 f"the SGLang output-of-layer convention cannot name; save as speculators")
        del flags["norm_before_fc"]
        return {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": cfg.draft_vocab_size,
                "target_hidden_size": cfg.target_hidden_size, "torch_dtype": dtype,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
                                 "use_aux_hidden_state": True},
                **flags, **ours}
    if fmt == "speculators":
        verifier = dict(cfg.meta.verifier or {})
        verifier.update({k: v for k, v in (target_info or {}).items()
                         if k in ("name_or_path", "architectures") and v})
        if not verifier.get("name_or_path"):
            raise SpecscopeError("a speculators drafter must name its verifier (vLLM serves "
                                 "verifier.name_or_path as the target); pass --model TARGET")
        if not verifier.get("architectures"):
            raise SpecscopeError(f"the verifier's architectures are unknown; pass --model with the target's config.json "
                                 f"(recording {verifier['name_or_path']!r})")
        ids = list(cfg.aux_layer_ids)
        if cfg.meta.verifier_logits_layer is not None:
            ids.append(cfg.meta.verifier_logits_layer)
        methods, default = _proposal_methods(cfg, speculative_tokens)
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "speculators_version": _speculators_version(cfg), "draft_vocab_size": cfg.draft_vocab_size,
                "target_hidden_size": cfg.target_hidden_size,
                "eagle_aux_hidden_state_layer_ids": ids, **flags,
                "transformer_layer_config": layer, "torch_dtype": dtype,
                "speculators_config": {"algorithm": "eagle3", "default_proposal_method": default,
                                       "proposal_methods": methods,
                                       "verifier": {"name_or_path": verifier["name_or_path"],
                                                    "architectures": list(verifier["architectures"])}},
                **ours}
    raise SpecscopeError(f"unknown drafter format {fmt!r}; use one of {', '.join(FORMATS)}")


# what an export writes into its directory (and the sharded index it removes): no input may sit at these names
WRITES = ("config.json", "model.safetensors", "model.safetensors.index.json")


def save_drafter(drafter: Eagle3Drafter, path: str | Path, format: str = "sglang", target_info: dict | None = None,
                 dtype: torch.dtype | None = None, extra_files: dict[str, str] | None = None,
                 speculative_tokens: int | None = None) -> Path:
    """Write config.json + model.safetensors in the given layout (the target embedding is never written)."""
    if format not in FORMATS:
        raise SpecscopeError(f"unknown drafter format {format!r}; use one of {', '.join(FORMATS)}")
    wdtype = dtype_name(dtype or drafter.dtype)
    cfg = config_dict(drafter, format, target_info, wdtype, speculative_tokens)   # refusals before any write
    bad = nonfinite_tensors(drafter.state_dict())
    if bad:
        raise SpecscopeError(f"refusing to write a drafter whose weights are not finite ({listed_names(bad)} hold NaN "
                             f"or inf): it would propose garbage; retrain it (a lower --lr)")
    path = Path(path)
    tensors = ours_to_file(drafter, format)
    if dtype is not None:
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    texts = {"config.json": json.dumps(cfg, indent=2) + "\n", **(extra_files or {})}
    made = [d for d in (path, *path.parents) if not d.exists()]   # the directories this export creates
    try:
        path.mkdir(parents=True, exist_ok=True)
        _write_all(path, tensors, texts)
    except (OSError, SpecscopeError) as e:
        for d in made:      # nothing of this export stays behind, not even an empty directory
            _rmdir_quietly(d)
        if isinstance(e, OSError):
            raise SpecscopeError(f"cannot write the drafter to {str(path)!r} ({why(e)}); nothing was written "
                                 f"there") from None
        raise
    for stale in [path / "model.safetensors.index.json", *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)    # an earlier sharded copy would shadow the file just written
    return path


def _write_all(path: Path, tensors: dict, texts: dict[str, str]) -> None:
    """Every file written to its temp file first, and renamed into place only once all are written (the contexts
    close in turn): a full disk or an interrupt part-way leaves the directory as it was, never new weights beside
    an old config."""
    with ExitStack() as stack:
        # serialised here and written by Python: safetensors' own writer reports a full disk as SafetensorError,
        # not the OSError that says which
        files = {"model.safetensors": save(tensors, metadata={"format": "pt"}),
                 **{name: text.encode("utf-8") for name, text in texts.items()}}
        for name, data in files.items():
            tmp = stack.enter_context(atomic_output(path / name, "drafter file"))
            tmp.write_bytes(data)


def _rmdir_quietly(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
