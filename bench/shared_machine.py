"""Decoding on a machine that is not ours alone: each decoder quiet, then beside one busy process per usable core at
our priority, then beside the same processes at nice 19 (issue 51).

    .venv/bin/python bench/shared_machine.py [--tokens 64] [--prompts 4] [--rounds 2] [--dtypes fp32,bf16]
        [--loads quiet,busy,nice19] [--only specscope-plain,specscope-plain-1t,specscope-spec,transformers,llama.cpp,serve]
        [--serve-requests 8] [--out bench/results/shared_machine_<isa>.json]

Decoders, each in a worker process of its own that loads its model once (so one's threads and environment never
touch another's), asked in turn for the same prompts (MT-bench first turns, chat template, greedy, the same token
ids for all), the order alternating per round: specscope plain on --threads (2) and on 1 thread, specscope in the
demo's speculative mode (`smollm2-135m-eagle3+ngram`, priced), transformers `generate` (fp32 only) and llama.cpp
on the same weights (bench/llamacpp.py's GGUF; skipped with a note when llama-cpp-python is not installed), in
each of --dtypes. Then `specscope serve` (fp32, the demo's drafter) at 1 and 4 streaming clients beside the same
loads (bench/serve_load.py's server and clients).

The background load: `while True: pass` in one process per usable core, started before and killed after each
block of runs, at our priority or at nice 19. Every worker gets the caller's environment: transformers and
llama.cpp run with torch's and ggml's own defaults, specscope with its own (its thread pool, `cpuload`'s thread count).
`PYTHONPATH=<another checkout>/src` runs that checkout's specscope in the workers (e.g. the kernels before a change).

Prints tok/s (tokens / wall time per prompt, prefill included, summed over prompts and rounds) and each as a share
of its own quiet speed; checks every specscope output under load against its quiet output (and the speculative
one against plain), and the issue's bars: 2-thread specscope >= 0.40x quiet beside same-priority load and not
slower than its 1-thread decode there, >= 0.85x beside nice-19 load, ahead of transformers and llama.cpp under
each load. One JSON at --out (host ISA in the name); exit 1 if an output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

# the environment as the user set it, before anything here imports specscope: every worker gets it (PYTHONPATH=
# another tree's src runs that tree's specscope, with its own defaults; an older tree set OMP_WAIT_POLICY on import)
USER_ENV = dict(os.environ)
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

METHODS = ("specscope-plain", "specscope-plain-1t", "specscope-spec", "transformers", "llama.cpp")
LOADS = ("quiet", "busy", "nice19")
SPEC_DRAFT = "smollm2-135m-eagle3+ngram"

WORKER = r"""
import json, sys, time
spec = json.load(open(sys.argv[1]))
kind, ids, stop, n = spec["kind"], spec["ids"], set(spec["stop"]), spec["tokens"]
info = {}
if kind == "specscope":
    import specscope   # first: its defaults for torch's OpenMP threads apply only before torch loads
    import torch
    torch.set_num_threads(spec["threads"])
    from specscope import session
    from specscope.generate import generate
    from specscope.models import rowgemm
    from specscope.generate import speculative_generate
    from specscope.speculative.decode import DraftOptions
    target, tok, _ = session.load_target(spec["model"], spec["dtype"], "cpu")
    run_spec = session.decode_spec(spec["model"], DraftOptions(spec["draft"], budget="priced"))
    drafter = run_spec.drafter(target)
    def run(p, k):
        if drafter is None:
            r = generate(target, p, k, None, sorted(stop))
        else:
            r = speculative_generate(target, drafter, p, k, None, sorted(stop), run_spec.shape)
        return r.token_ids
    info = {"isa": rowgemm.isa(), "threads": torch.get_num_threads(), "specscope": specscope.__file__}
elif kind == "transformers":
    import torch, transformers
    torch.set_num_threads(spec["threads"])
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).eval()
    def run(p, k):
        x = torch.tensor([p])
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k, do_sample=False,
                              eos_token_id=sorted(stop), pad_token_id=min(stop))
        return out[0, len(p):].tolist()
    info = {"transformers": transformers.__version__, "threads": torch.get_num_threads()}
else:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=spec["gguf"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          n_ctx=2048, n_batch=512, verbose=False)
    def run(p, k):
        llm.reset()
        out = []
        for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(t)
            if t in stop or len(out) == k:
                break
        return out
    info = {"llama_cpp_python": llama_cpp.__version__, "threads": spec["threads"]}
