"""Which CPU matmul kernel streams the decode/verify weights fastest (the evidence behind models/linear.py).

Runs SmolLM2's 121 weight matrices back to back (538 MB fp32: caches stay cold, as in a real forward) through a
[rows, in] activation with each candidate: `F.linear` on the [out, in] weight (MKL), `x @ W^T` on a transposed
[in, out] copy (MKL), oneDNN with the weight reordered once (`mkldnn._reorder_linear_weight`) and, where it
builds, our row-invariant kernel (models/rowgemm.py, fp32, with this machine's tuned plan per shape). Rows 1 =
decode, 2-64 = speculative verify. Rounds are interleaved and the minimum kept, so a shared, noisy machine
hurts every kernel alike. Writes bench/results/linear_kernels.json.

    .venv/bin/python bench/linear_kernels.py --threads 2 --rows 1,2,4,8,16,64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
# SmolLM2-135M: qkv, o, gate_up, down per layer x 30, then the tied lm_head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def measure(dtype: torch.dtype, rows: list[int], rounds: int, tick=lambda: None) -> dict:
    """Best time per (kernel, rows) over interleaved rounds; tick(): after each round."""
    Ws = [torch.randn(o, i).to(dtype) for o, i in SHAPES]
    kernels = {"F.linear": [(lambda x, w=w: F.linear(x, w)) for w in Ws]}
    Wts = [w.t().contiguous() for w in Ws]
    kernels["x @ W^T copy"] = [(lambda x, w=w: x @ w) for w in Wts]
    try:
        Ps = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in Ws]
        kernels["oneDNN packed"] = [(lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
                                    for p in Ps]
    except (RuntimeError, AttributeError) as e:
        print(f"oneDNN packing unavailable for {dtype}: {e}")
    from specscope.models import rowgemm, tuning

    if dtype == torch.float32 and rowgemm.available():
        plans = {(o, i): tuning.tuned_plan(o, i) for o, i in set(SHAPES)}
        Rs = [rowgemm.pack(w, plans[(o, i)]["nb"]) for w, (o, i) in zip(Ws, SHAPES)]
        kernels["rowgemm (ours)"] = [
            (lambda x, p=p, o=o, i=i: rowgemm.gemm(x.view(-1, i), p, plans[(o, i)]["nb"], o, None,
                                                   tuning.rb_for(plans[(o, i)], x.numel() // i)))
            for p, (o, i) in zip(Rs, SHAPES)]
    nbytes = sum(w.numel() * w.element_size() for w in Ws)
    best = {(k, m): float("inf") for k in kernels for m in rows}
    for _ in range(rounds):
        for k, fns in kernels.items():
            for m in rows:
                xs = {i: torch.randn(1, m, i).to(dtype) for i in (576, 1536)}
                t = time.perf_counter()
                for fn, (_, i) in zip(fns, SHAPES):
                    fn(xs[i])
                best[(k, m)] = min(best[(k, m)], time.perf_counter() - t)
        tick()
    return {"bytes": nbytes, "rows": {m: {k: {"ms": round(best[(k, m)] * 1e3, 2),
                                              "gb_per_s": round(nbytes / best[(k, m)] / 1e9, 2)} for k in kernels}
                                      for m in rows}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "linear_kernels.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    from specscope.progress import Progress
    from specscope.registry.fingerprint import timing_warning

    load0 = os.getloadavg()
    res = {}
    dtypes = args.dtypes.split(",")
    # rounds over every kernel and row count, per dtype: the shared bar on a terminal, lines in a log (stderr)
    with Progress("linear kernels", len(dtypes) * args.rounds, "round") as prog:
        for name in dtypes:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
            res[name] = measure(dtype, rows, args.rounds, tick=lambda n=name: prog.advance(info=n))
            for m, ks in res[name]["rows"].items():
                line = "  ".join(f"{k} {v['ms']:7.1f} ms ({v['gb_per_s']:5.1f} GB/s)" for k, v in ks.items())
                prog.echo(f"{name} rows={m:3d}  {line}")
    out = {"threads": args.threads, "rounds": args.rounds, "torch": torch.__version__, "cpu_count": os.cpu_count(),
           "loadavg_before": load0, "loadavg_after": os.getloadavg(), "results": res,
           "load_warning": timing_warning()}    # the minimum of the rounds still waited for a shared CPU
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"load average {load0[0]:.1f} -> {out['loadavg_after'][0]:.1f}; wrote {args.out}")
    if out["load_warning"]:
        print(out["load_warning"], file=sys.stderr)


if __name__ == "__main__":
    main()
