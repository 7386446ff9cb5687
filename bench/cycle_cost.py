"""The speculative cycle at the hardware's cost: decode vs the memory floor, verify T(n)/T(1), drafter steps.

One process, side by side: the memory bandwidth this machine streams (the floor: bytes a decode step must read /
that bandwidth), one decode step, verify forwards of n = 1, 2, 4, 8, 12, 16 tokens (a chain mask over a context of
`--context` cached tokens; T(1) is the decode step), and the EAGLE-3 drafter's steps timed by the cycle profiler's
draft.stepK rows (draft.step0 = catch-up on the accepted tokens, then one row per chain step / topk rows per tree
level). Rounds are interleaved and medians kept, so a noisy machine hurts every column alike. On CPU the same
forwards also run in bf16 through our kernels (`--dtype bf16` as the CLI runs it: weights and each linear's input
rounded to bf16, its KV cache bf16, fp32 accumulation; `--no-bf16` skips it), the same bf16 model over an fp32 KV
cache (what the bf16 cache and its vdpbf16ps attention buy), and with the stock oneDNN path in fp32 and torch's bf16
(`--no-stock` skips those): every column in one table, each against its own floor (bf16 streams half the bytes).

The floor is sampled in every round, right before that round's forwards. A shared VM's bandwidth swings (30 to 53
GB/s within a minute on the 2-core AVX-512 VM of 2026-12-02), so decode is compared with the floor two ways: per
round (that round's floor over that round's decode, median over rounds: like with like, the headline) and against
the best read of the whole run (a peak beside a median: the conservative one).

    # CPU, the demo model (SmolLM2-135M fp32 + the shipped drafter), 2 threads (~1 min):
    .venv/bin/python bench/cycle_cost.py
    # CUDA, random weights of the Llama-3.1-8B shape in bf16 (< 3 min on one H200; no downloads):
    python bench/cycle_cost.py --device cuda --shape llama-3.1-8b

Writes bench/results/cycle_cost_<isa>.json on CPU (isa: the row kernels' instruction set here -- avx512_bf16,
avx512, avx2, neon; `SPECSCOPE_KERNELS=avx512` on an AVX512_BF16 host measures bf16 widened to fp32 FMAs,
`SPECSCOPE_KERNELS=avx2` the AVX2 path) or bench/results/cycle_cost_<shape>_cuda.json.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

ROWS = (1, 2, 4, 8, 12, 16)
# random-weight shapes (no download): target config + an EAGLE-3 drafter of the published layout for it
SHAPES = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=8192, draft_vocab=32000),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
                         draft_vocab=8192),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=2048, draft_vocab=128),   # smoke test of this script
}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---- models ----------------------------------------------------------------------------------------------------
def row_bf16(device, dtype, kernel: str) -> bool:
    """bf16 through our kernels (fp32 tensors of bf16 values, bf16 linears), as load_model places it on CPU."""
    from specscope.models import rowgemm

    return device.type == "cpu" and dtype == torch.bfloat16 and kernel == "auto" and rowgemm.available()


def random_target(shape: str, device, dtype, kernel: str):
    from specscope.models.config import ModelConfig
    from specscope.models.linear import pack_linears
    from specscope.models.loader import round_to_bf16
    from specscope.models.llama import Transformer
    from specscope.models.rope import rope_table

    spec = {k: v for k, v in SHAPES[shape].items() if k != "draft_vocab"}
    cfg = ModelConfig(**spec)
    with torch.device("meta"):
        m = Transformer(cfg)
    ours_bf16 = row_bf16(device, dtype, kernel)
    m = m.to_empty(device=device).to(torch.float32 if ours_bf16 else dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0)
    if cfg.tie_word_embeddings:
        m.lm_head.weight = m.embed_tokens.weight
    m.rope = rope_table(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling).to(device)
    m.eval().requires_grad_(False)
    if ours_bf16:
        round_to_bf16(m)
    if device.type == "cpu":
        pack_linears(m, kernel=kernel, precision=m.precision or "fp32")
    return m


def random_drafter(shape: str, target, kernel: str):
    from specscope.speculative.eagle3 import DrafterConfig, Eagle3Drafter
    from specscope.models.rope import rope_table

    tc = target.config
    cfg = DrafterConfig(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                        head_dim=tc.head_dim, vocab_size=tc.vocab_size, draft_vocab_size=SHAPES[shape]["draft_vocab"],
                        target_hidden_size=tc.hidden_size,
                        aux_layer_ids=DrafterConfig.default_aux_layers(tc.num_hidden_layers),
                        rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
                        max_position_embeddings=tc.max_position_embeddings)
    with torch.device("meta"):
        d = Eagle3Drafter(cfg)
    d = d.to_empty(device=target.device).to(target.dtype)
    g = torch.Generator(device=target.device).manual_seed(1)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0)
        d.d2t.zero_()
        d.t2d.zero_()
        d.t2d[:cfg.draft_vocab_size] = True
    d.rope = rope_table(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, None).to(target.device)
    d.eval().requires_grad_(False)
    place_drafter(d, target, kernel)
    return d


def place_drafter(d, target, kernel: str):
    """On CPU: the drafter in the target's precision, its linears on the target's kernels (as build_drafter does)."""
    from specscope.models.linear import pack_linears
    from specscope.models.loader import round_to_bf16

    if target.device.type != "cpu":
        return
    if target.precision == "bf16":
        round_to_bf16(d)
    pack_linears(d, keep_dense=(), kernel=kernel, precision=target.precision or "fp32")


def load(args, device, dtype, kernel: str):
    """(target, EAGLE-3 drafter module, what) for --shape (random) or --model (a checkpoint + --draft)."""
    if args.shape:
        t = random_target(args.shape, device, dtype, kernel)
        return t, random_drafter(args.shape, t, kernel), f"{args.shape} (random weights)"
    from specscope.models import load_model
    from specscope.models.hub import resolve_model
    from specscope.models.linear import pack_linears
    from specscope.speculative.decode import ASSETS
    from specscope.speculative.formats import load_drafter

    if row_bf16(device, dtype, kernel):   # as the CLI loads --dtype bf16
        t = load_model(resolve_model(args.model), dtype=dtype, device=device)
    else:
        t = load_model(resolve_model(args.model), dtype=dtype, device=device, pack=False)
        if device.type == "cpu":
            pack_linears(t, kernel=kernel)
    path = ASSETS / args.draft if (ASSETS / args.draft).exists() else Path(args.draft)
    d = load_drafter(path, target=t)
    place_drafter(d, t, kernel)
    return t, d, args.model


def weight_bytes(model) -> int:
    """Bytes one decode step reads: every linear weight once (the tied lm_head counts once; the embedding row is
    negligible)."""
    from specscope.models.linear import PackedLinear

    def nbytes(m):   # a bf16-exact weight packed for our kernels streams as bf16 (models/rowgemm.is_bf16_exact)
        rg = getattr(m, "rg", None)
        return m.in_features * m.out_features * (rg.element_size() if rg is not None else model.dtype.itemsize)

    return sum(nbytes(m) for m in model.modules() if isinstance(m, (PackedLinear, torch.nn.Linear)))


def kv_bytes(model, context: int, cache) -> int:
    c = model.config
    el = cache.k.element_size()   # the bf16 precision keeps a bf16 cache in an fp32 model
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context * el


# ---- measurements ----------------------------------------------------------------------------------------------
class Bandwidth:
    """GB/s this machine streams: a pure read (sum of a buffer far past the caches) and, on CPU, the 1-row linear
    kernels on a weight of that size. Sampled once per round between the forwards; the best defines the floor."""

    def __init__(self, device, dtype):
        self.dev = device
        self.nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
        buf = torch.empty(self.nbytes // dtype.itemsize, dtype=dtype, device=device).normal_()
        self.fns = {"read (sum)": lambda: buf.sum()}
        if device.type == "cuda":   # a copy reads and writes: count both
            half = buf[: buf.numel() // 2]
            other = buf[buf.numel() // 2:]
            self.fns["copy"] = lambda: other.copy_(half)
        if device.type == "cpu":
            from specscope.models import rowgemm, tuning

            W = buf.view(-1, 2048)
            x = torch.randn(1, 2048).to(dtype)
            if rowgemm.available() and dtype == torch.float32:
                plan = tuning.default_plan(*W.shape)   # untuned: tuning a 256 MB weight would take minutes
                nb, rb = plan["nb"], tuning.rb_for(plan, 1)
                p = rowgemm.pack(W, nb)
                self.fns["rowgemm 1-row"] = lambda: rowgemm.gemm(x, p, nb, W.shape[0], None, rb)
            if dtype in (torch.float32, torch.bfloat16):
                P = torch.ops.mkldnn._reorder_linear_weight(W, None)
                self.fns["oneDNN 1-row"] = lambda: torch.ops.mkldnn._linear_pointwise(x, P, None, "none", [], "")
        self.best = {k: 0.0 for k in self.fns}

    def sample(self) -> float:
        """One read per method; returns this round's best GB/s."""
        now = 0.0
        for k, fn in self.fns.items():
            sync(self.dev)
            t = time.perf_counter()
            fn()
            sync(self.dev)
            gbps = self.nbytes / (time.perf_counter() - t) / 1e9
            self.best[k] = max(self.best[k], gbps)
            now = max(now, gbps)
        return now

    def result(self) -> dict:
        return {k: round(v, 2) for k, v in self.best.items()}