run(ids[0][:16], 4)                 # first calls pay for allocation and kernel warm-up
print(json.dumps({"ready": True, **info}), flush=True)
for line in sys.stdin:
    per = []
    for p in ids:
        t0 = time.perf_counter()
        toks = run(p, n)
        secs = time.perf_counter() - t0
        cut = next((i for i, t in enumerate(toks) if t in stop), None)
        toks = toks[:cut] if cut is not None else toks
        per.append({"tokens": toks, "seconds": secs})
    print(json.dumps(per), flush=True)
"""


class Worker:
    """One decoder in a process of its own: loads at start, decodes every prompt on each `run()`."""

    def __init__(self, name: str, dtype: str, spec: dict, env: dict):
        self.name, self.dtype = name, dtype
        self.file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(spec, self.file)
        self.file.close()
        self.p = subprocess.Popen([sys.executable, "-c", WORKER, self.file.name], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"the {name} {dtype} worker died while loading (its error is above)")
        self.info = json.loads(line)

    def run(self) -> list[dict]:
        self.p.stdin.write("run\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} {self.dtype} worker died while decoding")
        return json.loads(line)

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)
        os.unlink(self.file.name)


class BusyLoad:
    """One `while True: pass` per usable core, at our priority or at nice 19, for a `with` block."""

    def __init__(self, load: str):
        self.load, self.procs = load, []

    def __enter__(self):
        if self.load != "quiet":
            nice = (lambda: os.nice(19)) if self.load == "nice19" else None
            self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=nice)
                          for _ in range(len(os.sched_getaffinity(0)))]
            time.sleep(0.5)                       # running, not still starting
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def inputs(args) -> dict:
    """The prompts as token ids (our tokenizer, chat template), the stop ids, the HF directory and the GGUFs."""
    from speculative import pick_prompts

    from specscope.models.hub import resolve_model
    from specscope.models.loader import load_config
    from specscope.runtime.tokenizer import Tokenizer

    path = resolve_model(args.model)
    tok = Tokenizer(path)
    ids = [tok.encode(p["prompt"], chat=True) for p in pick_prompts(["mt_bench"], args.prompts, args.prompts)]
    stop = sorted(set(tok.eos_ids) | set(load_config(path)[0].eos_token_id))
    return {"path": str(path), "ids": ids, "stop": stop}


def gguf_for(dtype: str) -> str:
    from llamacpp import f32_gguf

    from specscope.models.hub import KNOWN_MODELS, _package_file, cache_dir

    src = _package_file(KNOWN_MODELS["smollm2-135m"])
    (cache_dir() / "llamacpp").mkdir(parents=True, exist_ok=True)
    kind = "BF16" if dtype == "bf16" else "F32"
    return str(f32_gguf(src, cache_dir() / "llamacpp" / (src.name.rsplit(".", 2)[0] + f".{kind}.gguf"),
                        kind == "BF16"))


def start_workers(args, base: dict, notes: list[str]) -> list[Worker]:
    have_llama = True
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        have_llama = False
    workers = []
    for dtype in args.dtypes:
        for m in args.only:
            if m == "serve":
                continue
            if m == "transformers" and dtype != "fp32":
                continue
            if m == "llama.cpp" and not have_llama:
                if dtype == args.dtypes[0]:
                    notes.append("llama.cpp skipped: llama-cpp-python is not installed (`make bench-llamacpp-deps`)")
                continue
            spec = {**base, "tokens": args.tokens, "dtype": dtype, "model": args.model,
                    "threads": 1 if m == "specscope-plain-1t" else args.threads,
                    "kind": "specscope" if m.startswith("specscope") else m.replace(".", ""),
                    "draft": SPEC_DRAFT if m == "specscope-spec" else None}
            if m == "llama.cpp":
                spec["gguf"] = gguf_for(dtype)
            print(f"loading {m} {dtype}", file=sys.stderr)
            workers.append(Worker(m, dtype, spec, USER_ENV))
    return workers


def decode_all(args, workers: list[Worker]) -> tuple[dict, list]:
    """runs[(method, dtype)][load] = list of per-prompt results over the rounds; and each block's CPU reading."""
    from specscope.cpuload import ContentionMeter

    runs: dict = {(w.name, w.dtype): {ld: [] for ld in args.loads} for w in workers}
    readings = []
    for r in range(args.rounds):
        for load in args.loads:
            order = workers if r % 2 == 0 else workers[::-1]
            with BusyLoad(load), ContentionMeter() as meter:
                for w in order:
                    per = w.run()
                    runs[(w.name, w.dtype)][load].append(per)
                    tps = sum(len(x["tokens"]) for x in per) / sum(x["seconds"] for x in per)
                    print(f"round {r + 1} {load:7s} {w.name:20s} {w.dtype}: {tps:7.2f} tok/s", file=sys.stderr)
            readings.append({"round": r + 1, "load": load,
                             **(meter.result.to_dict() if meter.result else {})})
    return runs, readings


