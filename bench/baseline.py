"""Baseline decoding on the demo model: our engine vs transformers `generate`, against this machine's memory floor.

For each dtype (fp32, bf16), in one run: greedy decoding of the first turns of the 80 MT-bench prompts
(`--limit` for quick runs), chat template, 128 new tokens, 2 threads, with our engine and with transformers
`generate` alternately per prompt (identical tokens checked), plus the memory floor measured in the same run:
model bytes read per decode step / measured GEMV bandwidth on a large weight-like matrix. Prints a table and
writes bench/results/baseline.json.

    .venv/bin/python bench/baseline.py --limit 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mt_bench_first_turns(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["category"] in MT_BENCH][:80]
    return [{"question_id": r["question_id"], "category": r["category"], "prompt": r["turns"][0]}
            for r in rows[:limit]]


def gemv_bandwidth(dtype: torch.dtype, rows: int = 16384, cols: int = 4096, reps: int = 8) -> dict:
    """GB/s streaming a [rows, cols] weight (256 MB fp32: far past the caches) through a 1-row matmul, with each
    kernel the engine could use; the best one defines the floor."""
    from specscope.models.linear import can_pack

    W = torch.randn(rows, cols).to(dtype)
    x = torch.randn(1, cols).to(dtype)
    kernels = {"F.linear": lambda: F.linear(x, W)}
    Wt = W.t().contiguous()
    kernels["x @ W^T (transposed copy)"] = lambda: x @ Wt
    if can_pack(W):
        P = torch.ops.mkldnn._reorder_linear_weight(W, None)
        kernels["oneDNN packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, P, None, "none", [], "")
    nbytes = W.numel() * W.element_size()
    out = {}
    for name, fn in kernels.items():
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out[name] = round(nbytes / min(ts) / 1e9, 2)
    best = max(out, key=out.get)
    return {"gb_per_s": out[best], "kernel": best, "by_kernel_gb_per_s": out, "matrix": [rows, cols],
            "matrix_bytes": nbytes}


def bytes_per_token(model) -> dict:
    """Bytes one decode step must read: every matmul weight, norms, one embedding row; KV cache reported apart."""
    from specscope.models.loader import compute_dtype

    cfg = model.config
    el = compute_dtype(model).itemsize   # our bf16 (fp32 tensors of bf16 values) streams its linears as bf16
    H, V = cfg.hidden_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = H * (q + 2 * kv) + q * H + 3 * H * cfg.intermediate_size + 2 * H
    if cfg.qkv_bias:
        per_layer += q + 2 * kv
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim
    weights = (cfg.num_hidden_layers * per_layer + H + V * H + H) * el  # layers, final norm, lm_head, embed row
    kv_per_ctx_token = 2 * cfg.num_hidden_layers * kv * el
    return {"weights": weights, "kv_per_context_token": kv_per_ctx_token}


def run_ours(model, ids, n, stop):
    from specscope.generate import generate

    t = time.perf_counter()
    r = generate(model, ids, n, stop_ids=stop)
    wall = time.perf_counter() - t
    return r.token_ids, wall, r.prefill_s, r.step_ms


def run_hf(hf, ids, n, stop):
    x = torch.tensor([ids])
    with torch.inference_mode():
        t = time.perf_counter()
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          eos_token_id=stop, pad_token_id=stop[0])
        wall = time.perf_counter() - t
    toks = out[0, len(ids):].tolist()
    cut = next((i for i, t in enumerate(toks) if t in stop), None)
    return (toks[:cut + 1] if cut is not None else toks), wall


def bench_dtype(name, path, tok, prompts, args, log) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    from specscope.models import load_model
    from specscope.progress import Progress
    from specscope.session import stop_ids_for

    transformers.logging.set_verbosity_error()
    dtype = DTYPES[name]
    ours = load_model(path, dtype=dtype)
    variants = {"ours": ours}
    if args.compare_dense:
        variants["ours (dense F.linear)"] = load_model(path, dtype=dtype, pack=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    stop = stop_ids_for(ours, tok)
    encoded = [tok.encode(p["prompt"], chat=True) for p in prompts]
    # warm-up: first calls allocate and pick kernels
    for m in variants.values():
        run_ours(m, encoded[0][:16], 4, stop)
    run_hf(hf, encoded[0][:16], 4, stop)
    bw = [gemv_bandwidth(dtype)]
    per_prompt = []
    # the shared progress (specscope.progress): a bar on a terminal, a line every 30 s in a log
    with Progress(f"{name} prompts", len(prompts), "prompt", every_s=30) as prog:
        for i, (p, ids) in enumerate(zip(prompts, encoded)):
            row = {"question_id": p["question_id"], "category": p["category"], "prompt_tokens": len(ids)}
            order = list(variants) + ["transformers"]
            if i % 2:  # alternate who goes first, so drifting machine load hits both sides alike
                order = order[::-1]
            for who in order:
                if who == "transformers":
                    toks, wall = run_hf(hf, ids, args.max_new_tokens, stop)
                    row["transformers"] = {"tokens": len(toks), "seconds": wall, "tok_per_s": len(toks) / wall}
                    row["_hf_tokens"] = toks
                else:
                    toks, wall, pre, steps = run_ours(variants[who], ids, args.max_new_tokens, stop)
                    row[who] = {"tokens": len(toks), "seconds": wall, "tok_per_s": len(toks) / wall,
                                "prefill_s": pre, "decode_ms_per_token": statistics.fmean(steps) if steps else None,
                                "decode_ms_median": statistics.median(steps) if steps else None}
                    row[f"_{who}_tokens"] = toks
            row["identical"] = all(row[f"_{w}_tokens"] == row["_hf_tokens"] for w in variants)
            for k in [k for k in row if k.startswith("_")]:
                row.pop(k)
            per_prompt.append(row)
            prog.advance()
            prog.note(f"{name} q{p['question_id']} ({i + 1}/{len(prompts)}): ours {row['ours']['tok_per_s']:.1f} "
                      f"tok/s, transformers {row['transformers']['tok_per_s']:.1f} tok/s, identical={row['identical']}")
    bw.append(gemv_bandwidth(dtype))
    best_bw = max(bw, key=lambda b: b["gb_per_s"])
    nbytes = bytes_per_token(ours)
    floor_ms = nbytes["weights"] / (best_bw["gb_per_s"] * 1e9) * 1e3

    def summary(who):
        rows = [r[who] for r in per_prompt]
        s = {"tok_per_s": statistics.fmean(r["tok_per_s"] for r in rows),  # Spec-Bench: mean over questions
             "tokens": sum(r["tokens"] for r in rows), "seconds": sum(r["seconds"] for r in rows)}
        if who != "transformers":
            dm = statistics.fmean(r["decode_ms_per_token"] for r in rows if r["decode_ms_per_token"])
            s.update(decode_ms_per_token=dm, decode_tok_per_s=1e3 / dm, fraction_of_floor=floor_ms / dm)
        return s

    res = {who: summary(who) for who in list(variants) + ["transformers"]}
    res["speedup_vs_transformers"] = res["ours"]["tok_per_s"] / res["transformers"]["tok_per_s"]
    res["identical_tokens"] = sum(r["identical"] for r in per_prompt)
    res["prompts"] = len(per_prompt)
    res["floor"] = {"bytes_per_token": nbytes["weights"], "kv_bytes_per_context_token": nbytes["kv_per_context_token"],
                    "gemv": best_bw, "gemv_runs_gb_per_s": [b["gb_per_s"] for b in bw],
                    "ms_per_token": floor_ms, "tok_per_s": 1e3 / floor_ms}
    res["per_prompt"] = per_prompt
    del hf, variants, ours
    return res


def table(results: dict):
    from rich.table import Table

    t = Table(title="baseline decoding: SmolLM2-135M, MT-bench first turns, greedy, 2 threads")
    for c in ("dtype", "prompts", "ours tok/s", "transformers tok/s", "× transformers", "identical",
              "ours decode ms/tok", "floor ms/tok (GEMV GB/s)", "of floor"):
        t.add_column(c, justify="right")
    for name, r in results.items():
        f = r["floor"]
        t.add_row(name, str(r["prompts"]), f"{r['ours']['tok_per_s']:.1f}", f"{r['transformers']['tok_per_s']:.1f}",
                  f"{r['speedup_vs_transformers']:.2f}×", f"{r['identical_tokens']}/{r['prompts']}",
                  f"{r['ours']['decode_ms_per_token']:.1f}", f"{f['ms_per_token']:.1f} ({f['gemv']['gb_per_s']:.1f})",
                  f"{r['ours']['fraction_of_floor']:.2f}")
        if "ours (dense F.linear)" in r:
            d = r["ours (dense F.linear)"]
            t.add_row(f"{name} dense", "", f"{d['tok_per_s']:.1f}", "", "", "", f"{d['decode_ms_per_token']:.1f}", "",
                      f"{d['fraction_of_floor']:.2f}")
    return t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--questions", type=Path, default=None,
                    help="Spec-Bench question file (default: the copy packaged with specscope)")
    ap.add_argument("--limit", type=int, default=None, help="first N of the 80 MT-bench prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--compare-dense", action="store_true", help="also run our engine with plain F.linear weights")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "baseline.json")
    args = ap.parse_args(argv)

    from rich.console import Console

    from specscope.runtime.tokenizer import Tokenizer
    from specscope.models.hub import resolve_model

    con = Console(stderr=True)
    torch.set_num_threads(args.threads)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or args.threads < 1 or args.max_new_tokens < 1 or (args.limit is not None and args.limit < 1):
        ap.error(f"invalid arguments (dtypes {bad or dtypes}, threads {args.threads}, limit {args.limit})")
    from specscope.prompts import spec_bench_path

    args.questions = args.questions or spec_bench_path()
    if not args.questions.exists():
        ap.error(f"{args.questions} not found; pass --questions")
    path = resolve_model(args.model)
    tok = Tokenizer(path)
    prompts = mt_bench_first_turns(args.questions, args.limit)
    load_before = os.getloadavg()
    t0 = time.time()
    results = {d: bench_dtype(d, path, tok, prompts, args, lambda m: con.log(m)) for d in dtypes}
    env = {}
    try:
        from specscope.registry.fingerprint import collect

        env = collect()
    except Exception as e:  # the fingerprint is context, not the measurement
        env = {"error": f"{type(e).__name__}: {e}"}
    out = {"benchmark": "baseline", "model": args.model, "model_path": str(path),
           "prompt_set": "MT-bench first turns (spec_bench_question.jsonl)", "limit": args.limit,
           "max_new_tokens": args.max_new_tokens, "threads": args.threads, "greedy": True, "chat_template": True,
           "started_unix": t0, "wall_s": time.time() - t0,
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpu_count": os.cpu_count(),
           "goal": {"fraction_of_floor": 0.9, "speedup_vs_transformers": 1.0}, "results": results, "env": env}
    from specscope.registry.fingerprint import timing_warning

    out["load_warning"] = timing_warning(env if "cpu" in env else None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    Console(width=180).print(table(results))
    con.print(f"load average before/after: {load_before[0]:.1f} / {out['loadavg_after'][0]:.1f} on "
              f"{os.cpu_count()} CPUs; wrote {args.out}")
    if out["load_warning"]:
        print(out["load_warning"], file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