class Forwards:
    """Decode and chain-verify forwards of one target at a fixed context (nothing committed: repeatable)."""

    def __init__(self, target, context: int, aux=(), kv_dtype=None):
        from specscope.runtime.kv_cache import KVCache
        from specscope.speculative.tree import DraftTree

        self.t, self.dev, self.aux = target, target.device, aux
        V = target.config.vocab_size
        n = context + max(ROWS) + 1
        self.cache = target.new_cache(n) if kv_dtype is None else KVCache.for_model(target.config, n, 1, self.dev,
                                                                                     kv_dtype)
        g = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(3, V, (1, context), generator=g).to(self.dev)
        with torch.inference_mode():
            for s in range(0, context, 256):   # prefill in chunks (the CPU prefill of 1k+ tokens is slow)
                e = min(context, s + 256)
                target(ids[:, s:e], torch.arange(s, e, device=self.dev)[None], self.cache, logits_idx=[e - s - 1])
        self.cache.length = context
        self.L = context
        self.tok = torch.tensor([[int(ids[0, -1])]], device=self.dev)
        self.pos1 = torch.tensor([[context]], device=self.dev)
        self.verify = {}
        for n in ROWS:
            tree = DraftTree.chain(torch.randint(3, V, (n - 1,), generator=g).tolist(), device=self.dev)
            self.verify[n] = tree.verify_inputs(int(ids[0, -1]), context, context)

    def decode(self) -> float:
        with torch.inference_mode():
            sync(self.dev)
            t = time.perf_counter()
            out = self.t(self.tok, self.pos1, self.cache)
            int(out.logits[0, -1].argmax())
            return (time.perf_counter() - t) * 1e3

    def verify_ms(self, n: int) -> float:
        ids, pos, slots, mask = self.verify[n]
        with torch.inference_mode():
            sync(self.dev)
            t = time.perf_counter()
            out = self.t(ids, pos, self.cache, slots, mask, aux_layers=self.aux)
            out.logits[0].argmax(-1).tolist()
            return (time.perf_counter() - t) * 1e3


