"""How fast does `specscope ingest` read engine logs? The goal: dozens of MB of log in seconds.

Generates a log of SGLang scheduler lines and vLLM (V1, data-parallel) throughput / SpecDecoding lines, interleaved
as a combined container log would be, with the noise real logs carry (HTTP access lines), in a temporary directory;
ingests it once per format mix (no registry write: the parse is what is measured) and prints a table.

    .venv/bin/python bench/ingest_speed.py [--mb 50] [--out bench/results/ingest_speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

SG = ("[2025-10-22 {h:02d}:{m:02d}:{s:02d} DP{dp} TP0] Decode batch, #running-req: {run}, #token: {tok}, token usage: "
      "0.{u:02d}, accept len: {al:.2f}, accept rate: {ar:.2f}, cuda graph: True, gen throughput (token/s): {g:.2f}, "
      "#queue-req: {q}")
HTTP = '[2025-10-22 {h:02d}:{m:02d}:{s:02d}] INFO:     127.0.0.1:{port} - "POST /v1/chat/completions HTTP/1.1" 200 OK'
VT = ("(APIServer pid=7) INFO 10-22 {h:02d}:{m:02d}:{s:02d} [loggers.py:123] Engine {e:03d}: Avg prompt throughput: "
      "{p:.1f} tokens/s, Avg generation throughput: {g:.1f} tokens/s, Running: {run} reqs, Waiting: {q} reqs, GPU KV "
      "cache usage: {u:.1f}%, Prefix cache hit rate: {hit:.1f}%")
VS = ("(APIServer pid=7) INFO 10-22 {h:02d}:{m:02d}:{s:02d} [metrics.py:96] SpecDecoding metrics: Mean acceptance "
      "length: {al:.2f}, Accepted throughput: {at:.2f} tokens/s, Drafted throughput: {dt:.2f} tokens/s, Accepted: {a} "
      "tokens, Drafted: {d} tokens, Per-position acceptance rate: {pp}, Avg Draft acceptance rate: {r:.1f}%")


def generate(path: Path, mb: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    target = int(mb * (1 << 20))
    n = size = 0
    with open(path, "w") as f:
        i = 0
        while size < target:
            t = i // 4
            h, m, s = (10 + t // 3600) % 24, (t // 60) % 60, t % 60
            kind = i % 4
            if kind == 0:
                line = SG.format(h=h, m=m, s=s, dp=i % 2, run=rng.randint(0, 64), tok=rng.randint(1000, 90000),
                                 u=rng.randint(0, 99), al=rng.uniform(1.5, 4.0), ar=rng.random(),
                                 g=rng.uniform(50, 4000), q=rng.randint(0, 9))
            elif kind == 1:
                line = HTTP.format(h=h, m=m, s=s, port=rng.randint(30000, 60000))
            elif kind == 2:
                line = VT.format(h=h, m=m, s=s, e=i % 2, p=rng.uniform(0, 900), g=rng.uniform(0, 3000),
                                 run=rng.randint(0, 64), q=rng.randint(0, 9), u=rng.uniform(0, 90),
                                 hit=rng.uniform(0, 90))
            else:
                drafts = rng.randint(100, 2000)
                pp = sorted((rng.random() for _ in range(3)), reverse=True)
                acc = round(sum(pp) * drafts)
                line = VS.format(h=h, m=m, s=s, al=1 + acc / drafts, at=acc / 10, dt=drafts * 0.3, a=acc, d=drafts * 3,
                                 pp=", ".join(f"{x:.3f}" for x in pp), r=100 * acc / (3 * drafts))
            f.write(line + "\n")
            size += len(line) + 1
            n += 1
            i += 1
    return {"lines": n, "bytes": size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=50.0, help="size of the generated log")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ingest_speed.json"))
    args = ap.parse_args(argv)
    from specscope.ingest.core import ingest_file
    from specscope.progress import Progress
    from specscope.registry.fingerprint import timing_warning

    rows = []
    engines = ("auto", "sglang", "vllm")
    # writing the log, then one ingest per --engine: the shared bar on a terminal, lines in a log (stderr)
    with tempfile.TemporaryDirectory() as d, Progress("ingest_speed", 1 + len(engines), "step") as prog:
        path = Path(d) / "sglang_vllm.log"
        t0 = time.perf_counter()
        gen = generate(path, args.mb)
        gen_s = time.perf_counter() - t0
        prog.advance(info="log written")
        for engine in engines:
            t0, c0 = time.perf_counter(), time.process_time()
            s = ingest_file(path, engine=engine, record=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            i = s["results"]["ingest"]
            rows.append({"engine_option": engine, "format": s["format"], "lines": i["lines"],
                         "recognised": sum(i["recognised"].values()), "malformed": i["malformed"],
                         "mb": gen["bytes"] / (1 << 20), "wall_s": wall, "cpu_s": cpu,
                         "lines_per_s": i["lines"] / wall, "lines_per_cpu_s": i["lines"] / cpu,
                         "mb_per_s": gen["bytes"] / (1 << 20) / wall})
            prog.advance(info=f"--engine {engine}")
    print(f"generated {gen['lines']:,} lines, {gen['bytes'] / (1 << 20):.1f} MB in {gen_s:.1f} s")
    print(f"{'--engine':<9} {'lines':>10} {'recognised':>11} {'malformed':>9} {'wall s':>7} {'CPU s':>6} "
          f"{'lines/s':>10} {'lines/CPU s':>11} {'MB/s':>6}")
    for r in rows:
        print(f"{r['engine_option']:<9} {r['lines']:>10,} {r['recognised']:>11,} {r['malformed']:>9} "
              f"{r['wall_s']:>7.2f} {r['cpu_s']:>6.2f} {r['lines_per_s']:>10,.0f} {r['lines_per_cpu_s']:>11,.0f} "
              f"{r['mb_per_s']:>6.1f}")
    out = {"benchmark": "ingest_speed", "generated": gen, "rows": rows,
           "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                       "platform": platform.platform()},
           "note": "one pass each, on a shared machine: wall time includes waiting for the CPU (lines/CPU s is the "
                   "parser's own rate); compare orders of magnitude, not percents",
           "load_warning": timing_warning()}    # the wall times above ran under this machine's load
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    if out["load_warning"]:
        print(out["load_warning"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
