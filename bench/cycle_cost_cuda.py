"""The cycle's costs on a GPU: our forward at the Llama-3.1-8B shape (random weights, bf16), one decode step against
the HBM floor (weight bytes / measured copy bandwidth), and verify T(n)/T(1) — what speculation pays per draft token.

    python bench/cycle_cost_cuda.py --out bench/results/cycle_cost_cuda.json     # needs CUDA; ~1 minute on an H200

CUDA events around each forward (median of --iters after warm-up); the copy bandwidth is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import statistics
import time
from pathlib import Path

LLAMA31_8B = dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)


def copy_bandwidth(dev) -> float:
    """Copy bandwidth (read + write, GB/s) on a buffer far larger than L2."""
    import torch

    buf = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)
    for _ in range(3):
        dst.copy_(buf)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        dst.copy_(buf)
    ev[1].record()
    torch.cuda.synchronize()
    return 2 * buf.numel() * 10 / (ev[0].elapsed_time(ev[1]) / 1e3) / 1e9


def verify_times(model, vocab: int, context: int, widths: list[int], iters: int, dev) -> dict:
    """{n: median ms of one forward of n tokens at `context`} (CUDA events, 5 warm-up forwards each), under the
    shared progress over forwards (specscope.progress: a bar on a terminal, lines in a log; stderr)."""
    import torch

    from specscope.progress import Progress

    cache = model.new_cache(context + max(widths) + 1)
    ids = torch.randint(0, vocab, (1, context), device=dev)
    rows = {}
    with torch.no_grad(), Progress("verify widths", len(widths) * (iters + 5), "forward") as prog:
        model(ids, torch.arange(context, device=dev)[None], cache, logits_idx=[context - 1])
        for n in widths:
            tok = torch.randint(0, vocab, (1, n), device=dev)
            pos = torch.arange(context, context + n, device=dev)[None]
            mask = torch.arange(context + n, device=dev)[None, None, :] <= pos[:, :, None]   # tree-verify form
            times = []
            for i in range(iters + 5):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                model(tok, pos, cache, pos, mask if n > 1 else None)
                e.record()
                torch.cuda.synchronize()
                if i >= 5:
                    times.append(s.elapsed_time(e))
            rows[n] = statistics.median(times)
            prog.advance(iters + 5, info=f"n = {n}")        # between widths: never inside a timed forward
    return rows


def main():
    import torch

    from specscope.models.config import ModelConfig
    from specscope.models.llama import Transformer
    from specscope.registry.fingerprint import timing_warning

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024, help="tokens already in the KV cache")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--widths", default="1,2,4,8,12,16,32")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cycle_cost_cuda.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this bench needs a CUDA device")
    dev = torch.device("cuda")
    cfg = ModelConfig(**LLAMA31_8B)
    torch.manual_seed(0)
    with torch.device(dev):
        torch.set_default_dtype(torch.bfloat16)
        model = Transformer(cfg).eval()
        torch.set_default_dtype(torch.float32)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    copy_gbs = copy_bandwidth(dev)
    rows = verify_times(model, cfg.vocab_size, a.context, [int(x) for x in a.widths.split(",")], a.iters, dev)
    t1 = rows[1]
    floor_ms = weight_bytes / (copy_gbs / 2 * 1e9) * 1e3     # read each weight once at the copy's read rate
    out = {"bench": "cycle_cost_cuda", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "python": platform.python_version(), "shape": "llama-3.1-8b (random weights)",
           "dtype": "bf16", "context": a.context, "weight_bytes": weight_bytes, "copy_GBps_rw": round(copy_gbs, 1),
           "decode_ms": round(t1, 3), "floor_ms": round(floor_ms, 3), "fraction_of_floor": round(floor_ms / t1, 3),
           "achieved_GBps": round(weight_bytes / (t1 / 1e3) / 1e9, 1),
           "verify_ms": {n: round(v, 3) for n, v in rows.items()},
           "T_n_over_T_1": {n: round(v / t1, 3) for n, v in rows.items()},
           # batch-1 forwards are launch-bound on the host: a busy CPU slows them as surely as a busy GPU
           "load_warning": timing_warning()}
    print(f"{out['device']}: decode {t1:.2f} ms/token = {out['achieved_GBps']} GB/s; floor {floor_ms:.2f} ms "
          f"({out['fraction_of_floor']:.2f} of floor; copy {copy_gbs:.0f} GB/s r+w)")
    print(" n   T(n) ms   T(n)/T(1)")
    for n, v in rows.items():
        print(f"{n:>2} {v:9.3f} {v / t1:10.3f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    if out["load_warning"]:
        print(out["load_warning"], file=sys.stderr)


if __name__ == "__main__":
    main()