def time_forwards(fws: dict, rounds: int, bw: Bandwidth, warmup: int = 2) -> tuple[dict, dict]:
    """{label: {"decode": ms, n: ms}} medians over interleaved rounds (a bandwidth sample before each), and the
    rounds themselves: {"gbps": [...], label: [decode ms, ...], "verify": {label: {n: [ms, ...]}}} in round order."""
    samples = {lab: {k: [] for k in ("decode", *ROWS)} for lab in fws}
    per_round = {"gbps": []}
    from specscope.progress import Progress

    with Progress("rounds", warmup + rounds, "round", every_s=30) as prog:   # the shared bar / log lines
        for r in range(warmup + rounds):
            gbps = bw.sample()
            if r >= warmup:
                per_round["gbps"].append(gbps)
            for lab, fw in fws.items():
                d = fw.decode()
                v = {n: fw.verify_ms(n) for n in ROWS}
                if r >= warmup:
                    samples[lab]["decode"].append(d)
                    for n in ROWS:
                        samples[lab][n].append(v[n])
            prog.advance()
    for lab in fws:
        per_round[lab] = samples[lab]["decode"]
    per_round["verify"] = {lab: {n: samples[lab][n] for n in ROWS} for lab in fws}
    return {lab: {k: statistics.median(v) for k, v in s.items()} for lab, s in samples.items()}, per_round