def summarise(args, runs: dict) -> tuple[dict, dict]:
    """{method/dtype: {load: tok/s, share of quiet, outputs identical to quiet}} and the identity checks."""
    summary, same = {}, {}
    for (m, dtype), by_load in runs.items():
        key = f"{m}/{dtype}"
        quiet_out = [x["tokens"] for x in by_load["quiet"][0]] if by_load.get("quiet") else None
        row = {}
        for load, rounds in by_load.items():
            flat = [x for per in rounds for x in per]
            tps = sum(len(x["tokens"]) for x in flat) / max(sum(x["seconds"] for x in flat), 1e-9)
            row[load] = {"tok_per_s": tps, "rounds": len(rounds), "prompts": len(rounds[0]) if rounds else 0,
                         "per_round": [sum(len(x["tokens"]) for x in per) / max(sum(x["seconds"] for x in per), 1e-9)
                                       for per in rounds]}
            if quiet_out is not None and m.startswith("specscope") and load != "quiet":
                row[load]["same_as_quiet"] = all([x["tokens"] for x in per] == quiet_out for per in rounds)
                same[f"{key} {load} output identical to its quiet output"] = row[load]["same_as_quiet"]
        q = row.get("quiet", {}).get("tok_per_s")
        for load in row:
            row[load]["share_of_quiet"] = row[load]["tok_per_s"] / q if q else None
        summary[key] = row
    for dtype in args.dtypes:                   # lossless: the speculative answers are plain decoding's
        a, b = runs.get(("specscope-spec", dtype)), runs.get(("specscope-plain", dtype))
        if a and b and a.get("quiet") and b.get("quiet"):
            same[f"specscope-spec/{dtype} quiet output identical to plain"] = (
                [x["tokens"] for x in a["quiet"][0]] == [x["tokens"] for x in b["quiet"][0]])
    return summary, same


def bars(args, summary: dict) -> dict:
    """The issue's bars, where this run measured what they compare (informational: timings decide no exit code)."""
    out = {}
    for dtype in args.dtypes:
        two, one = summary.get(f"specscope-plain/{dtype}", {}), summary.get(f"specscope-plain-1t/{dtype}", {})
        if "busy" in two and two["busy"]["share_of_quiet"] is not None:
            out[f"{dtype}: 2-thread >= 0.40x quiet beside same-priority load"] = two["busy"]["share_of_quiet"] >= 0.40
        if "busy" in two and "busy" in one:
            out[f"{dtype}: 2-thread not slower than 1-thread beside same-priority load"] = (
                two["busy"]["tok_per_s"] >= one["busy"]["tok_per_s"])
        if "nice19" in two and two["nice19"]["share_of_quiet"] is not None:
            out[f"{dtype}: 2-thread >= 0.85x quiet beside nice-19 load"] = two["nice19"]["share_of_quiet"] >= 0.85
        for other in ("transformers/fp32", f"llama.cpp/{dtype}"):
            for load in args.loads:
                if load in two and load in summary.get(other, {}):
                    out[f"{dtype}: 2-thread ahead of {other} ({load})"] = (
                        two[load]["tok_per_s"] > summary[other][load]["tok_per_s"])
    return out


def two_vs_one(args, summary: dict) -> dict:
    """{dtype: "1.03x (rounds 1.18, 0.98, 0.96)"}: 2-thread over 1-thread decode beside the busy load, pooled and per
    round (each round ran the two side by side under one load: the rounds show the load's noise)."""
    out = {}
    for dtype in args.dtypes:
        two = summary.get(f"specscope-plain/{dtype}", {}).get("busy")
        one = summary.get(f"specscope-plain-1t/{dtype}", {}).get("busy")
        if two and one and one["tok_per_s"]:
            rounds = ", ".join(f"{x / y:.2f}" for x, y in zip(two.get("per_round", []), one.get("per_round", [])))
            out[dtype] = f"{two['tok_per_s'] / one['tok_per_s']:.2f}x (rounds {rounds})"
    return out


