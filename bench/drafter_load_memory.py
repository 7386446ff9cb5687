"""Peak memory of loading a full-size EAGLE-3 drafter: Llama-3.1-8B shape (hidden 4096, intermediate 14336,
32/8 heads, draft vocab 32,000, vocab 128,256), random weights, fp16 as SafeAILab publishes it, in each layout
(single file; SGLang and speculators names; and two shards). Each load runs in a fresh process: the RSS after
imports and a warm-up load of a tiny drafter is the base, VmHWM after the load the peak. Goal: peak - base <=
1.5 x file size. Prints a table and writes bench/results/drafter_load_memory.json (~1 GB of scratch disk).

    .venv/bin/python bench/drafter_load_memory.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = r"""
import sys, torch
torch.set_num_threads(1)
from specscope.speculative.formats import load_drafter
from specscope.jsonio import dtype_name
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key)) * 1024
load_drafter(sys.argv[2])
base = status("VmRSS")
d = load_drafter(sys.argv[1])
print(base, status("VmHWM"), dtype_name(d.dtype))
"""


def tensors(prefix: str, H=4096, I=14336, V=128256, Vd=32000, nh=32, nkv=8, hd=128, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    ids = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    p = prefix
    return {"fc.weight": r(H, 3 * H), "norm.weight": r(H), "lm_head.weight": r(Vd, H), "d2t": ids - torch.arange(Vd),
            "t2d": t2d, p + "self_attn.q_proj.weight": r(nh * hd, 2 * H),
            p + "self_attn.k_proj.weight": r(nkv * hd, 2 * H),
            p + "self_attn.v_proj.weight": r(nkv * hd, 2 * H), p + "self_attn.o_proj.weight": r(H, nh * hd),
            p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H), p + "mlp.down_proj.weight": r(H, I),
            p + "hidden_norm.weight": r(H), p + "input_layernorm.weight": r(H),
            p + "post_attention_layernorm.weight": r(H)}


def config(fmt: str, H=4096, I=14336, V=128256, Vd=32000, nh=32, nkv=8, hd=128) -> dict:
    layer = {"hidden_size": H, "intermediate_size": I, "num_attention_heads": nh, "num_key_value_heads": nkv,
             "head_dim": hd, "vocab_size": V, "num_hidden_layers": 1, "rms_norm_eps": 1e-05, "hidden_act": "silu",
             "max_position_embeddings": 2048, "model_type": "llama"}
    if fmt == "speculators":
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": Vd,
                "eagle_aux_hidden_state_layer_ids": [2, 16, 29], "transformer_layer_config": layer}
    return {"architectures": ["LlamaForCausalLM"], **layer, "draft_vocab_size": Vd,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}


def write(d: Path, fmt: str, shards: int = 1, small: bool = False) -> int:
    d.mkdir(parents=True)
    kw = dict(H=64, I=96, V=101, Vd=40, nh=4, nkv=2, hd=16) if small else {}
    t = tensors("midlayer." if fmt == "sglang" else "layers.0.", **kw)
    (d / "config.json").write_text(json.dumps(config(fmt, **kw)))
    if shards == 1:
        save_file(t, str(d / "model.safetensors"))
    else:
        names, wm = sorted(t), {}
        for i in range(shards):
            f = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({k: t[k] for k in part}, str(d / f))
            wm.update({k: f for k in part})
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


def main():
    import shutil

    sys.path.insert(0, str(ROOT / "src"))
    from specscope.progress import Progress

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    rows = []
    layouts = (("sglang", 1), ("speculators", 1), ("sglang", 2))
    # each layout: ~1 GB of random weights written, then loaded in a fresh process; the shared bar / log lines.
    # No load warning: peak memory does not depend on what else runs, and nothing here is timed
    with tempfile.TemporaryDirectory() as tmp, Progress("drafter layouts", len(layouts), "layout") as prog:
        warm = Path(tmp) / "warm"
        write(warm, "sglang", small=True)
        for fmt, shards in layouts:
            d = Path(tmp) / f"{fmt}-{shards}"
            size = write(d, fmt, shards)
            base, peak, dtype = subprocess.run([sys.executable, "-c", SCRIPT, str(d), str(warm)], env=env, check=True,
                                               capture_output=True, text=True).stdout.split()
            added = int(peak) - int(base)
            rows.append({"layout": fmt, "shards": shards, "file_mb": size / 1e6, "base_mb": int(base) / 1e6,
                         "peak_mb": int(peak) / 1e6, "added_mb": added / 1e6, "ratio": added / size, "dtype": dtype})
            shutil.rmtree(d)
            prog.advance(info=f"{fmt}, {shards} shard{'s' if shards > 1 else ''}")
    print(f"{'layout':<12}{'shards':>7}{'file MB':>10}{'base MB':>10}{'peak MB':>10}{'added/file':>12}  dtype")
    for r in rows:
        print(f"{r['layout']:<12}{r['shards']:>7}{r['file_mb']:>10.0f}{r['base_mb']:>10.0f}{r['peak_mb']:>10.0f}"
              f"{r['ratio']:>12.2f}  {r['dtype']}")
    out = ROOT / "bench" / "results" / "drafter_load_memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"goal": "added <= 1.5 x file size", "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