def paired_ratios(verify: dict) -> dict:
    """{n: median over rounds of that round's T(n) / T(1)}: each ratio from forwards timed back to back, so a
    machine that drifts between rounds (this VM's bandwidth moves 40-75 GB/s) moves both sides of it."""
    return {n: statistics.median(a / b for a, b in zip(verify[n], verify[1])) for n in ROWS}


def paired_fraction(step_bytes: int, gbps: list[float], decode_ms: list[float]) -> float:
    """Median over rounds of (that round's floor ms / that round's decode ms)."""
    return statistics.median(step_bytes / g / 1e6 / d for g, d in zip(gbps, decode_ms))


def drafter_steps(target, dmodel, context: int, rounds: int, topk: int, steps: int = 4) -> dict:
    """Profiler rows of EAGLE-3 drafting in steady state: catch-up on 3 accepted tokens, then `steps - 1` levels.

    The drafter is brought to a committed state once (prompt catch-up, one verify, 3 rows committed); each round
    proposes from that state and rewinds it, so every round does identical work. A verify forward (untimed) runs
    between rounds, as in a real cycle: it evicts the drafter's weights from the caches."""
    from specscope.runtime.sampling import SamplingParams
    from specscope.profile.cycle import CycleProfiler
    from specscope.speculative.decode import SpecConfig
    from specscope.speculative.drafters import Eagle3TreeDrafter
    from specscope.speculative.tree import DraftTree

    dev = target.device
    V = target.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(2)
    prompt = torch.randint(3, V, (context,), generator=g).tolist()
    dr = Eagle3TreeDrafter(dmodel, target)
    cfg = SpecConfig(steps, topk, min(steps * topk, 1 + topk + (steps - 1) * topk * topk))
    prof = CycleProfiler(str(dev), sync=dev.type == "cuda")
    with torch.inference_mode():
        cache = target.new_cache(context + 64)
        ids = torch.tensor([prompt], device=dev)
        out = target(ids, torch.arange(context, device=dev)[None], cache, aux_layers=dr.aux_layers)
        cache.length = context
        root = int(out.logits[0, -1].argmax())
        dr.start(prompt, root, out, context + 64 + steps * topk * 2)
        dr.propose(cfg, SamplingParams(), None)                      # catch up on the prompt
        chain = DraftTree.chain([5, 6], device=dev)
        v_ids, v_pos, v_slots, v_mask = chain.verify_inputs(root, context, context)
        vout = target(v_ids, v_pos, cache, v_slots, v_mask, aux_layers=dr.aux_layers)
        dr.commit([0, 1, 2], vout, [5, 6, 7])
        committed, pending = dr.committed, (dr.pending_tokens, dr.pending_aux)
        for r in range(rounds + 2):
            dr.pending_tokens, dr.pending_aux = pending   # the same catch-up every round (propose consumes it)
            if r == 2:
                prof = CycleProfiler(str(dev), sync=dev.type == "cuda")   # drop the warm-up rounds
            with prof.phase("draft"):
                dr.propose(cfg, SamplingParams(), None, prof)
            prof.end_cycle(1)
            dr.committed = committed
            dr.cache.truncate(committed)
            target(v_ids, v_pos, cache, v_slots, v_mask)
    ph = prof.summary()["phases"]
    out = {"catch_up_ms": ph["draft.step0"]["median_ms"],
           "level_ms": [ph[f"draft.step{i}"]["median_ms"] for i in range(1, steps) if f"draft.step{i}" in ph],
           "propose_ms": ph["draft"]["median_ms"]}
    out["per_level_ms"] = round(statistics.median(out["level_ms"]), 3) if out["level_ms"] else None
    return out