def serve_levels(args) -> dict:
    """`specscope serve` (fp32, the demo's drafter, --threads) at 1 and 4 clients under each load."""
    import serve_load

    sa = SimpleNamespace(model=args.model, threads=args.threads, device="cpu", draft=SPEC_DRAFT, start_timeout=300,
                         clients=4, requests=args.serve_requests, max_tokens=args.tokens)
    _, ps = serve_load.prompts(args.serve_requests)
    proc, url = serve_load.start_server(sa, clients=4)
    out = {}
    try:
        for load in args.loads:
            with BusyLoad(load):
                for clients in (1, 4):
                    sa.clients = clients
                    lv = serve_load.load(url, ps, sa)["levels"][0]
                    out[f"{load}/{clients}"] = {k: lv.get(k) for k in ("completed", "failed", "output_throughput",
                                                                      "p50_tpot_ms", "p50_ttft_ms", "p99_itl_ms")}
    finally:
        serve_load.stop_server(proc)
    for key, row in out.items():
        q = out.get("quiet/" + key.split("/")[1], {}).get("output_throughput")
        row["share_of_quiet"] = row["output_throughput"] / q if q and row["output_throughput"] else None
    return out


def print_table(summary: dict, serve: dict | None, loads) -> None:
    head = f"{'decoder':28s}" + "".join(f"{ld + ' tok/s':>15s}{'× quiet':>9s}" for ld in loads) + "  same"
    print(head)
    for key, row in summary.items():
        cells = "".join(f"{row[ld]['tok_per_s']:>15.2f}{row[ld]['share_of_quiet'] or 0:>8.2f}x" if ld in row
                        else f"{'-':>15s}{'-':>9s}" for ld in loads)
        same = [row[ld].get("same_as_quiet") for ld in loads if ld in row]
        print(f"{key:28s}{cells}  {'' if None in same else 'yes' if all(same) else 'NO'}")
    for key, row in (serve or {}).items():
        print(f"serve {key:>12s} clients: {row['output_throughput'] or 0:7.2f} out tok/s "
              f"({row['share_of_quiet'] or 0:.2f}x quiet), p50 TPOT {row['p50_tpot_ms'] or 0:.1f} ms, "
              f"{row['failed']} failed")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--prompts", type=int, default=4, help="MT-bench first turns, spread over its categories")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--only", default=",".join(METHODS + ("serve",)))
    ap.add_argument("--serve-requests", type=int, default=8, help="requests per serve level")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.loads = [ld for ld in args.loads.split(",") if ld]
    args.only = [m for m in args.only.split(",") if m]
    bad = ([d for d in args.dtypes if d not in ("fp32", "bf16")] + [ld for ld in args.loads if ld not in LOADS]
           + [m for m in args.only if m not in METHODS + ("serve",)])
    if bad or min(args.tokens, args.prompts, args.rounds, args.threads) < 1:
        ap.error(f"unknown {bad}" if bad else "--tokens, --prompts, --rounds and --threads must be >= 1")
    if "quiet" not in args.loads:
        args.loads.insert(0, "quiet")             # every share is of the quiet speed
    return args


def main(argv=None) -> None:
    args = parse(argv)
    from specscope.registry.fingerprint import collect

    notes: list[str] = []
    workers = start_workers(args, inputs(args), notes)
    try:
        runs, readings = decode_all(args, workers) if workers else ({}, [])
    finally:
        for w in workers:
            w.close()
    serve = serve_levels(args) if "serve" in args.only else None
    summary, same = summarise(args, runs)
    isa = next((w.info.get("isa") for w in workers if w.info.get("isa")), None) or "off"
    out = args.out or ROOT / "bench" / "results" / f"shared_machine_{isa}.json"
    res = {"what": "decode tok/s quiet and beside one busy process per usable core (same priority, nice 19)",
           "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "spec_draft": SPEC_DRAFT,
                      "user_omp_wait_policy": USER_ENV.get("OMP_WAIT_POLICY"), "row_kernels": isa},
           "workers": {f"{w.name}/{w.dtype}": w.info for w in workers}, "notes": notes,
           "summary": summary, "serve": serve, "identical": same, "bars": bars(args, summary),
           "two_threads_over_one_busy": two_vs_one(args, summary),
           "cpu_readings": readings, "env": collect(),
           "per_run": {f"{m}/{d}": v for (m, d), v in runs.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    print_table(summary, serve, args.loads)
    for k, v in {**same, **res["bars"]}.items():
        print(f"  {'ok ' if v else 'FAIL'} {k}")
    for dtype, ratio in res["two_threads_over_one_busy"].items():
        print(f"  {dtype}: 2-thread over 1-thread beside same-priority load: {ratio}")
    for n in notes:
        print(f"note: {n}")
    print(f"wrote {out}")
    sys.exit(0 if all(same.values()) else 1)


if __name__ == "__main__":
    main()
