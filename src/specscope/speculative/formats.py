"""EAGLE-3 drafter checkpoints in the two public layouts, and validation against a target.

- SafeAILab / SpecForge / SGLang ("sglang"): a LlamaConfig plus `draft_vocab_size`, optional `target_hidden_size`,
  `eagle_config.eagle_aux_hidden_state_layer_ids` (the *output of* layers i, i.e. our entering-layer id - 1; SGLang
  adds +1 when it reads them); weights `midlayer.*` with separate q/k/v and gate/up.
- vLLM speculators ("speculators"): `speculators_model_type: eagle3`, `transformer_layer_config`,
  `speculators_config`, `eagle_aux_hidden_state_layer_ids` (entering-layer ids); weights `layers.0.*`;
  `norm_before_residual` defaults to True when omitted (as vLLM reads it).

Our `Eagle3Drafter` fuses q/k/v and gate/up; `eagle3_weights.py` splits and joins them. The target's embedding is
shared and never written; aux layer ids are kept in the entering-layer convention, with the file's own recorded in
`DrafterConfig.aux_convention_in_file` ("input", "output" or "default" when the file named none). speculators
variants are honoured: `norm_before_fc` (`input_norm.weight`, one RMSNorm over the 3·Ht fc input), sliding-window
attention, and a 4th aux id (the verifier-logits layer used in training; kept for re-export, not an fc input).

The pieces: `eagle3_config.py` (config.json -> DrafterConfig), `eagle3_weights.py` (tensors, file layout <-> ours),
`eagle3_target.py` (the target's facts and the pair's checks), `eagle3_export.py` (writing either layout); this module
loads a drafter from them and names every public piece where callers have always imported it from.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specscope.errors import SpecscopeError
from specscope.speculative.eagle3 import Eagle3Drafter
from specscope.speculative.eagle3_config import (DRAFTER_CFG, FORMATS, SGLANG_ARCHS, SPECULATORS_ARCHS,
                                                 aux_conventions, detect_format, is_eagle3_config, one_error,
                                                 parse_config, read_config)
from specscope.speculative.eagle3_export import (DEFAULT_SPECULATIVE_TOKENS, SPECULATORS_VERSION, config_dict,
                                                 engine_ignores, save_drafter)
from specscope.speculative.eagle3_target import (TARGET_FILE, TargetFacts, declared_target, map_problems,
                                                 pair_problems, resolve_target, validate_drafter)
from specscope.speculative.eagle3_weights import (IGNORED_KEYS, LAYER_PREFIX, file_to_ours, listed_names,
                                                  nonfinite_tensors, ours_to_file, weight_reader)

__all__ = ["DEFAULT_SPECULATIVE_TOKENS", "DRAFTER_CFG", "FORMATS", "IGNORED_KEYS", "LAYER_PREFIX", "SGLANG_ARCHS",
           "SPECULATORS_ARCHS", "SPECULATORS_VERSION", "TARGET_FILE", "TargetFacts", "aux_conventions", "config_dict",
           "declared_target", "detect_format", "engine_ignores", "file_to_ours", "is_eagle3_config", "load_drafter",
           "map_problems", "nonfinite_tensors", "ours_to_file", "pair_problems", "parse_config", "read_config",
           "resolve_target", "save_drafter", "validate_drafter", "weight_reader"]


def load_drafter(path: str | Path, target=None, dtype: torch.dtype | None = None, device=None,
                 validate: bool = True, raw: dict | None = None) -> Eagle3Drafter:
    """Load an EAGLE-3 drafter directory in either layout, in its stored dtype unless `dtype` (or a target) says
    otherwise. With `target` (a loaded model), validate against it and place the drafter on the target's device
    and dtype; with a `TargetFacts` (a target's config.json alone), validate only. `raw`: the directory's
    config.json when the caller has already read it."""
    path = Path(path)
    if not path.is_dir():
        raise SpecscopeError(f"drafter {str(path)!r} is not a directory")
    raw = read_config(path) if raw is None else raw
    facts = target if isinstance(target, TargetFacts) else None
    if facts is not None:
        target = None           # a config-only target: checked against, nothing to place the drafter on
    L = facts.num_hidden_layers if facts else target.config.num_hidden_layers if target is not None else None
    cfg = parse_config(raw, L)
    ours = file_to_ours(weight_reader(path), cfg)
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg)     # shapes only: the file's tensors become the parameters (no second copy)
    expected = drafter.state_dict()
    problems = []
    for name, t in ours.items():
        if name in expected and tuple(t.shape) != tuple(expected[name].shape):
            hint = ""
            if name == "fc.weight" and t.shape[-1] == 4 * cfg.target_hidden_size:
                hint = " (fc fuses 4 target layers; EAGLE-3 drafters here fuse 3)"
            problems.append(f"tensor {name!r} has shape {tuple(t.shape)} but config.json implies "
                            f"{tuple(expected[name].shape)}{hint}")
    missing = [k for k in expected if k not in ours]
    if missing:
        problems.append(f"lacks {missing[:3]}")
    if problems:
        raise SpecscopeError(one_error("drafter checkpoint", problems) +
                             "; the weights and config.json do not match")
    floats = {t.dtype for t in ours.values() if t.is_floating_point()}
    drafter.load_state_dict(ours, strict=True, assign=True)
    del ours
    drafter.rope = torch.empty(2, 0, cfg.head_dim)      # still on meta; rebuilt below, after any cast
    if dtype is None:
        dtype = target.dtype if target is not None else (
            ours_dtype if len(floats) == 1 and (ours_dtype := next(iter(floats))) else torch.float32)
    if device is None:
        device = target.device if target is not None else "cpu"
    # d2t / t2d are integer / bool buffers: .to(dtype) only casts floating tensors; same dtype: no copy
    drafter = drafter.to(device=device, dtype=dtype)
    drafter.rope_upto(1)                 # the float32 RoPE table, built after any cast
    drafter.source_path = str(path)
    drafter.eval().requires_grad_(False)
    if validate and (bad := nonfinite_tensors(drafter.state_dict())):
        raise SpecscopeError(f"drafter {str(path)!r} has non-finite weights ({listed_names(bad)} hold NaN or inf; a "
                             f"diverged training run?); it cannot draft anything: retrain it with a lower --lr")
    if target is not None and validate:
        validate_drafter(drafter, target)
    if facts is not None and validate:
        problems = pair_problems(cfg, facts) + map_problems(drafter, facts.vocab_size)
        if problems:
            raise SpecscopeError(one_error(f"drafter does not fit the target {facts.name_or_path}", problems))
    return drafter