# ---- report ----------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this shape instead of --model")
    ap.add_argument("--model", default="smollm2-135m", help="known model name or HF directory (default: demo model)")
    ap.add_argument("--draft", default="smollm2-135m-eagle3", help="EAGLE-3 drafter for --model")
    ap.add_argument("--dtype", default=None, help="fp32 (CPU default) or bf16 (CUDA default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=None, help="cached tokens (default 256 CPU, 1024 CUDA)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15 CPU, 30 CUDA)")
    ap.add_argument("--no-stock", action="store_true", help="CPU: skip the stock oneDNN columns")
    ap.add_argument("--no-bf16", action="store_true", help="CPU: skip the bf16 columns")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but this torch build cannot use CUDA; run it on the GPU machine or use "
                 "--device cpu")
    if device.type == "cuda" and not args.shape:
        sys.exit("error: --device cuda needs --shape (random weights; e.g. --shape llama-3.1-8b)")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[args.dtype]
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    context = args.context or (1024 if device.type == "cuda" else 256)
    rounds = args.rounds or (30 if device.type == "cuda" else 15)
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    t_start = time.perf_counter()

    from specscope.models import rowgemm

    ours = device.type == "cpu" and rowgemm.available()
    # columns: (label, linear kernel, dtype); the first is the headline (its drafter prices the 3-chain cycle)
    # (label, linear kernel, dtype, KV cache dtype: None = the model's own)
    specs = [(f"ours ({rowgemm.isa()})" if ours and dtype == torch.float32
              else f"ours bf16 ({rowgemm.isa()})" if ours and dtype == torch.bfloat16
              else ("cuBLAS" if device.type == "cuda" else "stock"), "auto", dtype, None)]
    if ours and dtype == torch.float32 and not args.no_bf16:
        specs += [("ours bf16", "auto", torch.bfloat16, None), ("bf16, fp32 KV", "auto", torch.bfloat16, torch.float32)]
    if ours and dtype == torch.float32 and not args.no_stock:
        specs.append(("stock oneDNN", "onednn", torch.float32, None))
        if not args.no_bf16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            specs.append(("stock bf16", "onednn", torch.bfloat16, None))
    models, fws, loaded = {}, {}, {}
    for lab, k, dt, kv in specs:
        if (k, dt) not in loaded:   # the fp32-KV column reuses the bf16 model: only its cache differs
            loaded[k, dt] = load(args, device, dt, k)
        models[lab] = loaded[k, dt]
        t, d, what = models[lab]
        fws[lab] = Forwards(t, context, d.aux_layers, kv_dtype=kv)
    cols = list(fws)
    target, dmodel, what = models[cols[0]]
    bwm = Bandwidth(device, dtype)
    times, per_round = time_forwards(fws, rounds, bwm)
    bw = bwm.result()
    del bwm
    gbps = max(bw.values())
    # each column against the bytes its own decode step must read (bf16 weights: half)
    step = {c: weight_bytes(models[c][0]) + kv_bytes(models[c][0], context, fws[c].cache) for c in cols}
    step_bytes = step[cols[0]]
    floor = {c: step[c] / gbps / 1e6 for c in cols}
    floor_ms = floor[cols[0]]
    paired = {c: paired_fraction(step[c], per_round["gbps"], per_round[c]) for c in cols}
    ratios = {c: paired_ratios(per_round["verify"][c]) for c in cols}
    floor_med = statistics.median(per_round["gbps"])
    drafts = {}
    for lab in cols:
        t, d, _ = models[lab]
        same = next((c for c in drafts if models[c] is models[lab]), None)   # the fp32-KV column: its model's
        drafts[lab] = drafts[same] if same else {"chain": drafter_steps(t, d, context, rounds, topk=1),
                                                 "tree_topk4": drafter_steps(t, d, context, rounds, topk=4)}

    print(f"{what} · {dtype} · {device}{'' if device.type == 'cuda' else f' · {args.threads} threads'} · "
          f"context {context} · load {load0[0]:.1f}" + (f" · bf16 linears: {rowgemm.bf16_method()}"
                                                        if any(c.startswith("ours bf16") for c in cols) else ""))
    print(f"memory floor: {step_bytes / 1e6:.0f} MB per decode step at {gbps:.1f} GB/s, the best read "
          f"({', '.join(f'{k} {v}' for k, v in bw.items())}) = {floor_ms:.2f} ms; per round median "
          f"{floor_med:.1f} GB/s (range {min(per_round['gbps']):.1f}-{max(per_round['gbps']):.1f})"
          + "".join(f"; {c}: {step[c] / 1e6:.0f} MB = {floor[c]:.2f} ms" for c in cols[1:] if step[c] != step_bytes))
    print(f"{'':46s}" + "".join(f"{c:>16s}" for c in cols))
    print(f"{'decode ms/token':46s}" + "".join(f"{times[c]['decode']:16.2f}" for c in cols))
    print(f"{'  speed vs ' + cols[0] + (' (bf16 goal >= 1.7)' if 'ours bf16' in cols else ''):46s}"
          + "".join(f"{times[cols[0]]['decode'] / times[c]['decode']:16.2f}" for c in cols))
    print(f"{'  floor / decode, same round (goal >= 0.85)':46s}" + "".join(f"{paired[c]:16.2f}" for c in cols))
    print(f"{'  floor at the best read / decode':46s}" + "".join(f"{floor[c] / times[c]['decode']:16.2f}" for c in cols))
    print(f"{'  achieved GB/s':46s}" + "".join(f"{step[c] / times[c]['decode'] / 1e6:16.1f}" for c in cols))
    for n in ROWS:
        print(f"{f'verify T({n}) ms':46s}" + "".join(f"{times[c][n]:16.2f}" for c in cols))
    for n in ROWS[1:]:
        goal = {4: " (goal <= 1.05)", 8: " (goal <= 1.15; bf16 1.10)"}.get(n, "")
        print(f"{f'  T({n})/T(1), same round{goal}':46s}" + "".join(f"{ratios[c][n]:16.2f}" for c in cols))
    print(f"{'  T(8)/T(1), of the medians':46s}" + "".join(f"{times[c][8] / times[c][1]:16.2f}" for c in cols))
    print(f"{'  T(8)/decode':46s}" + "".join(f"{times[c][8] / times[c]['decode']:16.2f}" for c in cols))
    for key, name in (("chain", "chain step"), ("tree_topk4", "tree level (topk 4)")):
        goal = " (goal <= 3)" if key == "chain" else " (goal <= 4)"
        print(f"{f'drafter ms per {name}{goal}':46s}" + "".join(f"{drafts[c][key]['per_level_ms']:16.2f}"
                                                                for c in cols))
        print(f"{f'  catch-up on 3 tokens ({key})':46s}" + "".join(f"{drafts[c][key]['catch_up_ms']:16.2f}"
                                                                 for c in cols))
    print(f"{'drafter chain step / decode (goal <= 0.06)':46s}"
          + "".join(f"{drafts[c]['chain']['per_level_ms'] / times[c]['decode']:16.3f}" for c in cols))
    c0 = cols[0]
    cyc = 3 * drafts[c0]["chain"]["per_level_ms"] + drafts[c0]["chain"]["catch_up_ms"] + times[c0][4]
    print(f"3-chain cycle ≈ catch-up + 3 steps + T(4) = {cyc:.1f} ms = {cyc / times[c0]['decode']:.2f} decode steps "
          f"(break-even τ; speed-up at τ 3.0 ≈ {3.0 * times[c0]['decode'] / cyc:.2f}x)")

    from specscope.jsonio import dtype_name
    from specscope.models.loader import compute_dtype

    res = {"what": what, "device": str(device), "dtype": dtype_name(dtype), "threads": args.threads,
           "context": context, "rounds": rounds, "torch": torch.__version__,
           "linear_kernel": {"rowgemm_available": rowgemm.available() if device.type == "cpu" else None,
                             "isa": rowgemm.isa() if device.type == "cpu" else None,
                             "cpu_has_avx512f": "avx512f" in rowgemm.cpu_flags(),
                             "columns": cols},
           "bf16_linears": rowgemm.bf16_method() if any(c.startswith("ours bf16") for c in cols) else None,
           "memory_floor": {"bytes_per_step": step_bytes, "gb_per_s": bw, "floor_ms": round(floor_ms, 3),
                            "gb_per_s_by_round": [round(g, 2) for g in per_round["gbps"]]},
           "columns": {c: {"dtype": dtype_name(compute_dtype(models[c][0])),
                           "bytes_per_step": step[c], "floor_ms": round(floor[c], 3),
                           "decode_ms": round(times[c]["decode"], 3),
                           "speed_vs_first": round(times[cols[0]]["decode"] / times[c]["decode"], 3),
                           "floor_fraction": round(floor[c] / times[c]["decode"], 3),       # vs the best read
                           "floor_fraction_same_round": round(paired[c], 3),               # median of per-round
                           "decode_ms_by_round": [round(d, 3) for d in per_round[c]],
                           "verify_ms": {str(n): round(times[c][n], 3) for n in ROWS},
                           "verify_ratio": {str(n): round(times[c][n] / times[c][1], 3) for n in ROWS},
                           "verify_ratio_same_round": {str(n): round(ratios[c][n], 3) for n in ROWS},
                           "verify_ms_by_round": {str(n): [round(v, 3) for v in per_round["verify"][c][n]]
                                                  for n in ROWS},
                           "drafter": drafts[c]} for c in cols},
           "three_chain_cycle_ms": round(cyc, 2),
           "loadavg_before": load0, "loadavg_after": os.getloadavg(),
           "seconds": round(time.perf_counter() - t_start, 1)}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)
    try:
        from specscope.registry.fingerprint import collect

        res["env"] = collect()
    except Exception as e:  # the bench result matters more than its fingerprint
        res["env"] = {"error": str(e)}
    from specscope.registry.fingerprint import timing_warning

    # recorded with the numbers, as the other benches do: these timings ran under this load
    res["load_warning"] = timing_warning(res["env"] if "cpu" in res["env"] else None)
    bf16_only = "bf16_" if device.type == "cpu" and dtype == torch.bfloat16 else ""   # --dtype bf16: its own file
    out = args.out or (ROOT / "bench" / "results" / (f"cycle_cost_{bf16_only}{rowgemm.isa() or 'onednn'}.json"
                                                     if device.type == "cpu" else f"cycle_cost_{args.shape}_cuda.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}; {res['seconds']} s; wrote {out}")
    if res["load_warning"]:
        print(res["load_warning"], file=sys.stderr)


if __name__ == "__main__":
    main()
