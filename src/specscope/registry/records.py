"""Building run records: one helper for every producer (generate, benchmarks, demo, ingest, server).

    rec = make_record("bench", "mt-bench fp32", config={...}, profiler=prof, results={"per_prompt": [...]})
    run_id = store_record(rec)            # or open_registry(db).add_run(rec)

Content hashes for model directories are *fast* hashes ("fast1:" prefix): sha256 over, per weight file in name
order, its name, size, safetensors header (the tensor names, shapes, dtypes and offsets) and its first and last MiB,
plus config.json in full. Reading 2 MiB per file instead of gigabytes still tells apart different checkpoints,
different conversions and truncated copies; two files that differ only in the middle of a tensor would collide,
which for checkpoints in practice means the same weights.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from specscope.errors import SpecscopeError
from specscope.jsonio import dtype_name
from specscope.registry.db import open_registry
from specscope.registry.fingerprint import collect
from specscope.registry.metrics import RunMetrics

_MIB = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_hash_cache: dict = {}


def model_hash(path) -> str | None:
    """Fast content hash of a checkpoint directory or weight file; None for names that are not paths (e.g. "ngram")."""
    p = Path(str(path)).expanduser()
    if not p.exists():
        return None
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file() and
                                           (f.suffix in WEIGHT_SUFFIXES or f.name == "config.json"))
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key in _hash_cache:
        return _hash_cache[key]
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if f.name == "config.json":
                h.update(fh.read())
                continue
            if f.suffix == ".safetensors" and size >= 8:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n <= min(size - 8, 100 * _MIB):
                    h.update(fh.read(n))
            fh.seek(0)
            h.update(fh.read(_MIB))
            if size > 2 * _MIB:
                fh.seek(size - _MIB)
                h.update(fh.read(_MIB))
    digest = "fast1:" + h.hexdigest()[:32]
    _hash_cache[key] = digest
    return digest


def prompt_set_hash(prompts) -> str:
    """sha256 of the prompts as JSON (order matters: per-prompt results are matched by position)."""
    return "sha256:" + hashlib.sha256(json.dumps(list(prompts), ensure_ascii=False).encode()).hexdigest()[:32]


def results_from_summary(summary: dict) -> dict:
    """The registry's `results` fields from a `CycleProfiler.summary()`."""
    return RunMetrics.from_profile(summary).to_results()


def per_prompt_stats(res, index: int | None = None, **extra) -> dict:
    """One entry of `samples["per_prompt"]` from a GenerationResult (Spec-Bench's per-question numbers: tok/s
    over new tokens and wall time with prefill; τ when speculative). `compare` falls back to these for tok/s."""
    out = {"index": index, "prompt_tokens": res.prompt_len, "new_tokens": res.num_tokens,
           "seconds": round(res.seconds, 6), "prefill_s": round(res.prefill_s, 6),
           "tok_per_s": round(res.tok_per_s, 4), "stop_reason": res.stop_reason}
    if res.stats is not None:
        out["cycles"] = res.stats.cycles
        out["accept_length"] = round(res.stats.accept_length, 4)
    out.update(extra)
    return out


def machine_config(model_path, dtype, device) -> dict:
    """A run config's keys for what ran where: the target's directory, its dtype and device, torch's threads."""
    import torch    # the registry's readers (report, compare, runs) never need it

    return {"model": str(model_path), "dtype": dtype_name(dtype), "device": str(device),
            "threads": torch.get_num_threads()}


def drafting_config(spec_cfg=None) -> dict:
    """A run config's drafting knobs from a SpecConfig; a baseline run (None) has None for each, so that `compare`
    and `tune` line the two up."""
    if spec_cfg is None:
        return {"steps": None, "topk": None, "draft_tokens": None}
    return {"steps": spec_cfg.steps, "topk": spec_cfg.topk, "draft_tokens": spec_cfg.draft_tokens,
            "ngram_tokens": spec_cfg.ngram_tokens}


def make_record(kind: str, name: str = "", config: dict | None = None, profiler=None, results: dict | None = None,
                samples: dict | None = None, tags=(), env: dict | None = None, metrics: RunMetrics | None = None,
                **extra) -> dict:
    """A registry record. Its `results` are `metrics` (what the run measured; else the `profiler`'s, a
    CycleProfiler) with explicit `results` over them key by key; `samples` the profiler's, `samples` over them.
    `env` defaults to a fresh fingerprint. Extra keyword arguments become extra top-level keys (preserved by the
    registry)."""
    if not kind:
        raise SpecscopeError("make_record needs a kind, e.g. 'bench'")
    config = dict(config or {})
    for key in ("model", "draft"):
        if config.get(key) and not config.get(f"{key}_hash"):
            config[f"{key}_hash"] = model_hash(config[key])
    metrics = RunMetrics.measured(profiler) if metrics is None else metrics.copy()
    res = metrics.update(results).to_results()
    smp = dict(profiler.samples()) if profiler is not None else {}
    smp.update(samples or {})
    return {"kind": kind, "name": name, "tags": list(tags), "config": config,
            "env": env if env is not None else collect(), "results": res, "samples": smp, **extra}


def store_record(record: dict, db=None) -> str:
    """Add a record to the registry at `db` (default location otherwise); returns the run id."""
    with open_registry(db) as reg:
        return reg.add_run(record)
