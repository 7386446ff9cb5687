"""Peak resident memory of `specscope train --stages train`, today's code against the code as of a base revision
(default 0edc481, before issue 24: the whole fp32 target loaded and every captured shard opened in memory), on the
same work directory: the real SmolLM2-135M-Instruct target (`specscope models pull smollm2-135m`), 1,200 captured
sequences of 273 tokens (the shipped chat fine-tune's mean length; 328k tokens, ~1.4 GB of features), one full
epoch (the base maps its shards lazily, so its features become resident as the epoch reads them: a few steps would
hide them), batch 32, TTT K = 1 (cheap steps; the activations of one batch are the same in both runs and are most
of what is left today: at batch 8 and K = 5 they are ~2 GB). The features are synthetic (random fp16 of the shapes
capture writes): memory depends on their shapes, not their values, and capturing real ones costs minutes of CPU.
Each run is a fresh process; its peak RSS is the kernel's ru_maxrss from wait4. Goal: today <= 0.5 x base. Prints
a table and writes bench/results/train_memory.json (~1.5 GB of scratch disk, a few minutes on 2 cores).

    .venv/bin/python bench/train_memory.py [--base-rev 0edc481] [--sequences 1200] [--tokens 273]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


def synthetic_capture(out: Path, model_dir: Path, n: int, T: int, shard_size: int = 64) -> dict:
    """A data directory in the capture format (manifest.json + safetensors shards) with random features, under the
    shared progress over shards (~1.4 GB of random fp16 takes a while)."""
    from specscope.models.loader import load_config
    from specscope.progress import Progress
    from specscope.speculative.eagle3 import DrafterConfig

    cfg, _ = load_config(model_dir)
    H, V = cfg.hidden_size, cfg.vocab_size
    aux = DrafterConfig.default_aux_layers(cfg.num_hidden_layers)
    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    shards = []
    with Progress("synthetic features", -(-n // shard_size), "shard") as prog:
        for si in range(0, n, shard_size):
            k = min(shard_size, n - si)
            mask = torch.ones(k, T, dtype=torch.uint8)
            mask[:, :T // 8] = 0                                   # a user turn, then the assistant's
            t = {"aux": torch.randn(k * T, 3, H, generator=g).half(),
                 "hidden": torch.randn(k * T, H, generator=g).half(),
                 "argmax": torch.randint(0, V, (k * T,), generator=g, dtype=torch.int32),
                 "input_ids": torch.randint(0, V, (k * T,), generator=g, dtype=torch.int32),
                 "loss_mask": mask.flatten(), "offsets": torch.arange(0, (k + 1) * T, T, dtype=torch.int64)}
            name = f"shard-{si // shard_size:05d}.safetensors"
            save_file(t, str(out / name))
            shards.append({"index": si // shard_size, "file": name, "conversations": k, "sequences": k,
                           "tokens": k * T, "loss_tokens": int(mask.sum())})
            prog.advance()
    man = {"version": 1, "aux_layers": aux, "aux_convention": "input", "hidden_size": H, "vocab_size": V,
           "target": {}, "shard_size": shard_size, "shards": shards, "skipped": 0,
           "sequences": n, "tokens": n * T, "loss_tokens": sum(s["loss_tokens"] for s in shards)}
    (out / "manifest.json").write_text(json.dumps(man))
    return man


def run(src: Path, args: list[str]) -> dict:
    """`python -m specscope ARGS` with `src` first on the path, in a fresh process: peak RSS and wall time."""
    env = dict(os.environ, PYTHONPATH=str(src), SPECSCOPE_TRACEBACK="1")
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "specscope", *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    _, status, ru = os.wait4(p.pid, 0)
    out, err = p.stdout.read(), p.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"`specscope {' '.join(args)}` from {src} failed:\n{err[-3000:]}")
    return {"peak_rss_mb": round(ru.ru_maxrss / 1024, 1), "wall_s": round(time.perf_counter() - t0, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-rev", default="0edc481")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sequences", type=int, default=1200)
    ap.add_argument("--tokens", type=int, default=273)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--ttt-steps", type=int, default=1)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from specscope.models.hub import resolve_model
    from specscope.progress import Progress
    from specscope.registry.fingerprint import timing_warning

    model_dir = resolve_model(a.model)
    with tempfile.TemporaryDirectory(prefix="train-memory-") as tmp:
        tmp = Path(tmp)
        base_src = tmp / "base"
        base_src.mkdir()
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", a.base_rev, "src"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(base_src)], input=tar.stdout, check=True)
        man = synthetic_capture(tmp / "data", model_dir, a.sequences, a.tokens)
        feature_mb = sum((tmp / "data" / s["file"]).stat().st_size for s in man["shards"]) / 2 ** 20
        common = ["--model", a.model, "--device", "cpu", "--threads", "2", "--no-progress"]
        vocab = tmp / "vocab"
        vocab.mkdir()
        os.symlink(tmp / "data", vocab / "data")
        steps = a.sequences // a.batch_size                 # one epoch (the base has no --num-epochs)
        train_args = ["--stages", "train", "--max-train-steps", str(steps), "--batch-size", str(a.batch_size),
                      "--ttt-steps", str(a.ttt_steps), "--max-len", "1024", "--eval-fraction", "0", *common]
        rows = {}
        with Progress("specscope train runs", 3, "run") as prog:      # each a fresh process, minutes long
            run(ROOT / "src", ["train", "--workdir", str(vocab), "--stages", "vocab", *common])
            prog.advance(info="vocab")
            for label, src in (("base", base_src / "src"), ("today", ROOT / "src")):
                w = tmp / f"work-{label}"
                w.mkdir()
                os.symlink(tmp / "data", w / "data")
                shutil.copy(vocab / "vocab.pt", w / "vocab.pt")
                rows[label] = run(src, ["train", "--workdir", str(w), *train_args])
                prog.advance(info=label)
    ratio = rows["today"]["peak_rss_mb"] / rows["base"]["peak_rss_mb"]
    result = {"bench": "train_memory", "command": f"specscope train --workdir W {' '.join(train_args)}",
              "model": a.model, "features": {"synthetic": True, "sequences": a.sequences,
                                             "tokens": a.sequences * a.tokens, "file_mb": round(feature_mb, 1)},
              "base_rev": a.base_rev, "runs": rows, "ratio_today_over_base": round(ratio, 3), "goal": "<= 0.5",
              "met": ratio <= 0.5, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "load_warning": timing_warning()}     # peak RSS does not depend on the load; the wall times do
    print(f"specscope train --stages train, {a.model}, {a.sequences} x {a.tokens} tokens of features "
          f"({feature_mb:.0f} MB on disk), one epoch of {steps} steps at batch {a.batch_size}, K = {a.ttt_steps}")
    print(f"{'code':<24}{'peak RSS (MB)':>15}{'wall (s)':>10}")
    for label, r in rows.items():
        name = f"base {a.base_rev}" if label == "base" else "today"
        print(f"{name:<24}{r['peak_rss_mb']:>15.1f}{r['wall_s']:>10.1f}")
    print(f"today / base = {ratio:.2f} (goal <= 0.5: {'met' if ratio <= 0.5 else 'NOT met'})")
    out = ROOT / "bench" / "results" / "train_memory.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if result["load_warning"]:
        print(result["load_warning"], file=sys.stderr)


if __name__ == "__main__":
    main()
